"""The fused CPU layer ops (backends/torch/kernels/layer_ops_cpu.py) against the torch ops they
replace in backends/torch/models/llama.py: norms, RoPE + K/V write into scattered pool slots (page
boundaries, ragged rows, padding rows on slot 0), SwiGLU, float32 and bfloat16, single-task and
multi-threaded row counts, Qwen3's q/k norms; then whole runners with the ops on and off (tiny
Llama, Qwen2 and Qwen3 checkpoints, and the default model's greedy tokens)."""

from __future__ import annotations

import dataclasses
import platform

import checkpoints as ck
import gemma_checkpoints as gc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sgl_tpu.backends.torch import paged_attention as sdpa
from sgl_tpu.backends.torch.kernels import layer_ops_cpu
from sgl_tpu.backends.torch.kv_pool import quantize_int8
from sgl_tpu.backends.torch.models import llama as llama_torch
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(layer_ops_cpu.load() is None,
                                reason=f"not built: {layer_ops_cpu.why_unavailable()}")

DTYPES = [torch.float32, torch.bfloat16]
# float32: only the summation order of the norm differs; bfloat16: both sides round the same
# float32 value once, so at most one bf16 step (2^-8 relative) apart
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-2}}
ROWS = [1, 5, 130]  # 130 rows of 576 features split over threads
GREEDY = SamplingParams(temperature=0.0)


def ops():
    return layer_ops_cpu.load()


