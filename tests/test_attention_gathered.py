"""The `gathered` attention backend (pages gathered into a dense view) equals the tiled
reference on ragged, paged and shared-prefix batches, decode and extend, with GQA, sliding
windows and soft-caps, reading the page table cut to a width bucket as the runner hands it
over; warm-up plans every width bucket's shapes; and a tiny model served with
`--attention-backend gathered` gives the reference's greedy tokens.

Tolerances (same dtype as the reference): float32 1e-5 (the same products summed in another
order); bfloat16 2e-2 on outputs of order 1 (both round p to bfloat16 before the PV product
and the output to bfloat16, but normalise at different points: a few ulps of 2^-8).
"""

from __future__ import annotations

from functools import partial

import checkpoints as ck
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import paged_batch, random_pools

from sgl_tpu import Engine
from sgl_tpu.backends.jax import paged_attention_gathered as gathered
from sgl_tpu.backends.jax.forward_batch import ShapeBuckets, page_buckets
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.kernels import paged_attention_ref as ref
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TOL = {jnp.float32: {"atol": 1e-5, "rtol": 1e-5}, jnp.bfloat16: {"atol": 2e-2, "rtol": 0}}
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE

# (mode, (prefix_len, new_len) per sequence, page_size, GQA group, head_dim, dtype, kv_tile,
#  block_q, sliding_window, logit_cap, shared_pages). Lengths end mid-page and on page ends.
CASES = {
    "decode-ps16-g1-f32": (DECODE, [(37, 1), (0, 1), (63, 1)], 16, 1, 64, jnp.float32, 32, 1,
                           None, None, 0),
    "decode-ps4-g4-bf16-shared-window-cap": (DECODE, [(40, 1), (43, 1), (32, 1)], 4, 4, 64,
                                             jnp.bfloat16, 16, 1, 20, 30.0, 8),
    "prefill-ps16-g3-bf16": (EXTEND, [(0, 40), (0, 9)], 16, 3, 64, jnp.bfloat16, 32, 16,
                             None, None, 0),
    "mixed-ps4-g3-f32-shared": (EXTEND, [(16, 9), (16, 1), (20, 12), (33, 20)], 4, 3, 32,
                                jnp.float32, 16, 8, None, None, 4),
    "mixed-ps16-g1-f32-window": (EXTEND, [(70, 9), (0, 3), (64, 1)], 16, 1, 64, jnp.float32,
                                 64, 8, 40, None, 0),
    "mixed-ps4-g4-bf16-window-cap": (EXTEND, [(21, 12), (5, 1), (0, 30)], 4, 4, 64,
                                     jnp.bfloat16, 16, 16, 12, 20.0, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_matches_reference(case):
    """The reference reads full-width page tables; the gathered backend reads the table cut
    to its width bucket, as the runner hands it over."""
    mode, seqs, ps, group, d, dtype, kv_tile, block_q, window, cap, shared = CASES[case]
    rng = np.random.default_rng(len(case))
    kvh, num_pages, max_pages = 2, 96, 256 // ps
    batch = dict(page_size=ps, kv_tile=kv_tile, block_q=max(block_q, 8), num_pages=num_pages,
                 max_pages=max_pages, shared_pages=shared)
    fb = paged_batch(np.random.default_rng(0), mode, seqs, **batch)
    cut = paged_batch(np.random.default_rng(0), mode, seqs, **batch,
                      page_widths=page_buckets(max_pages, kv_tile // ps))
    assert cut.page_table.shape[1] < fb.page_table.shape[1], "the width bucket cuts the table"
    k_pool, v_pool = random_pools(rng, kvh=kvh, num_pages=num_pages, page_size=ps, d=d,
                                  dtype=dtype)
    q = jnp.asarray(rng.standard_normal((fb.input_ids.shape[0], kvh * group, d)), dtype)
    kw = dict(kv_tile=kv_tile, scale=d**-0.5, sliding_window=window, logit_cap=cap)

    def run(impl, b):  # jitted, as in the model (eager dispatch of the loops is slow)
        if mode == DECODE:
            fn = jax.jit(partial(impl.decode_attention, **kw))
            return fn(q, k_pool, v_pool, b.page_table, b.seq_lens)
        fn = jax.jit(partial(impl.extend_attention, **kw))
        return fn(q, k_pool, v_pool, b.page_table, b.block_rows, b.block_seq, b.block_q_start,
                  b.seq_lens, b.item_block, b.item_tile, b.num_items)

    want = np.asarray(run(ref, fb), np.float32)
    rows = len(seqs) if mode == DECODE else sum(new for _, new in seqs)
    out = run(gathered, cut)
    assert out.dtype == dtype and out.shape == q.shape
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:rows], want[:rows], **TOL[dtype])
    if mode == DECODE:
        assert not got[rows:].any(), "padding rows must be zero"


def test_page_buckets_and_batch_width():
    assert page_buckets(32, 4) == (4, 8, 16, 32)
    assert page_buckets(24, 4) == (4, 8, 16, 24)
    # The width is the smallest bucket holding the longest sequence's pages (9 -> 16).
    fb = paged_batch(np.random.default_rng(0), DECODE, [(33, 1), (2, 1)], page_size=4,
                     kv_tile=16, block_q=1, num_pages=40, max_pages=32,
                     page_widths=page_buckets(32, 4))
    assert fb.page_table.shape == (4, 16)


def test_warmup_shapes_cover_every_step_shape():
    """Warm-up compiles `ShapeBuckets.warmup_shapes`; every step the scheduler can send (any
    sequence count and length within the limits) must map to one of them, or it compiles
    mid-traffic."""
    sizes = dict(token_buckets=(32, 64), seq_buckets=(1, 2, 4), max_extend_seqs=2, max_pages=32,
                 block_q=16, vocab_words=3, pages_per_tile=4)
    rng = np.random.default_rng(0)
    for widths in (None, page_buckets(32, 4)):
        buckets = ShapeBuckets(**sizes, page_widths=widths)
        planned = buckets.warmup_shapes()
        assert len(planned) == len(set(planned)) == 5 * (1 if widths is None else 4)
        seen = set()
        for _ in range(200):
            mode = EXTEND if rng.random() < 0.5 else DECODE
            n = int(rng.integers(1, 3 if mode == EXTEND else 5))
            lens = rng.integers(1, 32 * 4 + 1, n)
            new = [1] * n if mode == DECODE else [int(rng.integers(1, 33)) for _ in range(n)]
            steps = [SeqStep(token_ids=[1] * k, prefix_len=max(int(t) - k, 0),
                             pages=np.arange(-(-max(int(t), k) // 4)), sampling=GREEDY, seed=0,
                             num_output_tokens=0) for t, k in zip(lens, new, strict=True)]
            shape = buckets.shape_for(mode, steps)
            assert shape in planned
            seen.add(shape)
        assert len(seen) > len(planned) // 2, "the random steps reach most planned shapes"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


def test_engine_greedy_equals_reference(tiny_llama):
    """A tiny model served with the gathered backend gives the reference's greedy tokens
    (float32): two prompts, then one extending a cached one (a radix hit read through shared
    pages), decoding across page-table width buckets (16 -> 32 -> 64 tokens). One request at a
    time keeps the compiled shapes few (the kernel tests above cover ragged batches)."""
    kw = dict(page_size=4, max_total_tokens=512, max_running_requests=1, max_extend_seqs=1,
              chunked_prefill_size=32, min_token_bucket=32, kv_tile=16, block_q=16,
              context_length=64, backend="jax", dtype="float32", skip_warmup=True)
    rng = np.random.default_rng(0)
    first = [rng.integers(3, 200, n).tolist() for n in (13, 20)]
    second = first[1] + rng.integers(3, 200, 5).tolist()
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outputs = {}
    for backend in ("ref", "gathered"):
        eng = Engine(tiny_llama, attention_backend=backend, **kw)
        try:
            assert len(eng.scheduler.runner.page_widths) == (3 if backend == "gathered" else 1)
            outs = eng.generate(input_ids=first, sampling_params=params)
            out = eng.generate(input_ids=second, sampling_params=params)
            assert out["meta_info"]["cached_tokens"] > 0
            outputs[backend] = [o["output_ids"] for o in outs] + [out["output_ids"]]
            eng.scheduler.check_integrity()
        finally:
            eng.shutdown()
    assert all(len(o) == 16 for o in outputs["ref"])
    assert outputs["gathered"] == outputs["ref"]


def test_auto_picks_gathered_on_gpu_only():
    from sgl_tpu.executor.attention_registry import get_attention_backend, resolve_attention_backend

    assert resolve_attention_backend("auto", platform="gpu") == "gathered"
    assert resolve_attention_backend("auto", platform="cpu") == "ref"
    assert get_attention_backend("gathered").bucket_page_table
    assert not get_attention_backend("ref").bucket_page_table
    if jax.default_backend() == "cpu":
        assert resolve_attention_backend("auto", "jax") == "ref"
