"""`--kv-cache-dtype`: the flag (bfloat16 / bf16, fp8_e5m2 and int8 accepted, SGLang's fp8_e4m3
and fp4 refused by name, the jax backend refused; `auto` resolving to bfloat16 under the
machine's float32), int8's quantization round trip and attention over an int8 pool, and a float32
model on the torch backend with a bfloat16, fp8 e5m2 or int8 KV pool: half (about a quarter) of
the pool bytes per token, logits close to the float32 pool's through every torch attention
backend and with the fused layer ops on and off, and (bfloat16) the default model's greedy
tokens unchanged; real servers with an fp8 and an int8 pool. (The kernels' own narrow-pool
tests: test_attention_cpu_fused.py, test_layer_ops_cpu.py.)"""

from __future__ import annotations

import dataclasses

import checkpoints as ck
import numpy as np
import pytest
import requests
import torch
from server_harness import launch_server

from sgl_tpu.backends.torch import paged_attention as pa
from sgl_tpu.backends.torch.kernels import cpu_extension, layer_ops_cpu
from sgl_tpu.backends.torch.kv_pool import dequantize_int8, quantize_int8
from sgl_tpu.cli import parse_args, to_argv
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor import registry
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.kv_dtypes import KV_FLAG_DTYPES, kv_dtype
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PS = 4
# tiny random model, float32 compute: logits of a narrower pool within this fraction of the
# largest float32-pool logit (bfloat16: K/V rounded to 8 significant bits, measured 0.26%;
# fp8 e5m2: 3 bits, measured 17% on this model's random weights; the default model's
# perplexity: docs/quantization.md, "fp8 KV cache")
REL_TOL = {"bfloat16": 0.02, "fp8_e5m2": 0.3, "int8": 0.05}
POOL_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
FUSED = cpu_extension.load() is not None
LAYER_OPS = layer_ops_cpu.load() is not None
# default model: greedy tokens identical for this many steps (measured: all 128 of two
# sequences, for two seeds of random prompts)
NUM_GREEDY = 32


def test_flag_accepts_bfloat16_and_fp8_e5m2_and_refuses_the_rest_by_name(capsys):
    args = parse_args(["--kv-cache-dtype", "bf16"])
    assert args.kv_cache_dtype == "bf16" and parse_args(to_argv(args)) == args
    assert parse_args([]).kv_cache_dtype == "auto"
    args = parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert parse_args(to_argv(args)) == args
    assert runner_config(args.replace(backend="torch"), 2048).kv_dtype == "float8_e5m2"
    for name in ("fp8_e4m3", "fp4_e2m1"):
        with pytest.raises(SystemExit):
            parse_args(["--kv-cache-dtype", name])
        err = capsys.readouterr().err
        assert f"--kv-cache-dtype {name} is not supported" in err
        assert "auto" in err and "bfloat16" in err and "fp8_e5m2" in err
    args = parse_args(["--kv-cache-dtype", "int8"])
    assert parse_args(to_argv(args)) == args
    assert runner_config(args.replace(backend="torch"), 2048).kv_dtype == "int8"
    with pytest.raises(ValueError, match="must be one of"):
        ServerArgs(kv_cache_dtype="float16")
    with pytest.raises(SystemExit):
        parse_args(["--backend", "jax", "--kv-cache-dtype", "bfloat16"])
    assert "--kv-cache-dtype bfloat16 needs the torch backend" in capsys.readouterr().err
    args = ServerArgs(backend="torch", dtype="float32", kv_cache_dtype="bf16")
    cfg = runner_config(args, 2048)
    assert (cfg.kv_cache_dtype, cfg.kv_dtype) == ("bfloat16", "bfloat16")
    assert args.scheduler_config(cfg).kv_cache_dtype == "bfloat16"
    assert runner_config(args.replace(kv_cache_dtype="auto"), 2048).kv_dtype == "float32"
    # --backend auto that resolves to jax (JAX on an accelerator): refused as the runner's
    # config is resolved
    with pytest.raises(ValueError, match="--kv-cache-dtype bf16 needs the torch backend"):
        registry._resolve_kv_cache_dtype(args.replace(backend="auto"), "jax", "bfloat16")