def _rand(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_norms_equal_torch(dtype, rows):
    n = 576
    w = _rand(n, dtype=torch.float32, seed=1)
    wide = _rand(rows, n + 64, dtype=dtype, seed=2)
    x = wide[:, :n]  # rows with a stride, as a slice of a wider output
    torch.testing.assert_close(ops().rms_norm(x, w, 1e-5), llama_torch.rms_norm(x, w, 1e-5),
                               **TOL[dtype])
    h = _rand(rows, n, dtype=dtype, seed=3)
    delta = _rand(rows, n, dtype=dtype, seed=4)
    want_h = h + delta
    y = ops().add_rms_norm(h, delta, w, 1e-5)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # the residual, in place, exact
    torch.testing.assert_close(y, llama_torch.rms_norm(want_h, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_torch(dtype, rows):
    gate_up = _rand(rows, 2 * 96, dtype=dtype) * 6  # silu's tails too
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops().silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


def test_silu_mul_flushes_denormals_only_inside():
    """silu_mul runs with denormal results flushed to zero (its vector code evaluates a
    discarded branch whose results are denormal; docs/backends.md, "Fused layer ops on CPU"):
    on x86 a result below float32's smallest normal comes out 0 (elsewhere 0 or torch's), the
    others as torch has them, and the thread's floating-point mode is restored afterwards
    (torch still makes denormals)."""
    gate = torch.tensor([[1.0, 2.0, -3.0, 0.5, -80.0, 1e-20]], dtype=torch.float32)
    up = torch.tensor([[1e-38, 1.0, 1.0, 1e-39, 1.0, 1e-20]], dtype=torch.float32)
    out = ops().silu_mul(torch.cat([gate, up], dim=1))  # [1, 6]
    want = F.silu(gate) * up
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    assert normal.tolist() == [[False, True, True, False, True, False]]
    torch.testing.assert_close(out[normal], want[normal])
    if platform.machine() in ("x86_64", "AMD64"):
        assert torch.all(out[~normal] == 0)
    else:
        assert torch.all((out[~normal] == 0) | (out[~normal] == want[~normal]))
    assert (torch.tensor([1e-38]) / 4).item() != 0.0  # no flush left behind


def _ragged_slots(page_size: int, lens: list[int], num_pages: int, seed: int) -> torch.Tensor:
    """Slots of each sequence's next `n` positions on scattered pages (runs that cross page
    boundaries and start mid-page), then a padding row on slot 0; i64[sum(lens) + 1]."""
    rng = np.random.default_rng(seed)
    pages = iter(1 + rng.permutation(num_pages - 1))
    out = []
    for i, n in enumerate(lens):
        start = 3 * i + 1  # cached prefix length: the run starts mid-page
        seq_pages = [next(pages) for _ in range(-(-(start + n) // page_size))]
        out += [seq_pages[p // page_size] * page_size + p % page_size
                for p in range(start, start + n)]
    return torch.tensor(out + [0], dtype=torch.int64)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1], [5, 1, 9], [64, 66]])
def test_rope_write_kv_equals_torch(dtype, lens, qk_norm):
    h_q, kvh, d, page_size, num_pages = 6, 2, 64, 4, 64
    slots = _ragged_slots(page_size, lens, num_pages, seed=len(lens))
    t = slots.shape[0]
    positions = torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(5))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = llama_torch.rope_tables(positions, inv_freq)  # f32[T, 1, d]
    qkv = _rand(t, (h_q + 2 * kvh) * d, dtype=dtype, seed=6)
    k_pool = _rand(num_pages * page_size, kvh, d, dtype=dtype, seed=7)
    v_pool = _rand(num_pages * page_size, kvh, d, dtype=dtype, seed=8)
    # the torch path: llama_torch.layer_pre's (q/k norms and) RoPE, then write_kv
    q_norm, k_norm = (_rand(d, dtype=torch.float32, seed=s) for s in (9, 10))
    ref_q, ref_k_new = qkv[:, : h_q * d].view(t, h_q, d), qkv[:, h_q * d :][:, : kvh * d]
    ref_k_new = ref_k_new.reshape(t, kvh, d)
    if qk_norm:
        ref_q = llama_torch.rms_norm(ref_q, q_norm, 1e-6)
        ref_k_new = llama_torch.rms_norm(ref_k_new, k_norm, 1e-6)
    ref_qk = llama_torch.apply_rope(torch.cat([ref_q, ref_k_new], dim=1), cos, sin)
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    sdpa.write_kv(ref_k, ref_v, ref_qk[:, h_q:], qkv[:, (h_q + kvh) * d :].view(t, kvh, d),
                  slots)

    norms = (q_norm, k_norm, 1e-6) if qk_norm else ()
    ops().rope_write_kv(qkv, cos, sin, k_pool, v_pool, slots, h_q, kvh, *norms)
    torch.testing.assert_close(qkv[:, : (h_q + kvh) * d].view(t, h_q + kvh, d), ref_qk,
                               **TOL[dtype])
    torch.testing.assert_close(k_pool, ref_k, **TOL[dtype])  # every other slot unchanged
    torch.testing.assert_close(v_pool, ref_v, rtol=0, atol=0)  # v is copied, not computed


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16),
                                    (torch.float32, torch.float8_e5m2),
                                    (torch.bfloat16, torch.float8_e5m2),
                                    (torch.float32, torch.int8), (torch.bfloat16, torch.int8)],
                         ids=["f32-bf16pool", "f32-fp8pool", "bf16-fp8pool", "f32-int8pool",
                              "bf16-int8pool"])
