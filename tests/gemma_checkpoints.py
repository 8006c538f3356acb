"""Tiny random Gemma 2 / Gemma 3 checkpoints (transformers models saved as HF directories).

Both exercise what differs from Llama: local layers with a sliding window shorter than the test
prompts (so windows cross page boundaries and cached prefixes), global layers beside them, the
four (1 + w) norms with non-trivial weights, and:

    gemma3  head_dim 256 (the real model's), 2 heads over 1 KV head, q/k norms, local RoPE base
            10k vs global 1M, query_pre_attn_scalar 64 (!= head_dim, so a wrong scale shows)
    gemma2  attention and final logit soft-caps small enough to bend random scores
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints import _write_tokenizer_files, make_tiny_tokenizer

WINDOW = 6  # tokens a local layer's query sees (itself included)

_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def _build(arch: str, vocab_size: int, seed: int) -> Any:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        query_pre_attn_scalar=64, rms_norm_eps=1e-6)
    if arch == "gemma3":
        config = Gemma3TextConfig(**common, num_hidden_layers=3, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=256, layer_types=_LAYERS)
        model_cls = Gemma3ForCausalLM
    elif arch == "gemma2":
        config = Gemma2Config(**common, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, layer_types=_LAYERS,
                              attn_logit_softcapping=0.5, final_logit_softcapping=3.0)
        model_cls = Gemma2ForCausalLM
    else:
        raise ValueError(f"unknown gemma test arch {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms, so a missing (1 + w) or a swapped norm shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def make_tiny_gemma(dir: str | Path, arch: str, *, seed: int = 0) -> str:
    """Save a tiny random `arch` ("gemma2" or "gemma3") model with the tests' tokenizer."""
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    model = _build(arch, tok.get_vocab_size(), seed)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer_files(out, tok)
    return str(out)
