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

import numpy as np
from checkpoints import (
    _HF_TO_GGUF_LAYER,
    _write_tokenizer_files,
    add_gguf_model_shape,
    finish_gguf,
    gguf_tensor_name,
    make_tiny_tokenizer,
)

WINDOW = 6  # tokens a local layer's query sees (itself included)

_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def _random_model(model_cls: Any, config: Any, seed: int) -> Any:
    """A seeded `model_cls(config)` in eval mode with every parameter moved off its initial
    value, so a missing (1 + w) or a swapped norm shows."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _build(arch: str, vocab_size: int, seed: int) -> Any:
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
    return _random_model(model_cls, config, seed)


def make_tiny_gemma(dir: str | Path, arch: str, *, seed: int = 0) -> str:
    """Save a tiny random `arch` ("gemma2" or "gemma3") model with the tests' tokenizer."""
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    model = _build(arch, tok.get_vocab_size(), seed)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer_files(out, tok)
    return str(out)


# ---------------------------------------------------------------- a tiny Gemma 3 GGUF

_GGUF_LAYER = {  # HF per-layer suffix -> llama.cpp's Gemma 3 tensor suffix: Llama's, but the
    # four norms around attention and the MLP
    **_HF_TO_GGUF_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_SPM_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world",
              "return", "café", "naïve", "日本", "12", "345"]


def tiny_spm_vocab() -> tuple[list[str], list[int]]:
    """(pieces, llama.cpp token types) laid out like Gemma's GGUF vocabulary: control tokens,
    user-defined newline and space runs (the latter stored with real spaces), 256 byte pieces,
    then characters and word prefixes with and without the \u2581 word marker."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>",
              "<end_of_turn>", "\n", "\n\n", "  ", "   ", "    "]
    types = [3, 3, 3, 3, 3, 4, 3, 3, 4, 4, 4, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces: list[str] = ["\u2581"]
    for word in _SPM_WORDS:
        for w in (word, "\u2581" + word):
            pieces += [w[:k] for k in range(1, len(w) + 1)]
    pieces += list("abcdefghijklmnopqrstuvwxyz,.:;!?()0123456789")
    pieces = list(dict.fromkeys(p for p in pieces if p not in tokens))
    return tokens + pieces, types + [1] * len(pieces)


def make_tiny_gemma3_gguf(path: str | Path, *, seed: int = 0) -> str:
    """A 6-layer Gemma 3 (5 local layers, 1 global) GGUF written as llama.cpp's converter
    writes one: norms stored as 1 + w, Q/K rows unpermuted, a SentencePiece vocabulary with no
    merges. Float32 tensors, so a reader must reproduce the weights exactly."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokens, types = tiny_spm_vocab()
    config = Gemma3TextConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
        max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = _random_model(Gemma3ForCausalLM, config, seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_gguf_model_shape(w, config, config.head_dim)  # 256 != 64 / 2: key/value lengths too
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if t != 1 else -float(i) for i, t in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for name, t in model.state_dict().items():
        arr = t.detach().numpy().astype(np.float32)
        if name == "lm_head.weight":
            continue  # tied
        gguf_name = gguf_tensor_name(name, _GGUF_LAYER)
        if gguf_name.endswith("norm.weight"):
            arr = arr + np.float32(1)
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))
    finish_gguf(w)
    return str(path)