@pytest.mark.parametrize("flags, dtype", [
    ("flags\t: fpu avx2 fma", "float32"),
    ("flags\t: fpu avx2 avx512f avx512_bf16 avx512_fp16", "float32"),  # no AMX: float32
    ("flags\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "bfloat16"),
])
def test_cpu_dtype_auto_is_bfloat16_only_with_amx(monkeypatch, flags, dtype):
    from sgl_tpu.backends.torch import device

    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    assert device.default_dtype("cpu") == dtype


def test_auto_is_bfloat16_only_where_the_dtype_is_the_machines_float32(monkeypatch):
    """`auto` under `--dtype auto` on a CPU without AMX (float32 compute, torch): a
    bfloat16 pool; an explicit `--dtype float32`, a bf16 CPU, deterministic inference and the
    jax backend keep the compute dtype."""
    from sgl_tpu.backends.torch import device

    def resolve(**kw):
        return runner_config(ServerArgs(backend="torch", **kw), 2048)

    monkeypatch.setattr(device, "cpu_has_bf16_units", lambda: False)
    cfg = resolve()
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.kv_dtype) == ("float32", "bfloat16", "bfloat16")
    assert resolve(dtype="float32").kv_dtype == "float32"
    assert resolve(enable_deterministic_inference=True).kv_dtype == "float32"
    assert registry._resolve_kv_cache_dtype(ServerArgs(), "jax", "float32") == "auto"
    monkeypatch.setattr(device, "cpu_has_bf16_units", lambda: True)
    cfg = resolve()
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.kv_dtype) == ("bfloat16", "auto", "bfloat16")


def _runner(loaded, attn: str, kv: str, layer_ops: bool, static: bool = False):
    args = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off", dtype="float32",
                      attention_backend=attn, kv_cache_dtype=kv, page_size=PS,
                      max_total_tokens=512, max_running_requests=4)
    cfg = dataclasses.replace(runner_config(args, 1024), cpu_layer_ops=layer_ops,
                              static_decode=static, static_decode_max_bs=4 if static else 0)
    return create_model_runner(loaded.config, loaded.params, cfg)


def _run(runner, prompts: list[list[int]]) -> tuple[np.ndarray, list[list[int]]]:
    """A cached prefix then a ragged EXTEND of three sequences whose pages fork it (prefix
    ending mid-page), then 4 DECODE steps: (EXTEND logits, greedy tokens per step)."""
    mk = lambda ids, prefix, pages: SeqStep(  # noqa: E731
        token_ids=ids, prefix_len=prefix, pages=pages, sampling=GREEDY, seed=0,
        num_output_tokens=0)
    shared = np.arange(1, 6)  # 5 pages: 18 cached tokens and room
    tables = [np.concatenate([shared, own]) for own in
              (np.arange(6, 12), np.arange(12, 18), np.arange(18, 26))]
    runner.forward(ForwardMode.EXTEND, [mk(prompts[0][:18], 0, tables[0])])
    res = runner.forward(ForwardMode.EXTEND, [mk(p[18:], 18, t)
                                              for p, t in zip(prompts, tables, strict=True)])
    logits = runner.row_logits(res.hidden, np.arange(res.hidden.shape[0]))
    tokens, lens = [list(res.token_ids)], [len(p) for p in prompts]
    for _ in range(4):
        res = runner.forward(ForwardMode.DECODE, [
            mk([int(t)], n, tb) for t, n, tb in zip(tokens[-1], lens, tables, strict=True)])
        tokens.append(list(res.token_ids))
        lens = [n + 1 for n in lens]
    return logits, tokens


def test_jax_backend_refuses_every_flag_dtype_by_name():
    for flag in KV_FLAG_DTYPES:
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {flag} needs the torch backend"):
            ServerArgs(backend="jax", kv_cache_dtype=flag)


