"""Gemma 2 / Gemma 3 decoder in PyTorch over the token-major paged KV pool; the twin of
`sgl_tpu.backends.jax.models.gemma` for `--backend torch`.

A Gemma layer differs from a Llama layer (llama_torch.py) in its norms, MLP and attention kinds:

    h ──norm──► q k v ──(q/k norm, Gemma 3)──► RoPE (local or global base) ──► attention
      (sliding window on local layers; scores soft-capped on Gemma 2) ──► o-proj ──norm──► + h
    h ──norm──► gate/up ──gelu_tanh(gate) * up──► down ──norm──► + h

Every norm is RMSNorm with (1 + w), applied here as an ordinary RMSNorm whose weight is 1 + w
(added once when the weights are converted). Embeddings are scaled by sqrt(hidden) rounded to
the weights' dtype, as transformers does. The parts with fixed shapes (`pre`, `post`) are the
ones the runner may compile; attention stays eager. On an eager CPU runner the layers run on the
compiled element-wise ops (`use_layer_ops`, as llama.py's), the GeGLU on torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sgl_tpu.backends.torch.models.llama import (
    REFINE_TOP,
    Linear,
    WriteKV,
    _packed_linear,
    apply_rope,
    rms_norm,
    rope_tables,
)
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.rope import gemma_inv_freqs


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # f32[D], 1 + w
    wqkv: torch.Tensor  # [(H + 2 kvh) d, D]
    q_norm: torch.Tensor | None  # f32[d], 1 + w (Gemma 3)
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [D, H d]
    post_attn_norm: torch.Tensor  # f32[D]
    mlp_norm: torch.Tensor  # f32[D]
    w_gate_up: torch.Tensor  # [2F, D]
    w_down: torch.Tensor  # [D, F]
    post_mlp_norm: torch.Tensor  # f32[D]
    sliding: bool  # a local (sliding-window) layer


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [V, D]
    embed_scale: float  # sqrt(D) rounded to the weights' dtype
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # f32[D]
    lm_head: torch.Tensor  # [V, D] (the tied embedding; packed separately)
    head_rows: torch.Tensor  # [V, D] never packed (row gathers)
    inv_freq_global: torch.Tensor  # f32[d/2]
    inv_freq_local: torch.Tensor  # f32[d/2]
    linear: Linear


def convert_weights(params: dict, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                    prepack: bool = False) -> Weights:
    """Loader numpy params (matrices [in, out], norms as w) -> fused torch weights."""
    g = cfg.gemma

    def mat(*arrays: np.ndarray) -> torch.Tensor:  # [in, out] pieces -> [sum(out), in]
        a = np.concatenate(arrays, axis=1) if len(arrays) > 1 else arrays[0]
        w = torch.from_numpy(np.ascontiguousarray(a.T)).to(device=device, dtype=dtype)
        return torch.ops.mkldnn._reorder_linear_weight(w, None) if prepack else w

    def norm(a: np.ndarray) -> torch.Tensor:  # (1 + w) in float32
        return torch.from_numpy(np.asarray(a, np.float32) + np.float32(1)).to(device)

    layers = [LayerWeights(
        attn_norm=norm(lw["attn_norm"]),
        wqkv=mat(lw["wq"], lw["wk"], lw["wv"]),
        q_norm=norm(lw["q_norm"]) if cfg.qk_norm else None,
        k_norm=norm(lw["k_norm"]) if cfg.qk_norm else None,
        wo=mat(lw["wo"]),
        post_attn_norm=norm(lw["post_attn_norm"]),
        mlp_norm=norm(lw["mlp_norm"]),
        w_gate_up=mat(lw["w_gate"], lw["w_up"]),
        w_down=mat(lw["w_down"]),
        post_mlp_norm=norm(lw["post_mlp_norm"]),
        sliding=sliding,
    ) for lw, sliding in zip(params["layers"], g.sliding_layers, strict=True)]
    embed = torch.from_numpy(np.array(params["embed"])).to(device, dtype)
    if cfg.tie_word_embeddings:
        head_rows = embed
    else:
        head_rows = torch.from_numpy(np.ascontiguousarray(params["lm_head"].T)).to(device, dtype)
    lm_head = torch.ops.mkldnn._reorder_linear_weight(head_rows, None) if prepack else head_rows
    inv_global, inv_local = gemma_inv_freqs(cfg)
    return Weights(
        embed=embed,
        embed_scale=float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype)),
        layers=layers, final_norm=norm(params["final_norm"]), lm_head=lm_head,
        head_rows=head_rows, inv_freq_global=torch.from_numpy(inv_global).to(device),
        inv_freq_local=torch.from_numpy(inv_local).to(device),
        linear=_packed_linear if prepack else F.linear)


def layer_pre(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
              cfg: ModelConfig, linear: Linear = F.linear
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, D] -> q [T, H, d], k [T, kvh, d], v [T, kvh, d] (q/k normed, RoPE applied)."""
    x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
    qkv = linear(x, w.wqkv, None)  # [T, (H + 2 kvh) d]
    t, d = h.shape[0], cfg.head_dim
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = q.reshape(t, cfg.num_heads, d)
    k = k.reshape(t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(t, cfg.num_kv_heads, d)


def layer_post(h: torch.Tensor, o: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
               linear: Linear = F.linear) -> torch.Tensor:
    """o [T, H, d] -> o-proj, post-norm, residual -> GeGLU MLP, post-norm, residual; [T, D]."""
    eps = cfg.rms_norm_eps
    a = linear(o.reshape(h.shape[0], cfg.q_size), w.wo, None)
    h = h + rms_norm(a, w.post_attn_norm, eps)
    x = rms_norm(h, w.mlp_norm, eps)
    gate, up = linear(x, w.w_gate_up, None).chunk(2, dim=-1)
    m = linear(F.gelu(gate, approximate="tanh") * up, w.w_down, None)
    return h + rms_norm(m, w.post_mlp_norm, eps)


class GemmaTorch:
    """The decoder as plain functions over `Weights` (the runner may compile `pre`, `post` and
    `final_norm`; same contract as llama_torch.LlamaTorch)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, write_kv: WriteKV,
                 compile_fn: Callable[[Callable], Callable] | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.write_kv = write_kv
        self.scale = cfg.gemma.query_pre_attn_scalar**-0.5
        wrap = compile_fn or (lambda f: f)
        linear = weights.linear

        def pre(h, w, cos, sin):
            return layer_pre(h, w, cos, sin, cfg, linear)

        def post(h, o, w):
            return layer_post(h, o, w, cfg, linear)

        self.pre = wrap(pre)
        self.post = wrap(post)
        self.final_norm = wrap(rms_norm)
        self.layer_ops: Any = None  # the compiled kernels/layer_ops_cpu module, when in use

    def use_layer_ops(self, ops: Any) -> bool:
        """Run `forward_fused` with the compiled module `ops` when the pool is written by the
        standard token-major `write_kv` (the fused op writes it); whether it took them."""
        from sgl_tpu.backends.torch import paged_attention

        if self.write_kv is not paged_attention.write_kv:
            return False
        self.layer_ops = ops
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                attention: Callable[..., torch.Tensor],
                local_out_slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions/out_slots i64[T] -> final-normed hidden [T, D].

        `attention(q, k_pool, v_pool, sliding_window=, logit_cap=)` is the step's attention
        with its batch bound in; local layers pass the window, Gemma 2 the score cap.
        `local_out_slots`: where local layers write K/V, when their pools are a sliding-window
        pool of their own (else `out_slots`).
        """
        slots = {False: out_slots, True: out_slots if local_out_slots is None
                 else local_out_slots}
        if self.layer_ops is not None:
            return self.forward_fused(input_ids, positions, slots, kv_pools, attention)
        cfg, g = self.cfg, self.cfg.gemma
        tables = {False: rope_tables(positions, self.w.inv_freq_global),
                  True: rope_tables(positions, self.w.inv_freq_local)}
        h = self.w.embed.index_select(0, input_ids) * self.w.embed_scale  # [T, D]
        for w, (k_pool, v_pool) in zip(self.w.layers, kv_pools, strict=True):
            q, k, v = self.pre(h, w, *tables[w.sliding])
            self.write_kv(k_pool, v_pool, k, v, slots[w.sliding])
            o = attention(q, k_pool, v_pool,
                          sliding_window=g.sliding_window if w.sliding else None,
                          logit_cap=g.attn_logit_softcap)
            h = self.post(h, o, w)
        return self.final_norm(h, self.w.final_norm, cfg.rms_norm_eps)

    def forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      slots: dict[bool, torch.Tensor],
                      kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                      attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`forward` with the compiled layer ops (`slots`: the K/V write slots of global and
        local layers, by `sliding`). Each residual add is deferred into the next
        pre-norm, which adds in place (`h` is this step's own embedding rows):

            x = norm(h += delta)   qkv = x Wqkv   rope_write_kv(qkv) (q/k norms: Gemma 3)
            o = attn(q)            x = norm(h += norm_post(o Wo))
            delta = norm_post(geglu(x Wgu) Wd)                  ... final norm(h += delta)
        """
        cfg, g, ops, eps = self.cfg, self.cfg.gemma, self.layer_ops, self.cfg.rms_norm_eps
        linear = self.w.linear
        t, h_q, h_kv, d = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tables = {False: rope_tables(positions, self.w.inv_freq_global),
                  True: rope_tables(positions, self.w.inv_freq_local)}
        h = self.w.embed.index_select(0, input_ids) * self.w.embed_scale  # [T, D]
        delta = None  # [T, D] the last MLP's normed output, not yet added to h
        for w, (k_pool, v_pool) in zip(self.w.layers, kv_pools, strict=True):
            x = (ops.rms_norm(h, w.attn_norm, eps) if delta is None
                 else ops.add_rms_norm(h, delta, w.attn_norm, eps))
            qkv = linear(x, w.wqkv, None)  # [T, (H + 2 kvh) d]
            ops.rope_write_kv(qkv, *tables[w.sliding], k_pool, v_pool, slots[w.sliding], h_q,
                              h_kv, w.q_norm, w.k_norm, eps)
            o = attention(qkv[:, : cfg.q_size].view(t, h_q, d), k_pool, v_pool,
                          sliding_window=g.sliding_window if w.sliding else None,
                          logit_cap=g.attn_logit_softcap)
            a = ops.rms_norm(linear(o.reshape(t, cfg.q_size), w.wo, None), w.post_attn_norm,
                             eps)
            x = ops.add_rms_norm(h, a, w.mlp_norm, eps)
            gate, up = linear(x, w.w_gate_up, None).chunk(2, dim=-1)
            m = linear(F.gelu(gate, approximate="tanh") * up, w.w_down, None)
            delta = ops.rms_norm(m, w.post_mlp_norm, eps)
        if delta is None:
            return ops.rms_norm(h, self.w.final_norm, eps)
        return ops.add_rms_norm(h, delta, self.w.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> float32 logits [N, V] (bf16 top candidates refined in float32, as
        in llama_torch; Gemma 2's final soft-cap applied last)."""
        out = self.w.linear(hidden, self.w.lm_head, None).float()  # [N, V]
        if hidden.dtype != torch.float32:
            cand = out.topk(min(REFINE_TOP, out.shape[1]), dim=-1).indices  # [N, C]
            rows = self.w.head_rows[cand].float()  # [N, C, D]
            exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)  # [N, C]
            out.scatter_(1, cand, exact)
        cap = self.cfg.gemma.final_logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap


def build_model(params: dict, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                prepack: bool, write_kv: WriteKV,
                compile_fn: Callable[[Callable], Callable] | None = None,
                quantize: Callable[[Weights], Weights] | None = None) -> GemmaTorch:
    """The registry's torch entry point (models/registry.py), as llama_torch.build_model."""
    weights = convert_weights(params, cfg, dtype, device, prepack)
    if quantize is not None:
        weights = quantize(weights)
    return GemmaTorch(cfg, weights, write_kv, compile_fn)
