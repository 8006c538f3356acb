"""The PyTorch executor backend: logit parity with transformers and with the JAX backend, ragged
batches over the paged pool, and bucketed torch.compile without recompilation.

Tolerances: float32 max abs diff < 2e-3 (as the JAX model's tests); bfloat16 (weights,
activations and KV in bf16, float32 norms/softmax/logits) within 5% of the largest |logit|, and
the top token of each row among the reference's top 3.
"""

from __future__ import annotations

import checkpoints as ck
import numpy as np
import pytest
from model_helpers import PagedModel, hf_logits

from sgl_tpu import Engine
from sgl_tpu.backends.torch.device import default_dtype
from sgl_tpu.choices import check_registry_names
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, resolve_backend, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
ATOL = 2e-3


class TorchPaged:
    """A torch runner plus page bookkeeping: EXTEND logits of every new token (row_logits of the
    step's hidden states) and DECODE top-K log-probs."""

    def __init__(self, loaded, dtype: str = "float32", page_size: int = 4,
                 torch_compile: str = "off", quantization: str = "auto"):
        args = ServerArgs(skip_warmup=True, backend="torch", torch_compile=torch_compile,
                          dtype=dtype, quantization=quantization,
                          page_size=page_size, max_total_tokens=4096, kv_tile=max(8, page_size),
                          min_token_bucket=16, chunked_prefill_size=256, max_running_requests=8,
                          max_extend_seqs=8)
        cfg = runner_config(args, 4096)
        self.runner = create_model_runner(loaded.config, loaded.params, cfg)
        self.ps = page_size
        self.next_page = 1

    def new_pages(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // self.ps)
        pages = np.arange(self.next_page, self.next_page + n, dtype=np.int32)
        self.next_page += n
        return pages

    def extend(self, seqs) -> list[np.ndarray]:
        """seqs: (token_ids, prefix_len, pages) -> logits [n_i, V] of every new token."""
        steps = [SeqStep(token_ids=t, prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                         num_output_tokens=0) for t, p, pg in seqs]
        res = self.runner.forward(ForwardMode.EXTEND, steps)
        total = sum(len(t) for t, _, _ in seqs)
        logits = self.runner.row_logits(res.hidden, np.arange(total))
        out, t = [], 0
        for toks, _, _ in seqs:
            out.append(logits[t : t + len(toks)])
            t += len(toks)
        return out

    def decode(self, seqs):
        """seqs: (token_id, prefix_len, pages) -> StepResult (top-K ids / log-probs per row)."""
        steps = [SeqStep(token_ids=[t], prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                         num_output_tokens=1) for t, p, pg in seqs]
        return self.runner.forward(ForwardMode.DECODE, steps)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _assert_close(got: np.ndarray, ref: np.ndarray, dtype: str,
                  scale: np.ndarray | None = None) -> None:
    """float32: within ATOL; bfloat16: within 5% of the largest |logit| (`scale`: the logits
    that log-probs `ref` were taken from, whose rounding moves them) and the top token one of
    the reference's top 3."""
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, atol=ATOL)
        return
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref if scale is None else scale).max()
    top3 = np.argsort(-ref, axis=-1)[..., :3]
    assert (top3 == got.argmax(-1)[..., None]).any(-1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch,kw", ck.ARCH_CASES)
def test_prefill_and_decode_match_transformers(tmp_path, arch, kw, dtype):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", arch, **kw)
    loaded = load_model(model_dir)
    if dtype == "bfloat16" and loaded.config.num_experts:
        pytest.skip("bfloat16 rounding may swap near-tied experts of a random router (a "
                    "different top-k, not an error); see test_moe.py for MoE in bfloat16")
    ids = np.random.default_rng(0).integers(3, loaded.config.vocab_size, 23).tolist()
    ref = hf_logits(model_dir, ids)
    m = TorchPaged(loaded, dtype)
    pages = m.new_pages(len(ids))
    (pre,) = m.extend([(ids[:19], 0, pages)])
    _assert_close(pre, ref[:19], dtype)
    for pos in range(19, 23):
        res = m.decode([(ids[pos], pos, pages)])
        ref_lp = _log_softmax(ref[pos])
        _assert_close(res.top_logprobs[0], ref_lp[res.top_ids[0]], dtype, scale=ref[pos])
        if dtype == "float32":
            assert res.token_ids[0] == ref[pos].argmax()


def test_ragged_batch_equals_each_sequence_alone(tmp_path):
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (30, 7, 18, 11)]
    alone = TorchPaged(loaded)
    ref = [alone.extend([(s, 0, alone.new_pages(len(s)))])[0] for s in seqs]
    m = TorchPaged(loaded)
    # Sequences 0 and 2 have a cached prefix (10 and 9 tokens, one ending mid-page); 1 and 3
    # start fresh; all four run in one ragged EXTEND batch, then one DECODE batch.
    p0, p2 = m.new_pages(30), m.new_pages(18)
    m.extend([(seqs[0][:10], 0, p0), (seqs[2][:9], 0, p2)])
    p1, p3 = m.new_pages(7), m.new_pages(11)
    out = m.extend([(seqs[0][10:], 10, p0), (seqs[1], 0, p1), (seqs[2][9:], 9, p2),
                    (seqs[3], 0, p3)])
    for got, want in zip(out, [ref[0][10:], ref[1], ref[2][9:], ref[3]], strict=True):
        np.testing.assert_allclose(got, want, atol=ATOL)
    nxt = [int(r[-1].argmax()) for r in ref]
    res = m.decode([(nxt[0], 30, p0), (nxt[1], 7, p1), (nxt[2], 18, p2), (nxt[3], 11, p3)])
    for i, s in enumerate(seqs):
        (solo,) = alone.extend([(s + [nxt[i]], 0, alone.new_pages(len(s) + 1))])
        lp = _log_softmax(solo[-1])
        np.testing.assert_allclose(res.top_logprobs[i], lp[res.top_ids[i]], atol=ATOL)


