"""Mixture of experts (Qwen3-MoE, Mixtral) and the other families added beside it (Mistral,
Phi-3), beyond the shared parity tests (test_model.py: JAX prefill + paged decode logits;
test_runner_parity.py: both runners, cached prefix, ragged batch):

* the two JAX grouped-expert implementations against a naive numpy oracle that runs every
  expert on every token;
* GGUF MoE files (ffn_*_exps, ffn_gate_inp, expert_count/expert_used_count) load to exactly
  the weights of their HF twin, and the torch runner's logits match transformers on them;
* torch decode steps over the paged cache: the top log-probs match transformers' log-softmax.

Tolerance: float32 max abs diff < 2e-3 on logits / log-probs of order 1 (as the other parity
tests); the expert oracle 1e-4.
"""

from __future__ import annotations

import checkpoints as ck
import jax
import numpy as np
import pytest
from model_helpers import hf_logits

from sgl_tpu.backends.jax.models import moe
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.sampling_params import SamplingParams

ATOL = 2e-3
GREEDY = SamplingParams(temperature=0.0)


def _moe_config(norm: bool) -> ModelConfig:
    return ModelConfig(arch="qwen3_moe", vocab_size=16, hidden_size=16, intermediate_size=8,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=1e4,
                       rms_norm_eps=1e-6, context_len=64, tie_word_embeddings=True,
                       num_experts=8, num_experts_per_tok=3, moe_intermediate_size=12,
                       norm_topk_prob=norm)


def _oracle(x, layer, cfg) -> np.ndarray:
    """Every expert on every token, weighted by the routing (dense, float64)."""
    x = x.astype(np.float64)
    logits = x @ layer["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, : cfg.num_experts_per_tok]
    weights = np.take_along_axis(probs, top, -1)
    if cfg.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(cfg.num_experts):
        g, u = x @ layer["w_gate_exps"][e], x @ layer["w_up_exps"][e]
        y = (g / (1 + np.exp(-g)) * u) @ layer["w_down_exps"][e]
        w = np.where(top == e, weights, 0).sum(-1)  # [T]
        out += w[:, None] * y
    return out


# decode-sized (one partial tile), and 600 rows in tiles of 32 with padding
@pytest.mark.parametrize("num_tokens,norm", [(3, False), (200, True)])
def test_grouped_experts_match_dense_oracle(num_tokens, norm):
    cfg = _moe_config(norm)
    rng = np.random.default_rng(num_tokens)
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer = {"router": rng.normal(size=(d, e)), "w_gate_exps": rng.normal(size=(e, d, f)) / 4,
             "w_up_exps": rng.normal(size=(e, d, f)) / 4,
             "w_down_exps": rng.normal(size=(e, f, d)) / 4}
    layer = {k: v.astype(np.float32) for k, v in layer.items()}
    x = rng.normal(size=(num_tokens, d)).astype(np.float32)
    ref = _oracle(x, layer, cfg)
    for impl in moe.GROUPED_IMPLS:
        got = jax.jit(lambda x, lw, impl=impl: moe.moe_mlp(x, lw, cfg, impl))(x, layer)
        np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, err_msg=impl)


