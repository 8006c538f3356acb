"""Llama-family decoder in PyTorch (Llama / Llama 3, Qwen2 qkv bias, Qwen3 q/k norm, Mistral,
Phi-3 LongRoPE; backends/torch/models/moe.py adds routed experts) over a token-major paged KV pool;
the twin of `sgl_tpu.backends.jax.models.llama` for `--backend torch`.

Each layer is split in three so the parts with fixed shapes can be compiled once per bucket:

    h [T, D] ──pre (compiled)──► q [T, H, d], k, v [T, kvh, d]    RMSNorm, fused qkv, bias,
                                                                  q/k norm, RoPE
             ──write_kv, attention (eager: ragged)──► o [T, H, d]
             ──post (compiled)──► h [T, D]                        o-proj + residual, RMSNorm,
                                                                  fused gate/up SwiGLU + residual

Weights are converted once from the loader's numpy dict: projections fused (`wqkv`,
`w_gate_up`) and stored [out, in] for `F.linear`; norms stay float32. With `prepack` (bfloat16
on CPU, eager) every projection is reordered once into oneDNN's blocked layout and applied with
`mkldnn._linear_pointwise`: bit-identical to `F.linear`, which reorders the weight on every call
(measured 1.2-1.6x faster for decode-sized batches on a 2-core AVX512-BF16 CPU). Packed tensors
cannot enter torch.compile graphs, so the runner prepacks only when it runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sgl_tpu.models.config import LongRope, ModelConfig
from sgl_tpu.models.rope import long_inv_freq, rope_inv_freq


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # f32[D]
    wqkv: torch.Tensor  # [(H + 2 kvh) d, D]
    bqkv: torch.Tensor | None  # [(H + 2 kvh) d] (Qwen2)
    q_norm: torch.Tensor | None  # f32[d] (Qwen3)
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [D, H d]
    mlp_norm: torch.Tensor  # f32[D]
    w_gate_up: torch.Tensor | None  # [2F, D]; None in MoE layers (backends/torch/models/moe.py)
    w_down: torch.Tensor | None  # [D, F]


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # f32[D]
    lm_head: torch.Tensor  # [V, D] (the embedding when tied; packed separately)
    head_rows: torch.Tensor  # [V, D] the same matrix, never packed (row gathers)
    inv_freq: torch.Tensor  # f32[d/2]
    linear: Linear  # F.linear, or the oneDNN call for prepacked projections
    long_inv_freq: torch.Tensor | None = None  # f32[d/2] LongRoPE past the pretrained context


def convert_weights(params: dict, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device, prepack: bool = False) -> Weights:
    """Loader numpy params (matrices [in, out]) -> fused torch weights on `device`."""

    def mat(*arrays: np.ndarray) -> torch.Tensor:  # [in, out] pieces -> [sum(out), in]
        a = np.concatenate(arrays, axis=1) if len(arrays) > 1 else arrays[0]
        w = torch.from_numpy(np.ascontiguousarray(a.T)).to(device=device, dtype=dtype)
        return torch.ops.mkldnn._reorder_linear_weight(w, None) if prepack else w

    def vec(a: np.ndarray | None, vdtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.array(a)).to(device, vdtype)

    layers = []
    for lw in params["layers"]:
        bias = (np.concatenate([lw["bq"], lw["bk"], lw["bv"]]) if cfg.attention_bias else None)
        layers.append(LayerWeights(
            attn_norm=vec(lw["attn_norm"]),
            wqkv=mat(lw["wq"], lw["wk"], lw["wv"]),
            bqkv=vec(bias, dtype),
            q_norm=vec(lw.get("q_norm")) if cfg.qk_norm else None,
            k_norm=vec(lw.get("k_norm")) if cfg.qk_norm else None,
            wo=mat(lw["wo"]),
            mlp_norm=vec(lw["mlp_norm"]),
            w_gate_up=mat(lw["w_gate"], lw["w_up"]) if "w_gate" in lw else None,
            w_down=mat(lw["w_down"]) if "w_down" in lw else None,
        ))
    embed = torch.from_numpy(np.array(params["embed"])).to(device, dtype)
    if cfg.tie_word_embeddings:
        head_rows = embed
    else:
        head_rows = torch.from_numpy(np.ascontiguousarray(params["lm_head"].T)).to(device, dtype)
    lm_head = torch.ops.mkldnn._reorder_linear_weight(head_rows, None) if prepack else head_rows
    return Weights(embed=embed, layers=layers, final_norm=vec(params["final_norm"]),
                   lm_head=lm_head, head_rows=head_rows,
                   inv_freq=torch.from_numpy(rope_inv_freq(cfg)).to(device),
                   linear=_packed_linear if prepack else F.linear,
                   long_inv_freq=None if cfg.long_rope is None else torch.from_numpy(
                       long_inv_freq(rope_inv_freq(cfg), cfg.long_rope)).to(device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the last axis; x [..., n], weight f32[n]. One call instead of
    six (bit-identical to writing out x * rsqrt(mean(x^2) + eps) * weight in float32)."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention) on every head of x [T, heads, d] at once.

    cos/sin f32[T, 1, d] from `rope_tables`: cos = (cos, cos), sin = (-sin, sin), so that with
    x = (x1, x2) and its halves swapped, x' = (x2, x1):

        x * cos + x' * sin = (x1 cos - x2 sin, x2 cos + x1 sin)
    """
    xf = x.float()
    t, n, d = xf.shape
    swapped = xf.view(t, n, 2, d // 2).flip(2).view(t, n, d)
    return torch.addcmul(xf * cos, swapped, sin).to(x.dtype)


def layer_pre(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
              cfg: ModelConfig, linear: Linear = F.linear
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, D] -> q [T, H, d], k [T, kvh, d], v [T, kvh, d] (RoPE applied to q and k).

    q and k lie side by side in the fused projection's output, so without q/k norms one RoPE
    call rotates all H + kvh heads; q and k come back as views of its result.
    """
    x = rms_norm(h, w.attn_norm, cfg.rms_norm_eps)
    qkv = linear(x, w.wqkv, w.bqkv)  # [T, (H + 2 kvh) d]
    t, h_q, h_kv, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, h_kv, d)
    if cfg.qk_norm:
        q, k = qkv[:, : cfg.q_size + cfg.kv_size].split([cfg.q_size, cfg.kv_size], dim=-1)
        q = rms_norm(q.reshape(t, h_q, d), w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k.reshape(t, h_kv, d), w.k_norm, cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
    qk = apply_rope(qkv[:, : cfg.q_size + cfg.kv_size].view(t, h_q + h_kv, d), cos, sin)
    return qk[:, :h_q], qk[:, h_q:], v


def layer_post(h: torch.Tensor, o: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
               linear: Linear = F.linear,
               all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Attention output o [T, H, d] -> o-proj + residual -> SwiGLU MLP + residual; [T, D].

    Under tensor parallelism (sgl_tpu/backends/torch/tp.py) the o- and down-projections are
    row-parallel: `all_reduce` sums the ranks' partial [T, D] outputs before each residual."""
    reduce = all_reduce or (lambda t: t)
    h = h + reduce(linear(o.reshape(h.shape[0], cfg.q_size), w.wo, None))
    x = rms_norm(h, w.mlp_norm, cfg.rms_norm_eps)
    gate, up = linear(x, w.w_gate_up, None).chunk(2, dim=-1)
    return h + reduce(linear(F.silu(gate) * up, w.w_down, None))


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                long_rope: LongRope | None = None, long_inv: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions i64[T] -> cos, sin f32[T, 1, d] in `apply_rope`'s form (once per step, for
    every layer). With Phi-3's LongRoPE, positions past the pretrained context take the long
    frequencies and cos/sin carry the attention factor (as backends/jax/models/llama.py
    `apply_rope`)."""
    pos = positions.float()[:, None]  # [T, 1]
    freqs = pos * inv_freq[None, :]  # [T, d/2]
    if long_rope is not None:
        long = pos * long_inv[None, :]
        freqs = torch.where(pos >= long_rope.original_max_position_embeddings, long, freqs)
        factor = long_rope.attention_factor
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
        return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


REFINE_TOP = 32  # bf16 logits recomputed in float32 per row (see LlamaTorch.logits)
# write_kv(k_pool, v_pool, k, v, out_slots): the attention backend's in-place K/V write
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# lora(layer index, its LayerWeights, linear) -> that layer's linear with the step's LoRA deltas
# added (backends/torch/lora.py LoraStack.linear_for, the step's batch bound in)
LoraLinear = Callable[[int, LayerWeights, Linear], Linear]


class LlamaTorch:
    """The decoder as plain functions over `Weights`; `pre`/`post`/`final_norm` may be swapped
    for compiled versions by the runner (same signatures).

    On an eager CPU runner `use_layer_ops` switches `forward` to `forward_fused`: the same
    layers with their element-wise groups in the compiled ops of
    backends/torch/kernels/layer_ops_cpu.py."""

    # False in subclasses whose layers are not these (MoE experts, tensor-parallel reductions)
    fused_layers = True

    def __init__(self, cfg: ModelConfig, weights: Weights, write_kv: WriteKV,
                 compile_fn: Callable[[Callable], Callable] | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.write_kv = write_kv
        self.scale = cfg.head_dim**-0.5
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
        self.decode_layers: Any = None  # its DecodeLayers over these weights, when in use
        self.decode_layers_max_rows: int | None = None  # the most rows it takes (None: any)

    def use_layer_ops(self, ops: Any) -> bool:
        """Run `forward_fused` with the compiled module `ops`
        (backends/torch/kernels/layer_ops_cpu.py) if these layers can: this class's own (not a
        subclass's), the pool written by the standard token-major `write_kv` (the fused op writes
        it). Whether it took them."""
        from sgl_tpu.backends.torch import paged_attention

        if not self.fused_layers or self.write_kv is not paged_attention.write_kv:
            return False
        self.layer_ops = ops
        return True

    def use_decode_layers(self, kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                          bf16_dots: bool) -> bool:
        """Run decode steps' layers as one compiled call (layer_ops_cpu.decode_layers, with the
        compiled attention kernel's `bf16_dots`) where they can: the layer ops in use, this
        class's own layers, no sliding window, every projection a block kernel of one family
        without bias, shapes the attention kernel takes. Whether it did."""
        from sgl_tpu.backends.torch import paged_attention
        from sgl_tpu.backends.torch.kernels import layer_ops_cpu

        cfg = self.cfg
        if (self.layer_ops is None or type(self).forward_fused is not LlamaTorch.forward_fused
                or cfg.sliding_window is not None):
            return False
        q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=self.w.embed.dtype)
        if not paged_attention.fused_takes(q, kv_pools[0][0]):
            return False
        found = layer_ops_cpu.decode_layers(
            self.w.layers, kv_pools, self.w.final_norm, cfg.num_heads, cfg.num_kv_heads,
            cfg.rms_norm_eps, self.scale, bf16_dots)
        self.decode_layers, self.decode_layers_max_rows = found or (None, None)
        return self.decode_layers is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                decode_batch: Any = None, lora: LoraLinear | None = None) -> torch.Tensor:
        """input_ids/positions/out_slots i64[T] -> final-normed hidden [T, D].

        `attention(q, k_pool, v_pool)` is the step's attention (extend or decode) with its
        batch description bound in; the K/V write happens here, before it. A decode step's
        `decode_batch` (the compiled kernel's FusedDecodeBatch, which `attention` has bound in)
        lets `decode_layers` run the layers when in use. `lora`: the step's LoRA adapters (a
        step with adapter rows runs eagerly, the decode layers' single call skipped).
        """
        if self.layer_ops is not None:
            return self.forward_fused(input_ids, positions, out_slots, kv_pools, attention,
                                      decode_batch, lora)
        cfg = self.cfg
        cos, sin = rope_tables(positions, self.w.inv_freq, cfg.long_rope,
                               self.w.long_inv_freq)
        h = self.embed(input_ids)  # [T, D]
        for i, (w, (k_pool, v_pool)) in enumerate(zip(self.w.layers, kv_pools, strict=True)):
            if lora is None:
                q, k, v = self.pre(h, w, cos, sin)
            else:
                linear = lora(i, w, self.w.linear)
                q, k, v = layer_pre(h, w, cos, sin, cfg, linear)
            self.write_kv(k_pool, v_pool, k, v, out_slots)
            o = attention(q, k_pool, v_pool)
            h = self.post(h, o, w) if lora is None else layer_post(h, o, w, cfg, linear)
        return self.final_norm(h, self.w.final_norm, cfg.rms_norm_eps)

    def forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      out_slots: torch.Tensor, kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                      attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                          torch.Tensor],
                      decode_batch: Any = None, lora: LoraLinear | None = None
                      ) -> torch.Tensor:
        """`forward` with the compiled layer ops: per layer 4 projections, attention and 4
        element-wise calls (~20 aten calls with views, against ~100 with the torch ops). Each
        residual add is deferred into the next norm, which adds in place (`h` is this step's
        own embedding rows):

            x = norm(h += delta)  qkv = x Wqkv  rope_write_kv(qkv)  o = attn(q)
            x = norm(h += o Wo)   delta = silu_mul(x Wgu) Wd            ... final norm(h += delta)

        With `decode_layers` and a `decode_batch` of at most `decode_layers_max_rows` rows, the
        loop below runs compiled, in one call.
        """
        cfg, ops, linear, eps = self.cfg, self.layer_ops, self.w.linear, self.cfg.rms_norm_eps
        t, h_q, h_kv, d = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = rope_tables(positions, self.w.inv_freq, cfg.long_rope,
                               self.w.long_inv_freq)  # f32[T, 1, d]
        h = self.embed(input_ids)  # [T, D]
        if self.decode_layers is not None and decode_batch is not None and lora is None and (
                self.decode_layers_max_rows is None or t <= self.decode_layers_max_rows):
            b = decode_batch
            return self.decode_layers.run(h, cos, sin, out_slots, b.shared_slots, b.slots,
                                          b.own_lo, b.own_hi)
        delta = None  # [T, D] the last MLP's output, not yet added to h
        for i, (w, (k_pool, v_pool)) in enumerate(zip(self.w.layers, kv_pools, strict=True)):
            if lora is not None:
                linear = lora(i, w, self.w.linear)
            x = (ops.rms_norm(h, w.attn_norm, eps) if delta is None
                 else ops.add_rms_norm(h, delta, w.attn_norm, eps))
            qkv = linear(x, w.wqkv, w.bqkv)  # [T, (H + 2 kvh) d]
            ops.rope_write_kv(qkv, cos, sin, k_pool, v_pool, out_slots, h_q, h_kv,
                              w.q_norm, w.k_norm, eps)  # q/k norms: Qwen3
            o = attention(qkv[:, : cfg.q_size].view(t, h_q, d), k_pool, v_pool)  # [T, H, d]
            x = ops.add_rms_norm(h, linear(o.reshape(t, cfg.q_size), w.wo, None), w.mlp_norm,
                                 eps)
            delta = linear(ops.silu_mul(linear(x, w.w_gate_up, None)), w.w_down, None)
        if delta is None:
            return ops.rms_norm(h, self.w.final_norm, eps)
        return ops.add_rms_norm(h, delta, self.w.final_norm, eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """i64[T] -> [T, D] (a tensor-parallel model overrides it with a vocab-parallel one)."""
        return self.w.embed.index_select(0, input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> float32 logits [N, V].

        In bfloat16 the vocabulary GEMM rounds its output to bf16: logits near 25 land on a
        0.125 grid, and a 135M model's top candidates are often closer than that (greedy then
        picked the lowest-index tie). The top `REFINE_TOP` of each row are therefore recomputed
        as exact float32 dot products of the same bf16 weights (a [N, C, D] gather); the tail
        keeps the rounded values (a few % of probability, irrelevant to greedy and top-p).
        """
        out = self.w.linear(hidden, self.w.lm_head, None)  # [N, V]
        if out.dtype != torch.float32:  # rounded to bf16 (an exact float32 head skips this)
            out = out.float()
            cand = out.topk(min(REFINE_TOP, out.shape[1]), dim=-1).indices  # [N, C]
            rows = self.w.head_rows[cand].float()  # [N, C, D]
            exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)  # [N, C]
            out.scatter_(1, cand, exact)
        return out


def build_model(params: dict, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                prepack: bool, write_kv: WriteKV,
                compile_fn: Callable[[Callable], Callable] | None = None,
                quantize: Callable[[Weights], Weights] | None = None) -> LlamaTorch:
    """The registry's torch entry point (models/registry.py): loader params -> model.

    `quantize` may swap projections for quantized ones (backends/torch/quantize.py) and
    `Weights.linear` for a linear that accepts them."""
    weights = convert_weights(params, cfg, dtype, device, prepack)
    if quantize is not None:
        weights = quantize(weights)
    return LlamaTorch(cfg, weights, write_kv, compile_fn)