@pytest.mark.parametrize("lens", [[5, 1, 9], [64, 66]])
def test_rope_write_kv_rounds_rows_into_a_narrower_pool(lens, dtypes):
    """Pools narrower than qkv (`--kv-cache-dtype bfloat16` / `fp8_e5m2` / `int8`): q and k
    rotated as with pools of qkv's dtype, the pool rows bit-exactly write_kv's rounding of them
    (torch's round-to-nearest-even; fp8 saturated at its largest finite value, not inf; int8
    head rows quantized with the same scale bits)."""
    dtype, pool_dtype = dtypes
    h_q, kvh, d, page_size, num_pages = 6, 2, 64, 4, 64
    slots = _ragged_slots(page_size, lens, num_pages, seed=len(lens))
    t = slots.shape[0]
    positions = torch.randint(0, 4000, (t,), generator=torch.Generator().manual_seed(5))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = llama_torch.rope_tables(positions, inv_freq)
    qkv = _rand(t, (h_q + 2 * kvh) * d, dtype=dtype, seed=6)
    qkv[0, -1], qkv[0, -2] = 1e6, -1e6  # past fp8 e5m2's range: saturated
    k_pool, v_pool = (
        quantize_int8(_rand(num_pages * page_size, kvh, d, dtype=torch.float32, seed=seed))
        if pool_dtype == torch.int8 else
        _rand(num_pages * page_size, kvh, d, dtype=pool_dtype, seed=seed) for seed in (7, 8))
    ref_qkv, ref_k, ref_v = qkv.clone(), k_pool.clone(), v_pool.clone()
    wide = torch.zeros(num_pages * page_size, kvh, d, dtype=dtype)
    ops().rope_write_kv(ref_qkv, cos, sin, wide, wide.clone(), slots, h_q, kvh)
    rotated = ref_qkv.view(t, h_q + 2 * kvh, d)
    sdpa.write_kv(ref_k, ref_v, rotated[:, h_q : h_q + kvh], rotated[:, h_q + kvh :], slots)

    ops().rope_write_kv(qkv, cos, sin, k_pool, v_pool, slots, h_q, kvh)
    assert torch.equal(qkv, ref_qkv)  # q, k rotated exactly as with a pool of qkv's dtype
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.uint8
    assert torch.equal(k_pool.view(bits), ref_k.view(bits))
    assert torch.equal(v_pool.view(bits), ref_v.view(bits))
    if pool_dtype == torch.int8:
        return
    big = v_pool[slots[0], -1, -2:].float()
    want = torch.finfo(pool_dtype).max if pool_dtype == torch.float8_e5m2 else 1e6
    assert big[1] == pytest.approx(want, rel=1e-2) and big[0] == -big[1]
    with pytest.raises(RuntimeError, match="bfloat16 under float32 qkv; got qkv BFloat16"):
        ops().rope_write_kv(qkv.bfloat16(), cos, sin, k_pool.float(), v_pool.float(), slots,
                            h_q, kvh)


def test_rope_write_kv_rejects_bad_slots_and_shapes():
    qkv = torch.zeros(2, 4 * 16)
    pool = torch.zeros(8, 1, 16)
    cos = sin = torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        ops().rope_write_kv(qkv, cos, sin, pool, pool.clone(), torch.tensor([1, 8]), 2, 1)
    with pytest.raises(RuntimeError, match=r"\(H \+ 2 kvh\) heads"):
        ops().rope_write_kv(qkv, cos, sin, pool, pool.clone(), torch.tensor([1, 2]), 3, 1)


