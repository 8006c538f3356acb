"""What every loader returns: architecture, canonical float32 params, tokenizer.

Canonical params (numpy float32, weights laid out (in, out) so the model computes `x @ w`; Q/K
rows in Hugging Face order, i.e. rotate-half RoPE):

    embed [vocab, hidden]   final_norm [hidden]   lm_head [hidden, vocab] (untied only)
    layers[i]: attn_norm [hidden]
               wq [hidden, q]  wk [hidden, kv]  wv [hidden, kv]  wo [q, hidden]
               bq [q]  bk [kv]  bv [kv]                 (only if config.attention_bias)
               q_norm [head_dim]  k_norm [head_dim]     (only if config.qk_norm)
               mlp_norm [hidden]
               post_attn_norm [hidden]  post_mlp_norm [hidden]   (only if config.gemma; Gemma
                                        norms hold w of their (1 + w) scale)
               w_gate [hidden, inter]  w_up [hidden, inter]  w_down [inter, hidden]
               or, with config.num_experts = E experts of width f (mixture of experts):
               router [hidden, E]  w_gate_exps [E, hidden, f]  w_up_exps [E, hidden, f]
               w_down_exps [E, f, hidden]
               + with a shared expert of width s (Qwen2-MoE): w_gate_shexp [hidden, s]
               w_up_shexp [hidden, s]  w_down_shexp [s, hidden]  shexp_gate [hidden, 1]

with q = num_heads * head_dim and kv = num_kv_heads * head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_tpu.loader.tokenizer import Tokenizer
from sgl_tpu.models.config import ModelConfig

Params = dict[str, Any]  # "embed"/"final_norm"/"lm_head" -> ndarray, "layers" -> list[dict]


@dataclass(frozen=True, eq=False)  # eq would compare numpy arrays
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    model_path: str
    source_format: str  # "gguf" or "hf"


def expected_param_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                        dict[str, tuple[int, ...]]]:
    """(top-level shapes, per-layer shapes) the canonical params must have for `config`."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    top = {"embed": (config.vocab_size, h), "final_norm": (h,)}
    if not config.tie_word_embeddings:
        top["lm_head"] = (h, config.vocab_size)
    layer = {
        "attn_norm": (h,), "wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h),
        "mlp_norm": (h,), "w_gate": (h, inter), "w_up": (h, inter), "w_down": (inter, h),
    }
    if config.num_experts:  # routed experts instead of the dense MLP (backends/jax/models/moe.py)
        e, f = config.num_experts, config.moe_intermediate_size
        for name in ("w_gate", "w_up", "w_down"):
            del layer[name]
        layer.update(router=(h, e), w_gate_exps=(e, h, f), w_up_exps=(e, h, f),
                     w_down_exps=(e, f, h))
        s = config.shared_expert_intermediate_size
        if s:
            layer.update(w_gate_shexp=(h, s), w_up_shexp=(h, s), w_down_shexp=(s, h),
                         shexp_gate=(h, 1))
    if config.attention_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if config.qk_norm:
        layer.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
    if config.gemma is not None:  # norms after attention and after the MLP
        layer.update(post_attn_norm=(h,), post_mlp_norm=(h,))
    return top, layer


def check_params(config: ModelConfig, params: Params, source: str) -> None:
    """Raise ValueError unless `params` has exactly the canonical names and shapes for `config`."""
    top, layer = expected_param_shapes(config)

    def check(where: str, got: dict[str, Any], want: dict[str, tuple[int, ...]]) -> None:
        if set(got) != set(want):
            raise ValueError(
                f"{source}: {where} tensors missing {sorted(set(want) - set(got))}, "
                f"unexpected {sorted(set(got) - set(want))}"
            )
        for name, shape in want.items():
            arr = got[name]
            if tuple(arr.shape) != shape or arr.dtype != np.float32:
                raise ValueError(
                    f"{source}: {where} {name} has shape {tuple(arr.shape)} {arr.dtype}, "
                    f"expected {shape} float32"
                )

    check("model", {k: v for k, v in params.items() if k != "layers"}, top)
    if len(params["layers"]) != config.num_layers:
        raise ValueError(f"{source}: {len(params['layers'])} layers, expected {config.num_layers}")
    for i, lp in enumerate(params["layers"]):
        check(f"layer {i}", lp, layer)
