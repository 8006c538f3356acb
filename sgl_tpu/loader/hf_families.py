"""Family-specific parts of reading an HF checkpoint (Phi-3, Mistral, Qwen2/3-MoE, Mixtral), kept
out of `hf_loader.py`, which handles what every family shares.

    config.json --family_fields--> ModelConfig fields: experts, sliding window, LongRoPE
    tensors     --canonical_tensors--> names hf_loader maps 1:1 to canonical params:
        Phi-3    self_attn.qkv_proj [(H + 2 kvh) d, D] -> q_proj, k_proj, v_proj
                 mlp.gate_up_proj [2F, D]             -> gate_proj, up_proj
        Qwen3-MoE mlp.experts.{j}.{gate,up,down}_proj     -> mlp.experts.{gate,up,down}_exps
        Mixtral  block_sparse_moe.experts.{j}.{w1,w3,w2}  -> the same (w1 gate, w3 up, w2 down)
                 block_sparse_moe.gate                    -> mlp.gate (the router)
        either   mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F] (the
                 fused layout transformers 5 holds in memory) -> the same

Stacked experts come out [E, in, out], already in the canonical layout (hf_loader transposes
only 2-D weights).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from sgl_tpu.models.config import LongRope

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}
# canonical per-layer names (after "model.layers.{i}.") that hf_loader maps to params
STACKED_EXPERT_TENSORS = {"mlp.gate.weight": "router", "mlp.experts.gate_exps": "w_gate_exps",
                          "mlp.experts.up_exps": "w_up_exps",
                          "mlp.experts.down_exps": "w_down_exps",
                          # Qwen2-MoE's shared expert and its gate
                          "mlp.shared_expert.gate_proj.weight": "w_gate_shexp",
                          "mlp.shared_expert.up_proj.weight": "w_up_shexp",
                          "mlp.shared_expert.down_proj.weight": "w_down_shexp",
                          "mlp.shared_expert_gate.weight": "shexp_gate"}


def family_fields(model_type: str, cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a family beyond the Llama ones, read from config.json."""
    fields: dict[str, Any] = {}
    if model_type != "phi3" and long_rope_from_hf(cfg, source) is not None:
        raise ValueError(f"{source}: longrope scaling is supported for phi3 only")
    if model_type in ("mistral", "phi3"):
        window = cfg.get("sliding_window")
        fields["sliding_window"] = int(window) if window else None
    if model_type in ("qwen3_moe", "qwen2_moe"):
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{source}: dense layers among MoE layers (mlp_only_layers, "
                             "decoder_sparse_step) are not supported")
        fields.update(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                      num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                      moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                      shared_expert_intermediate_size=int(
                          cfg.get("shared_expert_intermediate_size") or 0))
    if model_type == "mixtral":  # softmax over the top-k logits == renormalised top-k probs
        fields.update(num_experts=int(cfg["num_local_experts"]),
                      num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                      moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type == "phi3":
        if float(cfg.get("partial_rotary_factor",
                         (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
                 ) != 1.0:
            raise ValueError(f"{source}: partial rotary embeddings are not supported")
        fields["long_rope"] = long_rope_from_hf(cfg, source)
    return fields


def long_rope_from_hf(cfg: dict[str, Any], source: str) -> LongRope | None:
    """LongRoPE parameters from `rope_scaling` (transformers 4) or `rope_parameters` (5); None
    when the checkpoint has plain RoPE (Phi-3 4k models)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type")) != "longrope":
        return None
    try:
        original = int(params.get("original_max_position_embeddings")
                       or cfg["original_max_position_embeddings"])
        short, long = params["short_factor"], params["long_factor"]
    except KeyError as e:
        raise ValueError(f"{source}: longrope scaling lacks {e.args[0]!r}") from e
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # the LongRoPE paper's default, as transformers computes it
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return LongRope(short_factor=tuple(float(x) for x in short),
                    long_factor=tuple(float(x) for x in long),
                    original_max_position_embeddings=original,
                    attention_factor=float(attention_factor))


def canonical_tensors(tensors: dict[str, np.ndarray], model_type: str, num_heads: int,
                      num_kv_heads: int, head_dim: int, source: str) -> dict[str, np.ndarray]:
    """Split Phi-3's fused projections and stack per-expert MoE weights (see module doc)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    for name, w in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m:
            layer, j, role = int(m[1]), int(m[2]), _EXPERT_ROLE[m[3]]
            experts.setdefault((layer, role), {})[j] = w
        elif name.endswith("mlp.experts.gate_up_proj"):  # fused [E, 2F, D] (transformers 5)
            base = name[: -len("gate_up_proj")]
            gate, up = np.split(w, 2, axis=1)
            out[base + "gate_exps"] = np.ascontiguousarray(gate.transpose(0, 2, 1))
            out[base + "up_exps"] = np.ascontiguousarray(up.transpose(0, 2, 1))
        elif name.endswith("mlp.experts.down_proj"):  # fused [E, D, F]
            out[name[: -len("down_proj")] + "down_exps"] = np.ascontiguousarray(
                w.transpose(0, 2, 1))
        elif model_type == "mixtral" and name.endswith("block_sparse_moe.gate.weight"):
            out[name.replace("block_sparse_moe.gate", "mlp.gate")] = w
        elif name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            if w.shape[0] != q + 2 * kv:
                raise ValueError(f"{source}: {name} has {w.shape[0]} rows, expected {q + 2 * kv}")
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], \
                out[base + "v_proj.weight"] = np.split(w, [q, q + kv])
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = np.split(w, 2)
        else:
            out[name] = w
    for (layer, role), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{source}: layer {layer} {role} experts are not 0..n-1: "
                             f"{sorted(by_index)}")
        stacked = np.stack([by_index[j] for j in range(len(by_index))])  # [E, out, in]
        out[f"model.layers.{layer}.mlp.experts.{role}_exps"] = np.ascontiguousarray(
            stacked.transpose(0, 2, 1))  # [E, in, out]
    return out