def test_decode_reads_shared_prefix_pages_once_and_correctly(tmp_path):
    """Forks of one prefix (the same leading page ids, as the radix cache hands out) decode in
    one batch, through the shared-prefix split of decode attention, as each would alone."""
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    rng = np.random.default_rng(5)
    vocab = loaded.config.vocab_size
    # 64 whole pages of 4 (one 256-key chunk: the shared part is whole chunks), then 2 tokens
    prefix = rng.integers(3, vocab, 258).tolist()
    tails = [rng.integers(3, vocab, n).tolist() for n in (6, 1, 13)]
    m = TorchPaged(loaded)
    base = m.new_pages(256)
    m.extend([(prefix[:256], 0, base)])
    seqs = []
    for tail in tails:
        own = m.new_pages(2 + len(tail) + 1)
        pages = np.concatenate([base, own])
        m.extend([(prefix[256:] + tail, 256, pages)])
        seqs.append((prefix + tail, pages))
    nxt = [int(rng.integers(3, vocab)) for _ in seqs]
    res = m.decode([(n, len(s), p) for (s, p), n in zip(seqs, nxt, strict=True)])
    batch = m.runner._decode_batch(m.runner._host_batch(ForwardMode.DECODE, [
        SeqStep(token_ids=[n], prefix_len=len(s), pages=p, sampling=GREEDY, seed=0,
                num_output_tokens=0) for (s, p), n in zip(seqs, nxt, strict=True)], 3))
    assert batch.shared_slots.shape[0] == 256  # the 64 common pages, read once
    alone = TorchPaged(loaded)
    for i, ((s, _), n) in enumerate(zip(seqs, nxt, strict=True)):
        pages = alone.new_pages(len(s) + 1)
        alone.extend([(s[:256], 0, pages)])  # (two steps: an EXTEND takes at most 256 tokens)
        (solo,) = alone.extend([(s[256:] + [n], 256, pages)])
        lp = _log_softmax(solo[-1])
        np.testing.assert_allclose(res.top_logprobs[i], lp[res.top_ids[i]], atol=ATOL)