def _runner(loaded, backend: str = "torch"):
    args = ServerArgs(backend=backend, dtype="float32", torch_compile="off", skip_warmup=True,
                      page_size=4, max_total_tokens=1024, kv_tile=16, block_q=8,
                      min_token_bucket=16, chunked_prefill_size=64, max_running_requests=4,
                      max_top_logprobs=5)
    return create_model_runner(loaded.config, loaded.params,
                               runner_config(args, loaded.config.context_len))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_moe_matches_hf_twin(tmp_path, arch, monkeypatch):
    monkeypatch.setenv("SGL_TPU_CACHE_DIR", str(tmp_path / "cache"))
    path = ck.make_tiny_gguf(tmp_path / "m.gguf", arch)
    from_gguf, from_hf = load_model(path), load_model(ck.hf_twin_dir(path))
    assert from_gguf.config.arch == from_hf.config.arch == arch
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "shared_expert_intermediate_size"):
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    for i, (lg, lh) in enumerate(zip(from_gguf.params["layers"], from_hf.params["layers"],
                                     strict=True)):
        assert set(lg) == set(lh)
        for name in lg:  # float32 in the file: exact, Q/K un-permuted (Mixtral is llama arch)
            np.testing.assert_array_equal(lg[name], lh[name], err_msg=f"layer {i} {name}")
    assert load_model(path).config == from_gguf.config  # the dequantization cache round-trips

    ids = np.random.default_rng(2).integers(3, from_gguf.config.vocab_size, 13).tolist()
    runner = _runner(from_gguf)
    steps = [SeqStep(token_ids=ids, prefix_len=0, pages=np.arange(1, 5), sampling=GREEDY,
                     seed=0, num_output_tokens=0)]
    result = runner.forward(ForwardMode.EXTEND, steps)
    logits = runner.row_logits(result.hidden, np.arange(len(ids), dtype=np.int32))
    np.testing.assert_allclose(logits, hf_logits(ck.hf_twin_dir(path), ids), atol=ATOL)


@pytest.mark.parametrize("arch,kw", ck.NEW_ARCH_CASES)
def test_torch_paged_decode_logprobs_match_transformers(tmp_path, arch, kw):
    """Prefill 15 tokens, then 6 greedy decode steps of two sequences batched together (one
    with a 3-token head start), each step's top log-probs against transformers on the whole
    sequence so far."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", arch, **kw)
    loaded = load_model(model_dir)
    runner = _runner(loaded)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (15, 18)]
    pages = [np.arange(1, 7), np.arange(7, 13)]
    result = runner.forward(ForwardMode.EXTEND, [
        SeqStep(token_ids=s, prefix_len=0, pages=p, sampling=GREEDY, seed=0,
                num_output_tokens=0) for s, p in zip(seqs, pages, strict=True)])
    nxt = [int(t) for t in result.token_ids]
    for step in range(6):
        steps = [SeqStep(token_ids=[t], prefix_len=len(s), pages=p, sampling=GREEDY, seed=0,
                         num_output_tokens=step + 1)
                 for s, t, p in zip(seqs, nxt, pages, strict=True)]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        result = runner.forward(ForwardMode.DECODE, steps)
        for i, s in enumerate(seqs):
            ref = hf_logits(model_dir, s)[-1].astype(np.float64)
            ref_lp = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
            top = result.top_ids[i]
            np.testing.assert_allclose(result.top_logprobs[i], ref_lp[top], atol=ATOL)
            assert top[0] == int(np.argmax(ref)) or np.sort(ref)[-2] > ref.max() - 10 * ATOL
        nxt = [int(t) for t in result.token_ids]


def test_moe_layers_mixed_with_dense_refused(tmp_path):
    import json

    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "qwen3_moe")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["mlp_only_layers"] = [0]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="dense layers among MoE layers"):
        load_model(model_dir)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_bfloat16_experts_close(tmp_path, backend):
    """bfloat16 expert GEMMs against transformers in float32, with every expert active (k = E),
    so that no near-tied routing choice can flip under rounding: within 5% of the largest
    logit, as the dense families' bfloat16 checks."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "mixtral", num_experts_per_tok=8)
    loaded = load_model(model_dir)
    ids = np.random.default_rng(4).integers(3, loaded.config.vocab_size, 19).tolist()
    ref = hf_logits(model_dir, ids)
    args = ServerArgs(backend=backend, dtype="bfloat16", torch_compile="off", skip_warmup=True,
                      page_size=4, max_total_tokens=256, kv_tile=16, block_q=8,
                      min_token_bucket=16, chunked_prefill_size=64, max_running_requests=2)
    runner = create_model_runner(loaded.config, loaded.params,
                                 runner_config(args, loaded.config.context_len))
    steps = [SeqStep(token_ids=ids, prefix_len=0, pages=np.arange(1, 6), sampling=GREEDY,
                     seed=0, num_output_tokens=0)]
    result = runner.forward(ForwardMode.EXTEND, steps)
    logits = runner.row_logits(result.hidden, np.arange(len(ids), dtype=np.int32))
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()