def test_int8_round_trip_is_within_half_a_scale():
    """Per (token, head) vector: scale = max |x| / 127 rounded up to bfloat16, stored beside
    the 64 int8 values; every value comes back within scale / 2 (0.4% of the vector's
    largest), a zero vector exactly; the head row is 66 bytes where bfloat16's is 128."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, 64, generator=g) * torch.rand(500, 3, 1, generator=g) * 20
    x[7, 1] = 0
    packed = quantize_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (500, 3, 66)
    assert packed[..., :64].abs().max() <= 127
    scale = packed[..., 64:].contiguous().view(torch.bfloat16).float()
    amax = x.abs().amax(-1, keepdim=True)
    assert (scale >= amax / 127).all() and (scale <= amax / 127 * (1 + 2**-7)).all()
    err = (dequantize_int8(packed, torch.float32) - x).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert err.max() > 0 and torch.equal(dequantize_int8(packed[7, 1], torch.float32),
                                          torch.zeros(64))
    assert kv_dtype("int8").head_row_bytes(64) == 66 and kv_dtype("bfloat16").head_row_bytes(
        64) == 128


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_int8_pool_is_close_to_the_float_reference(q_dtype):
    """The K/V write quantizes; extend and decode attention (torch-sdpa and torch-invariant)
    over the int8 pool, with float32 or bfloat16 queries, against float32 queries over the same
    K/V in a float32 pool: within 3% of the output's largest value (measured 1.6-1.8%;
    bfloat16 queries 1.9-2.0%)."""
    g = torch.Generator().manual_seed(3)
    kvh, group, d, n = 3, 3, 64, 40
    k, v = (torch.randn(n, kvh, d, generator=g) * 3 for _ in range(2))
    q = torch.randn(n, kvh * group, d, generator=g)
    slots = torch.arange(4, 4 + n)
    out = {}
    for pool_dtype in (torch.float32, torch.int8):
        q = q.to(q_dtype if pool_dtype == torch.int8 else torch.float32)
        row = d + 2 if pool_dtype == torch.int8 else d
        k_pool, v_pool = (torch.zeros(64, kvh, row, dtype=pool_dtype) for _ in range(2))
        pa.write_kv(k_pool, v_pool, k, v, slots)
        seqs = [pa.ExtendSeq(start=0, num_new=n, prefix_len=0, slots=slots)]
        bias = torch.zeros(2, 1, n, dtype=q.dtype)
        bias[1, 0, n - 5:] = float("-inf")  # the second row's context is 5 keys shorter
        batch = pa.DecodeBatch(shared_slots=torch.zeros(0, dtype=torch.int64),
                               slots=slots[None].expand(2, n).contiguous(), bias=bias)
        out[pool_dtype] = [
            pa.extend_attention(q, k_pool, v_pool, seqs, 0.125),
            pa.invariant_extend_attention(q, k_pool, v_pool, seqs, 0.125),
            pa.decode_attention(q[:2], k_pool, v_pool, batch, 0.125),
            pa.invariant_decode_attention(q[:2], k_pool, v_pool, batch, 0.125)]
    for ref, got in zip(out[torch.float32], out[torch.int8], strict=True):
        assert got.dtype == q_dtype
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert err < 0.03


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e5m2", "int8"])
def test_narrower_pool_of_a_float32_model(tmp_path, kv):
    """Every torch attention backend (and the fused layer ops' K/V write as well as
    write_kv, and the static decode step) over a bfloat16 or fp8 e5m2 pool: EXTEND logits
    within REL_TOL of the float32 pool's, and the backends with float32 products agree with
    each other to float32 rounding (they read the same rounded K/V), as do their greedy decode
    tokens; the pool costs a half (a quarter) of float32's bytes per token. (The bfloat16
    products of torch-cpu-fused-bf16, on AVX512-BF16 CPUs, round queries and probabilities
    too: only the first bound holds for them. Over an int8 pool the compiled kernel's runs
    take int8 queries: they agree with each other as the float32 ones do.)"""
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (30, 19, 26)]
    ref = _runner(loaded, "torch-sdpa", "auto", layer_ops=False)
    assert ref.kv_pools[0][0].dtype == torch.float32
    ref_logits, ref_tokens = _run(ref, prompts)
    scale = np.abs(ref_logits).max()
    runs = [("torch-sdpa", False, False), ("torch-invariant", False, False),
            ("torch-sdpa", False, True)]
    if FUSED:
        runs += [("torch-cpu-fused", False, False), ("torch-cpu-fused-bf16", False, False)]
    if FUSED and LAYER_OPS:
        runs.append(("torch-cpu-fused", True, False))
    first = {}  # products -> the first such run's (logits, tokens)
    for attn, layer_ops, static in runs:
        runner = _runner(loaded, attn, kv, layer_ops, static)
        assert (runner.static_decode is not None) == static
        narrow = kv_dtype(KV_FLAG_DTYPES[kv])
        assert runner.kv_pools[0][0].dtype == POOL_DTYPES[kv]
        # (the compiled layer ops write no int8 pool: write_kv does)
        assert runner.layer_ops == (layer_ops and narrow.fused_write)
        # the same memory holds 2x (4x; int8: 4x less its scales) the tokens
        c = loaded.config
        assert (runner.kv_bytes * kv_dtype("float32").head_row_bytes(c.head_dim)
                == ref.kv_bytes * narrow.head_row_bytes(c.head_dim))
        logits, tokens = _run(runner, prompts)
        assert np.abs(logits - ref_logits).max() < REL_TOL[kv] * scale, (attn, layer_ops)
        assert tokens[0] == ref_tokens[0]
        products = runner.compute_info()["attention_products"]
        if products == "bfloat16":
            continue
        if products not in first:
            first[products] = logits, tokens
        np.testing.assert_allclose(logits, first[products][0], atol=1e-4 * scale, err_msg=attn)
        assert tokens == first[products][1], (attn, layer_ops, static)


@pytest.mark.slow
def test_default_model_greedy_tokens_with_a_bfloat16_pool():
    """SmolLM2 in float32 on the GGUF's blocks (the exact kernels: int8 activations, `auto` where
    the tiles are built, would round more than the pool does), fused kernels with float32 products
    (`auto` takes bfloat16 products over a bfloat16 pool on AVX512-BF16 CPUs, which round
    queries and probabilities too): greedy tokens of two sequences decoded in one batch,
    float32 pool vs bfloat16 pool, identical."""
    loaded = load_model(None)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (37, 21)]
    outs = []
    for kv in ("auto", "bfloat16"):
        args = ServerArgs(skip_warmup=True, backend="torch", dtype="float32", kv_cache_dtype=kv,
                          quantization="gguf", page_size=16, max_total_tokens=2048,
                          max_running_requests=4,
                          attention_backend="torch-cpu-fused" if FUSED else "auto")
        runner = create_model_runner(loaded.config, loaded.params, runner_config(args, 2048))
        pages = [np.arange(1 + 8 * i, 9 + 8 * i) for i in range(2)]
        mk = lambda ids, prefix, pg: SeqStep(  # noqa: E731
            token_ids=ids, prefix_len=prefix, pages=pg, sampling=GREEDY, seed=0,
            num_output_tokens=0)
        res = runner.forward(ForwardMode.EXTEND, [mk(p, 0, pg) for p, pg in
                                                  zip(prompts, pages, strict=True)])
        toks = [[int(t)] for t in res.token_ids]
        for i in range(NUM_GREEDY - 1):
            res = runner.forward(ForwardMode.DECODE, [
                mk([t[-1]], len(p) + i, pg) for t, p, pg in zip(toks, prompts, pages,
                                                                 strict=True)])
            for t, new in zip(toks, res.token_ids, strict=True):
                t.append(int(new))
        outs.append(toks)
    assert outs[0] == outs[1]


# SmolLM2-135M's K/V values per token: 30 layers x (K, V) x 3 KV heads x head_dim 64
DEFAULT_MODEL_KV_VALUES_PER_TOKEN = 30 * 2 * 3 * 64


@pytest.mark.slow
@pytest.mark.isa_invariance
def assert_flushed_clean(server) -> None:
    """Once idle and flushed, every pool page is free again (none leaked)."""
    server.wait_idle()
    assert requests.post(server.base_url + "/flush_cache", timeout=30).status_code == 200
    mem = server.wait_idle()["memory"]
    assert mem["num_pages_free"] == mem["num_pages_total"]


def test_server_with_an_fp8_pool_answers_from_its_cache():
    """The default model served with `--kv-cache-dtype fp8_e5m2` (tokenizer, scheduler and
    detokenizer processes): `/server_info` reports the pool at one byte per value; a prompt
    sent again is answered from the radix cache (its cached tokens reported) with the same
    greedy tokens (deterministic inference: the only mode that promises a cache hit the miss's
    tokens in bfloat16, which `--dtype auto` is on CPUs with AMX); every page is free again
    after a flush."""
    server = launch_server("--skip-warmup", "--kv-cache-dtype", "fp8_e5m2",
                           "--max-total-tokens", "4096", "--enable-deterministic-inference")
    try:
        mem = server.info()["memory"]
        assert mem["kv_cache_dtype"] == "float8_e5m2"
        slots = (mem["num_pages_total"] + 1) * mem["page_size"]  # + the reserved page 0
        assert mem["kv_bytes"] == slots * DEFAULT_MODEL_KV_VALUES_PER_TOKEN
        body = {"text": "An agent's system prompt lists its tools: search, calculator, "
                        "calendar and mail. It answers in JSON. " * 4,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 12}}
        first = requests.post(server.base_url + "/generate", json=body, timeout=120).json()
        again = requests.post(server.base_url + "/generate", json=body, timeout=120).json()
        assert first["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] >= mem["page_size"] * 4
        assert again["output_ids"] == first["output_ids"] and len(first["output_ids"]) == 12
        assert_flushed_clean(server)
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.isa_invariance
def test_server_with_an_int8_pool_answers_coherently_from_cache_and_in_any_batch():
    """The default model served with `--kv-cache-dtype int8` (deterministic inference, whose
    attention reads the int8 rows dequantized): `/server_info` reports 66-byte head rows (64
    int8 values and a bfloat16 scale); a factual prompt is answered; a prompt sent again is
    answered from the radix cache with the same greedy tokens, and so is it decoded beside
    three other requests; every page is free again after a flush."""
    server = launch_server("--skip-warmup", "--kv-cache-dtype", "int8",
                           "--max-total-tokens", "4096", "--enable-deterministic-inference")
    url = server.base_url + "/generate"
    try:
        mem = server.info()["memory"]
        assert mem["kv_cache_dtype"] == "int8"
        slots = (mem["num_pages_total"] + 1) * mem["page_size"]  # + the reserved page 0
        assert mem["kv_bytes"] == slots * DEFAULT_MODEL_KV_VALUES_PER_TOKEN * 66 // 64
        answer = requests.post(server.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 16}, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
        body = {"text": "An agent's system prompt lists its tools: search, calculator, "
                        "calendar and mail. It answers in JSON. " * 4,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 12}}
        first = requests.post(url, json=body, timeout=120).json()
        again = requests.post(url, json=body, timeout=120).json()
        assert first["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] >= mem["page_size"] * 4
        assert again["output_ids"] == first["output_ids"] and len(first["output_ids"]) == 12
        others = [{"text": f"Write a short note about {topic}.",
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": 12}}
                  for topic in ("rivers", "tea", "trains")]
        batch = requests.post(url, json={
            "text": [body["text"]] + [o["text"] for o in others],
            "sampling_params": body["sampling_params"]}, timeout=120).json()
        assert batch[0]["output_ids"] == first["output_ids"]
        assert_flushed_clean(server)
    finally:
        server.stop()
