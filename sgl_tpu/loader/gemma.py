"""What the loaders need to know about Gemma 2 and Gemma 3 (the registry's `loader_hooks`).

    HF config.json (model_type gemma2 / gemma3_text)  --config_from_hf-->  ModelConfig + gemma
    GGUF metadata (architecture gemma2 / gemma3)      --gemma_from_gguf--> GemmaConfig
    tensor names: the four norms of a Gemma layer     --HF_/GGUF_LAYER_TENSORS--> canonical
    GGUF norm weights                                 --from_gguf--> w (the file stores 1 + w)

HF's Gemma layer names its norms input_layernorm (before attention), post_attention_layernorm
(after attention: not the pre-MLP norm it is in Llama), pre_feedforward_layernorm (before the
MLP) and post_feedforward_layernorm. llama.cpp's converter adds 1 to every `*norm.weight` of
Gemma models so that its plain RMSNorm multiplies by (1 + w); we subtract it again, as
transformers' GGUF loader does, so both formats load to the same canonical params.

Layer kinds: Gemma 2 alternates local and global layers (even indices local), Gemma 3 has five
local layers per global one (every sixth layer global); an HF config may list them explicitly in
`layer_types`. GGUF files store neither the pattern nor Gemma 3's local RoPE base (10,000) nor
the attention scale, which llama.cpp fixes per architecture the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_tpu.models.config import GemmaConfig, ModelConfig

HF_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
# added to the loader's common GGUF names (attn_norm, ffn_norm -> mlp_norm, ...)
GGUF_LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
}

# arch -> (global layer every N layers, Gemma 3's local RoPE base or None = same as global)
_LAYER_PATTERN = {"gemma2": 2, "gemma3": 6}
_LOCAL_ROPE_THETA = {"gemma2": None, "gemma3": 10000.0}
_DEFAULT_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}


def default_sliding_layers(arch: str, num_layers: int) -> tuple[bool, ...]:
    every = _LAYER_PATTERN[arch]
    return tuple(bool((i + 1) % every) for i in range(num_layers))


def from_gguf(target: str, w: np.ndarray) -> np.ndarray:
    """A dequantized GGUF tensor -> its canonical value (norm weights lose llama.cpp's +1)."""
    return w - np.float32(1) if target.endswith("norm") else w


def gemma_from_gguf(arch: str, get: Any, num_layers: int, rope_theta: float,
                    head_dim: int) -> GemmaConfig:
    """GemmaConfig from GGUF metadata; `get(key, default)` reads one scalar."""
    local = _LOCAL_ROPE_THETA[arch]
    attn_cap, final_cap = (get(f"{arch}.attn_logit_softcapping", None),
                           get(f"{arch}.final_logit_softcapping", None))
    return GemmaConfig(
        sliding_window=int(get(f"{arch}.attention.sliding_window")),
        sliding_layers=default_sliding_layers(arch, num_layers),
        rope_local_theta=rope_theta if local is None else local,
        query_pre_attn_scalar=float(head_dim),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
    )


def _thetas(cfg: dict[str, Any], arch: str, source: str) -> tuple[float, float]:
    """(global, local) RoPE bases from `rope_parameters` (transformers 5: per layer kind for
    Gemma 3) or `rope_theta` / `rope_local_base_freq` (transformers 4)."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    local = params.get("sliding_attention", full)
    for p in (full, local, cfg.get("rope_scaling") or {}):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: unsupported rope type {rope_type!r} for {arch}")
    theta = float(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    default_local = theta if _LOCAL_ROPE_THETA[arch] is None else _LOCAL_ROPE_THETA[arch]
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", default_local)))
    if _LOCAL_ROPE_THETA[arch] is None:
        local_theta = theta
    return theta, local_theta


def config_from_hf(arch: str, cfg: dict[str, Any], eos_ids: list[int], tied: bool,
                   source: str) -> ModelConfig:
    """ModelConfig (with its GemmaConfig) from a Gemma 2 / Gemma 3 config.json."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{source}: unsupported hidden_activation {act!r}; "
                         "supported: gelu_pytorch_tanh")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{source}: attention bias is not supported for {arch}")
    if cfg.get("use_bidirectional_attention", False):
        raise ValueError(f"{source}: bidirectional attention is not supported")
    num_layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None:
        sliding = default_sliding_layers(arch, num_layers)
    else:
        unknown = set(kinds) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"{source}: unsupported layer_types {sorted(unknown)}")
        sliding = tuple(k == "sliding_attention" for k in kinds)
    theta, local_theta = _thetas(cfg, arch, source)
    caps = _DEFAULT_SOFTCAPS[arch]
    attn_cap = cfg.get("attn_logit_softcapping", caps[0])
    final_cap = cfg.get("final_logit_softcapping", caps[1])
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    gemma = GemmaConfig(
        sliding_window=int(cfg.get("sliding_window") or 4096),
        sliding_layers=sliding,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
    )
    return ModelConfig(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_len=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=tied,
        qk_norm=arch == "gemma3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        gemma=gemma,
    )
