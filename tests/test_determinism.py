"""`--enable-deterministic-inference`: a request's tokens (greedy, and sampled with a seed) do
not depend on its batch mates, on its prompt's chunking, or on radix-cache hits (bfloat16, both
executors, tiny random model, the real scheduler); the torch runner runs its GEMMs on the
fixed-order kernel (not oneDNN, whose AMX kernels reduce per row count) and says so; the pieces
hold (XLA:CPU dots, one attention kernel for EXTEND and DECODE); without the flag the default
kernels and buckets are chosen as before, and bfloat16 keeps what it promises (closeness).
Tests marked `isa_invariance` run again under lowered ISAs (tests/test_isa.py)."""

from __future__ import annotations

import dataclasses

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu import Engine
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor import batch_invariant
from sgl_tpu.executor.attention_registry import resolve_attention_backend
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.scheduler.scheduler import Scheduler

MAX_NEW = 8
CHUNK_SIZES = (8, 16, 32, 64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


@pytest.fixture(scope="module", params=["torch", "jax"])
def engine(request, model_dir):
    eng = Engine(model_dir, backend=request.param, dtype="bfloat16",
                 enable_deterministic_inference=True, page_size=4, max_total_tokens=4096,
                 max_running_requests=4, max_extend_seqs=4, chunked_prefill_size=64,
                 min_token_bucket=64, kv_tile=16, block_q=16, grammar_backend="none",
                 skip_warmup=True)  # JAX compiles the three buckets used on first use
    yield eng
    eng.shutdown()


def _fresh_scheduler(engine: Engine, chunk: int) -> None:
    """A new scheduler (empty radix cache) over the same runner, prefilling `chunk` tokens per
    step; the runner's pool pages are simply reallocated."""
    old = engine.scheduler
    cfg = dataclasses.replace(old.config, chunked_prefill_size=chunk)
    engine.scheduler = Scheduler(cfg, old.runner, num_pages=old.runner.config.num_pages,
                                 decode=engine.tokenizer.decode, eos_token_ids=(),
                                 vocab_size=engine.model_config.vocab_size, grammar=None)


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def _tokens(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[list]:
    """Each request's output ids with their log-probs: equal log-probs mean equal logits, a far
    finer check than equal tokens on a tiny model (whose argmax rarely flips)."""
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [[(t, lp[0]) for t, lp in zip(o["output_ids"], o["meta_info"]["output_token_logprobs"],
                                         strict=True)] for o in outs]


TARGETS = {
    "greedy": {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_new_tokens": MAX_NEW,
               "ignore_eos": True},
}


@pytest.mark.isa_invariance
@pytest.mark.parametrize("kind", list(TARGETS))
def test_same_tokens_whatever_the_batch_chunking_and_cache(engine, kind):
    """Random trials: chunk size, a cached prefix of the target (none, part, all) and 0-3
    batch mates of random lengths and sampling settings; the target's tokens and their
    log-probs never change."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    target = _ids(rng, 70, vocab)  # longer than most chunks: chunked prefill
    sp = TARGETS[kind]
    _fresh_scheduler(engine, 64)
    expected = _tokens(engine, [target], [sp])[0]
    assert len(expected) == MAX_NEW
    for trial in range(5):
        _fresh_scheduler(engine, int(rng.choice(CHUNK_SIZES)))
        cached = int(rng.choice([0, 12, 37, len(target)]))
        if cached:  # leave target[:cached] in the radix cache
            _tokens(engine, [target[:cached]], [{"max_new_tokens": 1}])
        mates = [(_ids(rng, int(rng.integers(1, 90)), vocab),
                  {"temperature": float(rng.choice([0.0, 0.7])), "seed": int(trial),
                   "max_new_tokens": int(rng.integers(1, 2 * MAX_NEW))})
                 for _ in range(int(rng.integers(0, 4)))]
        if mates and rng.random() < 0.5:  # a mate sharing the target's first tokens
            mates[0] = (target[: int(rng.integers(5, 60))] + mates[0][0], mates[0][1])
        batch = [*mates, (target, sp)]
        order = rng.permutation(len(batch))
        got = _tokens(engine, [batch[i][0] for i in order], [batch[i][1] for i in order])
        where = int(np.flatnonzero(order == len(batch) - 1)[0])
        assert got[where] == expected, (
            f"trial {trial}: chunk {engine.scheduler.config.chunked_prefill_size}, "
            f"cached {cached}, {len(mates)} mates")
        engine.scheduler.check_integrity()


@pytest.mark.isa_invariance
def test_decode_matches_extend_of_the_whole_sequence(engine):
    """Greedy tokens of a prompt, then the prompt + those tokens prefilled in one EXTEND: the
    continuation is the same (each generated token's K/V was computed by DECODE the first time
    and by EXTEND the second)."""
    vocab = engine.model_config.vocab_size
    prompt = _ids(np.random.default_rng(2), 21, vocab)
    sp = TARGETS["greedy"]
    _fresh_scheduler(engine, 64)
    first = _tokens(engine, [prompt], [sp])[0]
    _fresh_scheduler(engine, 64)
    again = _tokens(engine, [prompt + [t for t, _ in first[:4]]],
                    [{**sp, "max_new_tokens": MAX_NEW - 4}])[0]
    assert again == first[4:]


# ---- the pieces, on this machine ------------------------------------------------------------
ROW_COUNTS = (2, 3, 5, 8, 17, 33, 64, 100, 257)


def test_torch_runner_under_the_flag_runs_the_fixed_order_gemm(engine):
    """On a CPU every projection and the head are the fixed-order GEMM's packed weights (not
    oneDNN's, whose bf16 kernels on AMX reduce per row count), and the server says so."""
    runner = engine.scheduler.runner
    if runner.backend != "torch":
        pytest.skip("XLA's dots: test_jax_matmul_rows_do_not_depend_on_row_count")
    from sgl_tpu.backends.torch.kernels.invariant_gemm_cpu import PackedWeight

    w = runner.model.w
    projections = [getattr(lw, name) for lw in w.layers
                   for name in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert all(isinstance(p, PackedWeight) for p in projections)
    assert isinstance(w.lm_head, PackedWeight) and w.lm_head.float_output
    info = runner.compute_info()
    assert info["gemm"] == "fixed-order" and info["amx_in_use"] is False


# oneDNN's implementations by ISA, lowest first (the suffix of a verbose line's "brg_matmul:...")
ONEDNN_ISAS = ("avx2", "avx512_core", "avx512_core_bf16", "avx512_core_amx")


def _isa_rank(name: str) -> int:
    """"AVX512_CORE_BF16" or an implementation "brg_matmul:avx512_core_bf16" -> its place."""
    isa = name.rsplit(":", 1)[-1].lower()
    ranks = [i for i, known in enumerate(ONEDNN_ISAS) if isa.startswith(known)]
    return max(ranks) if ranks else -1


@pytest.mark.isa_invariance
def test_the_process_runs_the_isa_it_is_set_to():
    """What `/server_info` reports (backends/torch/device.cpu_info) follows the knobs the ISA
    cases of tests/test_isa.py set: oneDNN's linears at most ONEDNN_MAX_CPU_ISA, and every
    compiled kernel the AVX2 build under SGL_TPU_CPU_KERNELS=avx2 (the quantized GEMM's
    AVX-VNNI one under avx2-vnni)."""
    pytest.importorskip("torch")
    import os

    from sgl_tpu.backends.torch.device import cpu_info
    from sgl_tpu.backends.torch.kernels import cpu_extension

    info = cpu_info()
    onednn = info["onednn"]
    assert onednn["isa"] != "unknown" and onednn["f32_linear"]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if cap:
        for impl in (onednn["f32_linear"], onednn["bf16_linear"]):
            assert impl is None or _isa_rank(impl) <= _isa_rank(cap), (impl, cap)
        assert not onednn["amx"] or cap == "AVX512_CORE_AMX"
    requested = os.environ.get(cpu_extension.KERNELS_ENV)
    if requested == "avx2-vnni" and cpu_extension.has_avx2_vnni_build():
        # the quantized GEMM's AVX-VNNI build (vpdpbusd ymm), the other sources' AVX2 ones
        for ext in cpu_extension.EXTENSIONS:
            kernel = info["compiled_kernels"][ext.prefix]
            assert kernel.get("flavour") == ("avx2-vnni" if ext.avx_vnni else "avx2"), ext
        qgemm = info["compiled_kernels"]["sgl_tpu_qgemm_cpu"]
        assert qgemm["tile_dot"].startswith("vpdpbusd-ymm")
    if requested == "avx2" and cpu_extension.has_avx2_build():
        for name, kernel in info["compiled_kernels"].items():
            assert kernel.get("flavour") == "avx2", name
        assert info["compiled_kernels"]["sgl_tpu_inv_gemm_cpu"]["simd"] == "avx2-fma"
        assert info["compiled_kernels"]["sgl_tpu_qgemm_cpu"]["tile_dot"] == "vpmaddubsw-ymm"


def test_jax_matmul_rows_do_not_depend_on_row_count():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    dot = jax.jit(lambda x, w: x @ w)
    for k, n in ((576, 960),):
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((max(ROW_COUNTS), k)), jnp.bfloat16)
        ref = np.asarray(dot(x[:2], w).astype(jnp.float32))
        for m in (3, 17, 64, 257):
            assert np.array_equal(np.asarray(dot(x[:m], w).astype(jnp.float32))[:2], ref)


@pytest.mark.isa_invariance
def test_torch_invariant_attention_same_row_every_way():
    """One sequence's last row: prefilled whole, as the tail of a chunk after a cached prefix,
    and as a DECODE in a batch with other sequences (multi-tile contexts): bit-identical."""
    torch = pytest.importorskip("torch")
    from sgl_tpu.backends.torch import paged_attention as pa

    torch.manual_seed(0)
    kvh, group, d, tile = 2, 3, 16, 32
    pool_k = torch.randn(512, kvh, d).to(torch.bfloat16)
    pool_v = torch.randn(512, kvh, d).to(torch.bfloat16)
    length = 75
    slots = torch.randperm(511)[:length] + 1  # the sequence's slots, any order in the pool
    q = torch.randn(length, kvh * group, d).to(torch.bfloat16)
    whole = pa.invariant_extend_attention(q, pool_k, pool_v, [pa.ExtendSeq(0, length, 0, slots)],
                                           0.25, kv_tile=tile)
    for prefix in (1, 40, 74):
        part = pa.invariant_extend_attention(
            q[prefix:], pool_k, pool_v, [pa.ExtendSeq(0, length - prefix, prefix, slots)], 0.25,
            kv_tile=tile)
        assert torch.equal(part[-1], whole[-1]), prefix
    other = torch.randperm(511)[:30] + 1
    own = torch.zeros(2, length, dtype=torch.int64)
    own[0], own[1, :30] = slots, other
    bias = torch.full((2, 1, length), float("-inf")).to(torch.bfloat16)
    bias[0, 0, :], bias[1, 0, :30] = 0, 0
    batch = pa.DecodeBatch(shared_slots=torch.zeros(0, dtype=torch.int64), slots=own, bias=bias)
    qd = torch.stack([q[-1], torch.randn(kvh * group, d).to(torch.bfloat16)])
    dec = pa.invariant_decode_attention(qd, pool_k, pool_v, batch, 0.25, kv_tile=tile)
    assert torch.equal(dec[0], whole[-1])


# ---- without the flag ---------------------------------------------------------------------
def test_without_the_flag_the_default_paths_are_chosen():
    torch_auto = resolve_attention_backend("auto", "torch", "cpu")  # fused kernel if built
    for backend, attention in (("torch", torch_auto), ("jax", "ref")):
        args = ServerArgs(backend=backend, dtype="bfloat16", max_running_requests=8)
        cfg = runner_config(args, 4096)
        assert cfg.attention_backend == attention and not cfg.deterministic
        assert cfg.seq_buckets == (1, 2, 4, 8)
        on = runner_config(args.replace(enable_deterministic_inference=True), 4096)
        assert on.attention_backend == batch_invariant.INVARIANT_ATTENTION[backend]
        assert on.seq_buckets == (2, 4, 8) and on.deterministic and not on.compile
        assert on.quantization == "none"
        # everything else resolves as without the flag
        assert dataclasses.replace(on, attention_backend=attention, seq_buckets=(1, 2, 4, 8),
                                   deterministic=False, quantization=cfg.quantization,
                                   compile=cfg.compile) == cfg


# bfloat16 without the flag promises closeness, not equality: log-probs within BF16_LOGPROB_TOL
# of each other, and equal tokens while the top-2 margin is clear of BF16_MARGIN (a GEMM of
# another kernel or row count moves a logit by a few hundredths here; a wrong K/V by far more)
BF16_LOGPROB_TOL = 0.25
BF16_MARGIN = 1.0


@pytest.mark.slow
@pytest.mark.isa_invariance
def test_without_the_flag_bfloat16_keeps_what_it_promises_across_a_cache_hit():
    """Default mode in bfloat16 (what `--dtype auto` serves on CPUs with AMX), the default
    model: a prompt sent again is a radix-cache hit (only its tail is prefilled, by other
    kernels and row counts than the first time); its greedy tokens follow the first answer's
    within the tolerance above, parting only where the first answer's top two were close."""
    from sgl_tpu.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    eng = Engine(backend="torch", dtype="bfloat16", skip_warmup=True, max_total_tokens=4096)
    try:
        prompt = ("<|im_start|>user\nList three uses of a paperclip and explain each one in a "
                  "sentence.<|im_end|>\n<|im_start|>assistant\n")
        sp = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
        runs = [eng.generate(prompt, sp, return_logprob=True, top_logprobs_num=2)
                for _ in range(2)]
        assert runs[1]["meta_info"]["cached_tokens"] > 0
        (first, again) = ([(t, lp[0], top[0][0] - top[1][0]) for t, lp, top in zip(
            r["output_ids"], r["meta_info"]["output_token_logprobs"],
            r["meta_info"]["output_top_logprobs"], strict=True)] for r in runs)
        for i, ((tok, lp, margin), (tok2, lp2, _)) in enumerate(zip(first, again, strict=True)):
            if tok != tok2:
                assert margin < BF16_MARGIN, (i, margin)
                break
            assert abs(lp - lp2) < BF16_LOGPROB_TOL, (i, lp, lp2)
    finally:
        eng.shutdown()


def test_flag_refuses_settings_it_cannot_honour():
    with pytest.raises(ValueError, match="torch-compile"):
        ServerArgs(enable_deterministic_inference=True, torch_compile="on")
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(enable_deterministic_inference=True, quantization="int8")
    with pytest.raises(ValueError, match="attention-backend"):
        runner_config(ServerArgs(backend="torch", enable_deterministic_inference=True,
                                 attention_backend="torch-sdpa"), 4096)
    with pytest.raises(ValueError, match="tensor-parallel"):
        ServerArgs(enable_deterministic_inference=True, tp_size=3)


@pytest.mark.parametrize("overrides, what", [
    ({"sliding_window": 8}, "sliding-window"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "experts"),
])
def test_flag_refuses_layers_it_does_not_cover(overrides, what):
    import dataclasses

    from sgl_tpu.executor.registry import check_deterministic_model
    from sgl_tpu.models.config import ModelConfig

    base = ModelConfig(arch="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                       rms_norm_eps=1e-6, context_len=256, tie_word_embeddings=False)
    check_deterministic_model(base)  # dense full attention: covered
    with pytest.raises(ValueError, match=what):
        check_deterministic_model(dataclasses.replace(base, **overrides))


# ---- the reported case, real model through the HTTP server -----------------------------------
CHAT = [{"role": "user", "content": "Name three colours of the rainbow and say one thing "
                                    "about each."}]


def _chat(base_url: str, stream: bool, messages=CHAT, max_tokens: int = 40) -> str:
    import json
    import urllib.request

    body = json.dumps({"model": "default", "messages": messages, "temperature": 0,
                       "max_tokens": max_tokens, "stream": stream}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            return json.loads(resp.read())["choices"][0]["message"]["content"]
        text = []
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                text.append(delta.get("content") or "")
        return "".join(text)


@pytest.mark.slow
@pytest.mark.isa_invariance
def test_chat_streamed_then_not_gives_one_answer_on_the_default_model():
    """The reproduction from the issue: a temperature-0 chat sent streamed, then not (the second
    hits the radix cache), then again beside a concurrent batch mate: one continuation."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import launch_server

    server = launch_server("--skip-warmup", "--enable-deterministic-inference",
                           "--max-total-tokens", "4096", "--max-running-requests", "4")
    try:
        compute = server.info()["compute"]  # what the scheduler computes with
        if compute["backend"] == "torch":
            assert compute["gemm"] == "fixed-order" and compute["amx_in_use"] is False
            assert compute["cpu"]["onednn"]["isa"] != "unknown"
            assert compute["cpu"]["compiled_kernels"]["sgl_tpu_inv_gemm_cpu"]["simd"]
        streamed = _chat(server.base_url, True)
        assert streamed
        assert _chat(server.base_url, False) == streamed
        other = [{"role": "user", "content": "Write a haiku about the sea."}]
        with ThreadPoolExecutor(2) as pool:
            mate = pool.submit(_chat, server.base_url, False, other, 60)
            again = pool.submit(_chat, server.base_url, False)
            assert again.result() == streamed
            mate.result()
    finally:
        server.stop()
