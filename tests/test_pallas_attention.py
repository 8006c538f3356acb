"""The Pallas ragged paged attention kernel, run on CPU in TPU interpret mode, equals the
pure-jax.numpy reference; its KV update writes exactly the page-table slots, in place; the model's
logits through it equal the reference's; and it lowers to Mosaic for TPU.

Tolerances (kernel vs reference, same dtype): float32 atol/rtol 1e-5 (same tiling and online
softmax, so differences are float rounding only); bfloat16 atol 2e-2 on outputs of order 1
(both round p to bfloat16 before the PV product and the output to bfloat16: a few ulps of 2^-8).
Each case runs once: interpret mode is slow, so the cases combine the required dimensions
(page size, GQA ratio, head dim, dtype, batch kind) instead of taking their cross product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import paged_batch as _batch
from attention_helpers import random_pools as _pools

from sgl_tpu.backends.jax.forward_batch import ShapeBuckets, build_forward_batch
from sgl_tpu.choices import check_registry_names
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.attention_registry import get_attention_backend, resolve_attention_backend
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.kernels import paged_attention_ref as ref
from sgl_tpu.kernels import ragged_paged_attention as rpa
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TOL = {jnp.float32: {"atol": 1e-5, "rtol": 1e-5}, jnp.bfloat16: {"atol": 2e-2, "rtol": 0}}
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


# (mode, (prefix_len, new_len) per sequence, page_size, GQA group, head_dim, dtype, kv_tile,
#  block_q, sliding_window, logit_cap). Prefixes 10, 20, 33, 21, 5, 70, 100 end mid-page.
CASES = {
    "decode-ps16-g1-d128-f32": (DECODE, [(37, 1), (0, 1), (70, 1)], 16, 1, 128, jnp.float32,
                                32, 1, None, None),
    "decode-ps64-g8-d64-bf16-window-cap": (DECODE, [(100, 1), (3, 1), (64, 1)], 64, 8, 64,
                                           jnp.bfloat16, 64, 1, 20, 30.0),
    "prefill-ps64-g8-d64-bf16": (EXTEND, [(0, 40), (0, 9)], 64, 8, 64, jnp.bfloat16, 128, 16,
                                 None, None),
    "mixed-ps16-g3-d64-f32": (EXTEND, [(10, 7), (0, 5), (20, 1), (33, 20)], 16, 3, 64,
                              jnp.float32, 32, 8, None, None),
    "mixed-ps16-g3-d128-bf16-window-cap": (EXTEND, [(21, 12), (5, 1), (0, 30)], 16, 3, 128,
                                           jnp.bfloat16, 16, 16, 12, 20.0),
    "mixed-ps64-g1-d64-f32-window": (EXTEND, [(70, 9), (0, 3), (64, 1)], 64, 1, 64,
                                     jnp.float32, 64, 8, 40, None),
    # Gemma 3's head_dim 256 with a window that starts mid-page inside the cached prefix
    "mixed-ps16-g4-d256-f32-window": (EXTEND, [(21, 12), (0, 5)], 16, 4, 256, jnp.float32, 16,
                                      8, 10, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    mode, seqs, ps, group, d, dtype, kv_tile, block_q, window, cap = CASES[case]
    rng = np.random.default_rng(len(case))
    kvh, num_pages = 2, 24
    fb = _batch(rng, mode, seqs, page_size=ps, kv_tile=kv_tile, block_q=max(block_q, 8),
                num_pages=num_pages, max_pages=16 if ps == 16 else 4)
    k_pool, v_pool = _pools(rng, kvh=kvh, num_pages=num_pages, page_size=ps, d=d, dtype=dtype)
    num_tokens = fb.input_ids.shape[0]
    q = jnp.asarray(rng.standard_normal((num_tokens, kvh * group, d)), dtype)
    kw = dict(kv_tile=kv_tile, scale=d**-0.5, sliding_window=window, logit_cap=cap)
    if mode == DECODE:
        args = (q, k_pool, v_pool, fb.page_table, fb.seq_lens)
        out = rpa.decode_attention(*args, interpret="tpu", **kw)
        expect = ref.decode_attention(*args, **kw)
        rows = len(seqs)
        assert not np.asarray(out[rows:], np.float32).any(), "padding rows must be zero"
    else:
        args = (q, k_pool, v_pool, fb.page_table, fb.block_rows, fb.block_seq,
                fb.block_q_start, fb.seq_lens, fb.item_block, fb.item_tile, fb.num_items)
        out = rpa.extend_attention(*args, interpret="tpu", **kw)
        expect = ref.extend_attention(*args, **kw)
        rows = sum(new for _, new in seqs)
    assert out.dtype == dtype and out.shape == q.shape
    got, want = np.asarray(out[:rows], np.float32), np.asarray(expect[:rows], np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOL[dtype])


def test_write_kv_writes_exactly_the_slots_in_place():
    rng = np.random.default_rng(3)
    kvh, num_pages, ps, d = 3, 12, 16, 64
    # A ragged batch of 13 tokens padded to 16: padding tokens write into reserved page 0.
    fb = _batch(rng, EXTEND, [(10, 7), (0, 5), (20, 1)], page_size=ps, kv_tile=16, block_q=8,
                num_pages=num_pages, token_buckets=(16,))
    slots = np.asarray(fb.out_slots)
    real = slots[:13]
    pages_used = np.asarray(fb.page_table)[np.asarray(fb.page_table) > 0]
    assert set(real // ps) <= set(pages_used), "real tokens write only into their own pages"
    k_pool, v_pool = _pools(rng, kvh=kvh, num_pages=num_pages, page_size=ps, d=d,
                            dtype=jnp.float32)
    # Copies: a numpy view of a CPU buffer would pin it and block donation.
    before_k, before_v = np.array(k_pool, copy=True), np.array(v_pool, copy=True)
    k = rng.standard_normal((16, kvh, d)).astype(np.float32)
    v = rng.standard_normal((16, kvh, d)).astype(np.float32)
    k[13:], v[13:] = 0.5, -0.5  # padding tokens all write slot 0 (same values, as in the model)

    step = jax.jit(lambda kp, vp, k, v, s: rpa.write_kv(kp, vp, k, v, s, block_tokens=8,
                                                         interpret="tpu"),
                   donate_argnums=(0, 1))
    k_ptr = k_pool.unsafe_buffer_pointer()
    new_k, new_v = step(k_pool, v_pool, k, v, slots)
    # In place: the donated pool's buffer is the output's (input_output_aliases).
    assert k_pool.is_deleted() and new_k.unsafe_buffer_pointer() == k_ptr

    for new, before, rows in ((new_k, before_k, k), (new_v, before_v, v)):
        flat = np.asarray(new).reshape(kvh, num_pages * ps, d)
        flat_before = before.reshape(kvh, num_pages * ps, d)
        changed = (flat != flat_before).any(axis=(0, 2))
        assert set(np.flatnonzero(changed)) == set(slots.tolist())
        np.testing.assert_array_equal(flat[:, real], rows[:13].transpose(1, 0, 2))
    # The reference scatter gives the same pools.
    want_k, _ = ref.write_kv(jnp.asarray(before_k), jnp.asarray(before_v), k, v, slots)
    np.testing.assert_array_equal(np.asarray(new_k), np.asarray(want_k))


@pytest.mark.parametrize("entry", ["extend", "decode", "write_kv"])
def test_kernels_lower_to_mosaic_for_tpu(entry):
    """Export for the TPU platform runs the Pallas -> Mosaic lowering here, without a TPU."""
    sds, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    kvh, group, d, ps, num_pages, seqs, max_pages, num_tokens = 3, 3, 64, 16, 64, 8, 32, 256
    pool = sds((kvh, num_pages, ps, d), bf16)
    if entry == "extend":
        block_q, num_blocks, num_items = 128, num_tokens // 128 + seqs, 64

        def fn(*a):
            return rpa.extend_attention(*a, kv_tile=256, scale=0.125, sliding_window=512,
                                        logit_cap=30.0)
        args = (sds((num_tokens, kvh * group, d), bf16), pool, pool, sds((seqs, max_pages), i32),
                sds((num_blocks, block_q), i32), sds((num_blocks,), i32),
                sds((num_blocks,), i32), sds((seqs,), i32), sds((num_items,), i32),
                sds((num_items,), i32), sds((), i32))
    elif entry == "decode":
        def fn(*a):
            return rpa.decode_attention(*a, kv_tile=256, scale=0.125)
        args = (sds((seqs, kvh * group, d), bf16), pool, pool, sds((seqs, max_pages), i32),
                sds((seqs,), i32))
    else:
        fn = rpa.write_kv
        args = (pool, pool, sds((num_tokens, kvh, d), bf16), sds((num_tokens, kvh, d), bf16),
                sds((num_tokens,), i32))
    exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(*args)
    assert "tpu_custom_call" in exported.mlir_module()


def test_attention_backend_flag_resolution():
    from sgl_tpu.cli import parse_args

    assert resolve_attention_backend("auto", platform="tpu") == "pallas"
    assert resolve_attention_backend("auto", platform="cpu") == "ref"
    assert resolve_attention_backend("auto", platform="gpu") == "gathered"
    assert ServerArgs().attention_backend == "auto"
    assert runner_config(ServerArgs(backend="jax"), 4096).attention_backend == (
        "pallas" if jax.default_backend() == "tpu" else "ref")
    args = parse_args(["--backend", "jax", "--attention-backend", "pallas-interpret"])
    assert runner_config(args, 4096).attention_backend == "pallas-interpret"
    assert get_attention_backend("pallas").extend_attention.keywords == {"interpret": None}
    with pytest.raises(ValueError, match="attention_backend"):
        check_registry_names(ServerArgs(attention_backend="flash"))
    with pytest.raises(ValueError, match="runs on the torch executor"):
        resolve_attention_backend("torch-sdpa", "jax")
    with pytest.raises(SystemExit):
        parse_args(["--attention-backend", "flash"])


NUM_DEFAULT_MODEL_LAYERS = 4


@pytest.mark.slow
def test_default_model_logits_through_kernel_equal_reference():
    """SmolLM2's first layers (9 heads / 3 KV heads, d 64, its real weights and activations):
    a mixed EXTEND batch (a continued prefix ending mid-page, a fresh prompt, a one-token
    continuation) and then a DECODE step, through the kernel in TPU interpret mode and through
    the reference, from the same pools.

    Every layer runs the same attention call, and each layer's interpreted kernel is unrolled
    into the step's program, so the compile time grows with the depth: 4 of the 30 layers
    (with the final norm and the vocabulary head) test the same kernel on the same shapes in
    a quarter of the CPU time (43 s against 165 s)."""
    import dataclasses
    from functools import partial

    from sgl_tpu.backends.jax.models import llama
    from sgl_tpu.backends.jax.runner import params_to_device
    from sgl_tpu.loader import load_model

    loaded = load_model(None)
    assert loaded.config.num_layers == 30
    cfg = dataclasses.replace(loaded.config, num_layers=NUM_DEFAULT_MODEL_LAYERS)
    params = params_to_device({**loaded.params,
                               "layers": loaded.params["layers"][:NUM_DEFAULT_MODEL_LAYERS]},
                              jnp.float32)
    ps, kv_tile, block_q, max_pages, num_pages = 16, 16, 8, 2, 6

    def fwd(params, pools, fb, *, mode, backend):
        hidden, pools = llama.forward(params, pools, fb, cfg, mode, kv_tile=kv_tile,
                                      attention_backend=backend)
        return llama.compute_logits(params, hidden, cfg), pools

    def batch(mode, seqs):
        steps = [SeqStep(token_ids=t, prefix_len=p, pages=np.array(pg), sampling=GREEDY, seed=0,
                         num_output_tokens=0) for t, p, pg in seqs]
        shape = ShapeBuckets(token_buckets=(16,), seq_buckets=(4,), max_extend_seqs=4,
                             max_pages=max_pages, block_q=block_q, vocab_words=1,
                             pages_per_tile=1).shape_for(mode, steps)
        return build_forward_batch(steps, shape, ps)

    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, cfg.vocab_size, n).tolist() for n in (17, 5, 6))
    prefix = batch(EXTEND, [(a[:10], 0, [1, 2]), (c[:5], 0, [3])])
    mixed = batch(EXTEND, [(a[10:], 10, [1, 2]), (b, 0, [4]), (c[5:], 5, [3])])
    decode = batch(DECODE, [([7], 17, [1, 2]), ([8], 5, [4]), ([9], 6, [3])])
    shape = (cfg.num_kv_heads, num_pages, ps, cfg.head_dim)
    logits = {}
    for backend in ("ref", "pallas-interpret"):
        step = jax.jit(partial(fwd, backend=backend), static_argnames=("mode",))
        pools = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers)]
        _, pools = step(params, pools, prefix, mode=EXTEND)
        ext, pools = step(params, pools, mixed, mode=EXTEND)
        dec, pools = step(params, pools, decode, mode=DECODE)
        logits[backend] = np.asarray(ext)[:13], np.asarray(dec)[:3]
    for got, want in zip(logits["pallas-interpret"], logits["ref"], strict=True):
        assert np.abs(want).max() > 1.0
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