@pytest.fixture(scope="module")
def smol_jax_mixed_batch():
    """SmolLM2 through the JAX runner (float32), computed once for both torch dtypes: a ragged
    EXTEND batch (one sequence with a cached prefix ending mid-page, one fresh), then the DECODE
    batch of each sequence's argmax. -> (loaded, (a, b), EXTEND logits, next ids, DECODE
    logits)."""
    loaded = load_model(None)
    rng = np.random.default_rng(2)
    a, b = (rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (45, 20))
    jax_m = PagedModel(loaded, page_size=16)
    pa, pb = jax_m.new_pages(46), jax_m.new_pages(21)
    jax_m.run(ForwardMode.EXTEND, [(a[:21], 0, pa)])
    ext = jax_m.run(ForwardMode.EXTEND, [(a[21:], 21, pa), (b, 0, pb)])
    nxt = [int(ext[0][-1].argmax()), int(ext[1][-1].argmax())]
    dec = jax_m.run(ForwardMode.DECODE, [([nxt[0]], 45, pa), ([nxt[1]], 20, pb)])
    return loaded, (a, b), ext, nxt, dec


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_backends_agree_on_a_mixed_batch(smol_jax_mixed_batch, dtype):
    """SmolLM2: the JAX and torch runners give the same logits for a ragged EXTEND batch (one
    sequence with a cached prefix ending mid-page, one fresh) and the following DECODE batch."""
    loaded, (a, b), jax_ext, nxt, jax_dec = smol_jax_mixed_batch
    # float32: the exact block kernels (auto takes int8 activations where tiles are built)
    torch_m = TorchPaged(loaded, dtype, page_size=16,
                         quantization="gguf" if dtype == "float32" else "auto")
    ta, tb = torch_m.new_pages(46), torch_m.new_pages(21)
    torch_m.extend([(a[:21], 0, ta)])
    torch_ext = torch_m.extend([(a[21:], 21, ta), (b, 0, tb)])
    for got, want in zip(torch_ext, jax_ext, strict=True):
        _assert_close(got, want, dtype)
    res = torch_m.decode([(nxt[0], 45, ta), (nxt[1], 20, tb)])
    for i in range(2):
        lp = _log_softmax(jax_dec[i][0])
        _assert_close(res.top_logprobs[i], lp[res.top_ids[i]], dtype, scale=jax_dec[i][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_equals_eager(tmp_path, dtype):
    """torch.compile'd layers (F.linear) == eager (oneDNN-prepacked linears in bfloat16)."""
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "qwen2"))
    ids = np.random.default_rng(4).integers(3, loaded.config.vocab_size, 21).tolist()
    out = []
    for mode in ("on", "off"):
        m = TorchPaged(loaded, dtype, torch_compile=mode)
        pages = m.new_pages(len(ids))
        (ext,) = m.extend([(ids[:20], 0, pages)])
        out.append((ext, m.decode([(ids[20], 20, pages)])))
    (c_ext, c_dec), (e_ext, e_dec) = out
    tol = 1e-4 if dtype == "float32" else 0.05 * np.abs(e_ext).max()
    np.testing.assert_allclose(c_ext, e_ext, atol=tol)
    if dtype == "float32":
        np.testing.assert_array_equal(c_dec.top_ids[0, :3], e_dec.top_ids[0, :3])
    else:  # near-ties of a random tiny model may swap in bfloat16
        assert e_dec.top_ids[0, 0] in c_dec.top_ids[0, :3]


def test_auto_backend_and_bad_choices():
    assert resolve_backend("auto") == "torch"  # CPU with torch installed
    assert resolve_backend("jax") == "jax"
    with pytest.raises(ValueError, match="backend"):
        check_registry_names(ServerArgs(backend="tensorflow"))
    with pytest.raises(ValueError, match="attention_backend 'pallas' runs on the jax"):
        check_registry_names(ServerArgs(backend="torch", attention_backend="pallas"))
    with pytest.raises(ValueError, match="device"):
        ServerArgs(device="npu")
    with pytest.raises(ValueError, match="torch_compile"):
        ServerArgs(torch_compile="maybe")
    cfg = runner_config(ServerArgs(backend="torch"), 2048)
    # CPU auto: bf16 where the CPU has AMX, else float32
    assert cfg.backend == "torch" and cfg.dtype == default_dtype("cpu") and not cfg.compile
    from sgl_tpu.backends.torch.kernels import cpu_extension

    # the fused CPU kernel when `make install` built it (bfloat16 products where the build has
    # AVX512-BF16), else the SDPA path
    ext = cpu_extension.load()
    fused = "torch-cpu-fused-bf16" if getattr(ext, "bf16_dots", False) else "torch-cpu-fused"
    assert cfg.attention_backend == (fused if ext is not None else "torch-sdpa")


def test_compiled_buckets_do_not_recompile_on_mixed_traffic(tmp_path):
    """torch.compile(dynamic=False): warm-up compiles every bucket; mixed traffic (chunked
    prefill, cached prefixes, all samplers, penalties, n > 1, logprobs) compiles nothing."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    engine = Engine(model_dir, backend="torch", torch_compile="on", page_size=4,
                    max_total_tokens=2048,
                    max_running_requests=4, max_extend_seqs=4, chunked_prefill_size=64,
                    min_token_bucket=32, kv_tile=16)
    try:
        runner = engine.scheduler.runner
        assert runner.backend == "torch" and runner.config.compile
        compiled = runner.num_compilations()
        # 3 compiled functions (pre / post / final norm) per token and sequence bucket.
        assert compiled == 3 * (len(runner.config.token_buckets) + len(runner.config.seq_buckets))
        vocab = engine.model_config.vocab_size
        rng = np.random.default_rng(3)
        shared = rng.integers(3, vocab, 100).tolist()
        prompts = [shared + rng.integers(3, vocab, n).tolist() for n in (5, 40, 1, 70)]
        params = [{"temperature": 0, "max_new_tokens": 9},
                  {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "seed": 1},
                  {"temperature": 1.0, "top_k": 5, "min_p": 0.1, "max_new_tokens": 3},
                  {"temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": 0.2,
                   "repetition_penalty": 1.2, "max_new_tokens": 12}]
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               logprob_start_len=90, top_logprobs_num=3)
        assert [o["meta_info"]["completion_tokens"] for o in outs][0] == 9
        engine.generate(input_ids=prompts[0], sampling_params={"n": 3, "max_new_tokens": 4})
        assert runner.num_compilations() == compiled
        engine.scheduler.check_integrity()
    finally:
        engine.shutdown()