class Runner:
    """A torch runner (fused layer ops on or off) and a page counter."""

    def __init__(self, loaded, dtype: str, layer_ops: bool, page_size: int = 4, **kw):
        args = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off", dtype=dtype,
                          page_size=page_size, max_total_tokens=2048, chunked_prefill_size=256,
                          max_running_requests=4, max_extend_seqs=4, **kw)
        cfg = dataclasses.replace(runner_config(args, 2048), cpu_layer_ops=layer_ops)
        self.runner = create_model_runner(loaded.config, loaded.params, cfg)
        assert self.runner.layer_ops == layer_ops
        self.ps, self.next_page = page_size, 1

    def pages(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // self.ps)
        self.next_page += n
        return np.arange(self.next_page - n, self.next_page, dtype=np.int32)

    def step(self, mode, seqs):
        """seqs: (token_ids, prefix_len, pages) -> StepResult."""
        return self.runner.forward(mode, [
            SeqStep(token_ids=t, prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                    num_output_tokens=int(mode == ForwardMode.DECODE)) for t, p, pg in seqs])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_runner_with_layer_ops_equals_torch_ops(tmp_path, arch, dtype):
    """A ragged EXTEND batch (a cached prefix ending mid-page, a fresh sequence), then two
    DECODE steps: the same logits and greedy tokens with the fused ops as with torch's (Gemma:
    sliding-window layers, its four norms, Gemma 2's soft-caps, Gemma 3's q/k norms). Both
    runs decode the torch run's tokens, so each step compares the same context even where a
    bfloat16 near-tie swaps a token."""
    make = gc.make_tiny_gemma if arch.startswith("gemma") else ck.make_tiny_hf_checkpoint
    loaded = load_model(make(tmp_path / "m", arch))
    rng = np.random.default_rng(3)
    a, b = (rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (19, 10))
    results, inputs = [], []
    for layer_ops in (False, True):
        m = Runner(loaded, dtype, layer_ops)
        pa, pb = m.pages(24), m.pages(14)
        m.step(ForwardMode.EXTEND, [(a[:7], 0, pa)])
        ext = m.step(ForwardMode.EXTEND, [(a[7:], 7, pa), (b, 0, pb)])
        logits = m.runner.row_logits(ext.hidden, np.arange(len(a) - 7 + len(b)))
        decs = []
        for i in range(2):
            if not layer_ops:
                prev = ext if i == 0 else decs[-1]
                inputs.append([int(t) for t in prev.token_ids])
            toks = inputs[i]
            decs.append(m.step(ForwardMode.DECODE, [([toks[0]], len(a) + i, pa),
                                                    ([toks[1]], len(b) + i, pb)]))
        results.append((logits, decs))
    (ref_logits, ref_decs), (got_logits, got_decs) = results
    tol = 1e-4 if dtype == "float32" else 0.05 * np.abs(ref_logits).max()
    np.testing.assert_allclose(got_logits, ref_logits, atol=tol)
    for got, ref in zip(got_decs, ref_decs, strict=True):
        if dtype == "float32":
            np.testing.assert_array_equal(got.token_ids, ref.token_ids)
            np.testing.assert_allclose(got.top_logprobs, ref.top_logprobs, atol=1e-4)
        else:  # near-ties of a random tiny model may swap in bfloat16
            assert all(g in r[:3] for g, r in zip(got.token_ids, ref.top_ids, strict=True))


@pytest.mark.slow
def test_default_model_greedy_tokens_unchanged():
    """SmolLM2 in float32 on the GGUF's own Q4_1 blocks (the exact kernels; `auto` takes int8
    activations where the tiles are built, whose rounding would swap near-ties): 24 greedy tokens of
    two sequences decoded in one batch are the same with the ops on and off."""
    loaded = load_model(None)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (37, 21)]
    outs = []
    for layer_ops in (False, True):
        m = Runner(loaded, "float32", layer_ops, page_size=16, quantization="gguf")
        pages = [m.pages(len(p) + 24) for p in prompts]
        ext = m.step(ForwardMode.EXTEND, [(p, 0, pg) for p, pg in zip(prompts, pages,
                                                                      strict=True)])
        toks = [[int(t)] for t in ext.token_ids]
        for i in range(23):
            dec = m.step(ForwardMode.DECODE, [([t[-1]], len(p) + i, pg) for t, p, pg in
                                              zip(toks, prompts, pages, strict=True)])
            for t, new in zip(toks, dec.token_ids, strict=True):
                t.append(int(new))
        outs.append(toks)
    assert outs[0] == outs[1]


