"""Mixture-of-experts decoder (Qwen3-MoE, Mixtral, Qwen2-MoE) in PyTorch: `llama_torch.LlamaTorch`
with each layer's MLP replaced by routed SwiGLU experts (plus Qwen2-MoE's gated shared expert);
the twin of `sgl_tpu.backends.jax.models.moe`.

A layer's `post` is split in two: the o-proj, residual and RMSNorm keep fixed shapes (compiled
per bucket like the dense model); the experts run eagerly on sorted tokens, one GEMM pair per
expert that received tokens this step, so compute and weight reads scale with the active
experts (N = T * k assignments):

    x [T, D] --router--> probs f32[T, E] --top-k--> weights [T, k], experts [T, k]
      --stable sort of the N assignments by expert--> rows x[token of each] [N, D]
      --per active expert e: rows of e @ w_gate_up[e] -> SwiGLU -> @ w_down[e]--> y [N, D]
      --index_add of weight * y into each row's token--> [T, D]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sgl_tpu.backends.torch.models import llama as llama_torch
from sgl_tpu.backends.torch.models.llama import LayerWeights, LlamaTorch, WriteKV, rms_norm
from sgl_tpu.models.config import ModelConfig


@dataclass(frozen=True)
class MoeLayerWeights(LayerWeights):
    router: torch.Tensor | None = None  # f32[E, D]
    w_gate_up_exps: torch.Tensor | None = None  # [E, 2F, D]
    w_down_exps: torch.Tensor | None = None  # [E, D, F]
    shexp_gate_up: torch.Tensor | None = None  # [2S, D] Qwen2-MoE shared expert
    shexp_down: torch.Tensor | None = None  # [D, S]
    shexp_gate: torch.Tensor | None = None  # f32[1, D]


def moe_ffn(x: torch.Tensor, w: MoeLayerWeights, cfg: ModelConfig) -> torch.Tensor:
    """Routed SwiGLU experts: x [T, D] -> [T, D] (module doc)."""
    num_tokens, k = x.shape[0], cfg.num_experts_per_tok
    # float32 router: in bf16 near-tied experts swap, and a swapped expert moves the logits
    probs = F.linear(x.float(), w.router).softmax(dim=-1)  # [T, E]
    weights, experts = probs.topk(k, dim=-1)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.reshape(-1)  # [N]
    order = flat.argsort(stable=True)
    tokens = order // k  # [N] token of each sorted row
    counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()
    xs = x.index_select(0, tokens)  # [N, D]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(xs[start : start + n], w.w_gate_up_exps[e]).chunk(2, dim=-1)
            ys[start : start + n] = F.linear(F.silu(gate) * up, w.w_down_exps[e])
        start += n
    ys = ys.float() * weights.reshape(-1)[order][:, None]
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, ys)
    if w.shexp_gate is not None:  # Qwen2-MoE: every token also takes the shared expert
        gate, up = F.linear(x, w.shexp_gate_up).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, w.shexp_down).float()
        out += torch.sigmoid(F.linear(x.float(), w.shexp_gate)) * shared
    return out.to(x.dtype)


class MoeTorch(LlamaTorch):
    fused_layers = False  # routed experts in place of the dense MLP
    def __init__(self, cfg: ModelConfig, weights: llama_torch.Weights, write_kv: WriteKV,
                 compile_fn: Callable[[Callable], Callable] | None = None) -> None:
        super().__init__(cfg, weights, write_kv, compile_fn)
        linear = weights.linear

        def attn_out(h, o, w):  # o [T, H, d] -> (h + o-proj [T, D], RMSNorm of it)
            h = h + linear(o.reshape(h.shape[0], cfg.q_size), w.wo, None)
            return h, rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)

        attn_out = (compile_fn or (lambda f: f))(attn_out)

        def post(h, o, w):
            h, x = attn_out(h, o, w)
            return h + moe_ffn(x, w, cfg)

        self.post = post


def convert_moe_weights(params: dict, cfg: ModelConfig, dtype: torch.dtype,
                        device: torch.device, prepack: bool) -> llama_torch.Weights:
    """Loader params -> Weights whose layers are MoeLayerWeights (experts [out, in] per expert,
    never prepacked: they are sliced per expert)."""
    weights = llama_torch.convert_weights(params, cfg, dtype, device, prepack)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    layers = []
    for lw, dense in zip(params["layers"], weights.layers, strict=True):
        gate_up = np.concatenate([lw["w_gate_exps"], lw["w_up_exps"]], axis=2)  # [E, D, 2F]
        shared = {}
        if "shexp_gate" in lw:
            shared = dict(
                shexp_gate_up=t(np.concatenate([lw["w_gate_shexp"], lw["w_up_shexp"]], 1).T),
                shexp_down=t(lw["w_down_shexp"].T),
                shexp_gate=torch.from_numpy(np.array(lw["shexp_gate"].T)).to(device))  # f32
        layers.append(MoeLayerWeights(
            **{f.name: getattr(dense, f.name) for f in dataclasses.fields(LayerWeights)},
            router=torch.from_numpy(np.array(lw["router"].T)).to(device),  # f32
            w_gate_up_exps=t(gate_up.transpose(0, 2, 1)),
            w_down_exps=t(lw["w_down_exps"].transpose(0, 2, 1)), **shared))
    return dataclasses.replace(weights, layers=layers)


def build_model(params: dict, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                prepack: bool, write_kv: WriteKV,
                compile_fn: Callable[[Callable], Callable] | None = None,
                quantize: Callable[[llama_torch.Weights], llama_torch.Weights] | None = None
                ) -> MoeTorch:
    """The registry's torch entry point; `quantize` covers the attention projections only."""
    weights = convert_moe_weights(params, cfg, dtype, device, prepack)
    if quantize is not None:
        weights = quantize(weights)
    return MoeTorch(cfg, weights, write_kv, compile_fn)