class CountingOps:
    """The layer ops module, counting the calls made through it from Python."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, 0

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.slow
@pytest.mark.parametrize("family,kv", [("tiles", "bfloat16"), ("a8", "bfloat16"),
                                       ("f32", "bfloat16"), ("f32", "int8")])
def test_compiled_decode_layers_equal_the_python_loop(family, kv, monkeypatch):
    """The default model on each family of block kernels over a bfloat16 KV cache (and an
    int8 one: its K/V quantized by the compiled write, read by the compiled attention) (gguf-a8:
    the int8-activation tiles of an AVX512-VNNI build, or its blocks on any build; gguf: the
    float32 blocks): decode steps of two sequences of different lengths, then of one, give
    the same tokens and top log-probabilities, bit for bit, with the layer loop compiled
    (`DecodeLayers`: one call a step, no layer op called from Python) as with it in Python,
    the same kernels in the same order. A step of more rows than the block kernels take runs
    the Python loop."""
    from sgl_tpu.backends.torch.kernels import quant_gemm_cpu

    if family == "tiles" and not quant_gemm_cpu.tiles_for(576):
        pytest.skip("this build has no tile kernels (AVX2 + F16C)")
    if family == "a8":
        monkeypatch.setattr(quant_gemm_cpu, "tiles_for", lambda n: False)
    kinds = {"tiles": {"q4-a8-t16", "q8-a8-t16"}, "a8": {"q4-a8", "q8-a8"},
             "f32": {"q4-f32", "q8-f32"}}[family]
    loaded = load_model(None)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (45, 18)]
    runs = []
    for compiled in (True, False):
        m = Runner(loaded, "float32", True, page_size=16,
                   quantization="gguf" if family == "f32" else "gguf-a8",
                   kv_cache_dtype=kv)
        model = m.runner.model
        assert m.runner.decode_layers and m.runner.compute_info()["decode_layers"] == "compiled"
        assert {p.kernel.kind for p in (model.w.layers[0].wqkv, model.w.lm_head)} == kinds
        limit = m.runner.compute_info()["decode_layers_max_rows"]
        assert limit == model.decode_layers_max_rows and (limit is None) == (family == "tiles")
        m.runner.decode_layers = compiled
        counting = model.layer_ops = CountingOps(model.layer_ops)
        pages = [m.pages(len(p) + 8) for p in prompts]
        ext = m.step(ForwardMode.EXTEND, [(p, 0, pg) for p, pg in zip(prompts, pages,
                                                                      strict=True)])
        toks, decs, calls = [int(t) for t in ext.token_ids], [], []
        for i in range(6):
            live = 2 if i < 4 else 1  # the shorter sequence stops after 4 steps
            if compiled and family != "tiles":  # the first step over the rows limit
                model.decode_layers_max_rows = 1 if i == 0 else 2
            counting.calls = 0
            dec = m.step(ForwardMode.DECODE, [([toks[j]], len(prompts[j]) + i, pages[j])
                                              for j in range(live)])
            calls.append(counting.calls)
            decs.append(dec)
            toks[:live] = [int(t) for t in dec.token_ids]
        over_limit = compiled and family != "tiles"
        assert [c == 0 for c in calls] == [compiled and not (over_limit and i == 0)
                                            for i in range(6)]
        runs.append(decs)
    for got, want in zip(*runs, strict=True):
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        np.testing.assert_array_equal(got.top_ids, want.top_ids)
        np.testing.assert_array_equal(got.top_logprobs, want.top_logprobs)


def test_decode_layers_only_where_every_kernel_is_compiled(tmp_path):
    """Dense projections (a tiny checkpoint) keep the Python loop; the loop refuses kernels
    whose capsules do not carry the signatures it calls, and a q4 and a q8 kernel of different
    families."""
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    m = Runner(loaded, "float32", True)
    assert not m.runner.decode_layers
    assert m.runner.compute_info()["decode_layers"] == "python"
    from sgl_tpu.backends.torch.kernels import cpu_extension, quant_gemm_cpu

    if not quant_gemm_cpu.available() or cpu_extension.load() is None:
        pytest.skip("the compiled CPU kernels are not built")
    gemm, decode = quant_gemm_cpu.kernel_module(), cpu_extension.load().decode_fn

    def build(q4: object, q8: object) -> None:
        ops().DecodeLayers([], [], [], torch.ones(4), (q4, q8, decode), 1, 1, 1e-5, 1.0, False)

    build(gemm.q4_gemm_a8_fn, gemm.q8_gemm_a8_fn)
    build(gemm.q4_gemm_fn, gemm.q8_gemm_fn)
    with pytest.raises(RuntimeError, match=r"expected the capsule sgl_tpu\.q4_gemm_a8_tiles\("
                       r".* or sgl_tpu\.q4_gemm\(x, qs, scale, zero\), got sgl_tpu\.q8"):
        build(gemm.q8_gemm_a8_fn, gemm.q4_gemm_a8_fn)
    with pytest.raises(RuntimeError, match=r"expected the capsule sgl_tpu\.q8_gemm\(x, qs, "
                       r"scale\), got sgl_tpu\.q8_gemm_a8\("):
        build(gemm.q4_gemm_fn, gemm.q8_gemm_a8_fn)
    if not hasattr(gemm, "q8_gemm_a8_tiles_fn"):
        pytest.skip("this build has no tile kernels (AVX2 + F16C)")
    build(gemm.q4_gemm_a8_tiles_fn, gemm.q8_gemm_a8_tiles_fn)
    with pytest.raises(RuntimeError, match=r"expected the capsule sgl_tpu\.q8_gemm_a8\(x, qs, "
                       r"scale\), got sgl_tpu\.q8_gemm_a8_tiles"):
        build(gemm.q4_gemm_a8_fn, gemm.q8_gemm_a8_tiles_fn)
