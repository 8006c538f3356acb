"""Llama-family decoder (Llama / Llama 3, Qwen2 with qkv bias, Qwen3 with q/k norm, Mistral's
sliding window, Phi-3's LongRoPE; backends/jax/models/moe.py swaps in routed experts) over a paged
KV pool.

A pure function of (params, kv pools, ForwardBatch). The layer loop is unrolled in Python over
per-layer weight dicts and per-layer KV pools: on XLA:CPU that was 2-4x faster for decode than
stacked weights under `lax.scan` (which copied each layer's slice every step), and it lets each
layer's donated pool be updated in place.

Data flow of one step (T = padded token count, S = padded sequence count):

    input_ids [T] -> embed -> per layer: RMSNorm -> q/k/v [T, heads, d] -> RoPE(positions)
      -> write k/v into the pool at out_slots -> attention (extend: aligned blocks; decode: one
      query per sequence) -> o-proj + residual -> RMSNorm -> SwiGLU MLP + residual
    -> final RMSNorm -> hidden [T, D]

Logits are computed by the caller only for the rows it needs (`compute_logits`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sgl_tpu.backends.jax.attention import AttentionBackend
from sgl_tpu.backends.jax.forward_batch import ForwardBatch
from sgl_tpu.backends.jax.shard_ops import embed_lookup, shard_attention
from sgl_tpu.executor.attention_registry import get_attention_backend
from sgl_tpu.executor.step import ForwardMode
from sgl_tpu.models.config import LongRope, ModelConfig
from sgl_tpu.models.rope import long_inv_freq, rope_inv_freq

Params = dict
KVPools = list  # [(k_pool, v_pool)] per layer, each [kvh, num_pages, page_size, d]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               long_rope: LongRope | None = None) -> jax.Array:
    """Rotate-half RoPE (HF convention). x [T, heads, d], positions [T].

    With Phi-3's LongRoPE `inv_freq` holds the short-context frequencies; positions at or past
    the pretrained context use the long ones, and cos/sin carry the attention factor."""
    pos = positions.astype(jnp.float32)[:, None]  # [T, 1]
    freqs = pos * inv_freq[None, :]  # [T, d/2]
    factor = 1.0
    if long_rope is not None:
        long = pos * long_inv_freq(inv_freq, long_rope)[None, :]
        freqs = jnp.where(pos >= long_rope.original_max_position_embeddings, long, freqs)
        factor = long_rope.attention_factor
    cos = (jnp.cos(freqs) * factor)[:, None, :]
    sin = (jnp.sin(freqs) * factor)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _attention(
    cfg: ModelConfig,
    mode: ForwardMode,
    q: jax.Array,  # [T, H, d]
    k_pool: jax.Array,
    v_pool: jax.Array,
    fb: ForwardBatch,
    kv_tile: int,
    attn: AttentionBackend,
) -> jax.Array:
    scale = cfg.head_dim**-0.5
    # Mistral / Phi-3: the window is passed only when set, so other models' calls are unchanged
    window = {} if cfg.sliding_window is None else {"sliding_window": cfg.sliding_window}
    if mode == ForwardMode.DECODE:
        return attn.decode_attention(
            q, k_pool, v_pool, fb.page_table, fb.seq_lens, kv_tile=kv_tile, scale=scale,
            **window,
        )
    return attn.extend_attention(
        q, k_pool, v_pool, fb.page_table, fb.block_rows, fb.block_seq, fb.block_q_start,
        fb.seq_lens, fb.item_block, fb.item_tile, fb.num_items, kv_tile=kv_tile, scale=scale,
        **window,
    )


def matmul(x: jax.Array, w: jax.Array | dict) -> jax.Array:
    """x [T, in] @ w [in, out]; w may be weight-only int8 {"q": i8[in, out], "scale": f32[out]}
    (`--quantization int8`): w = q * scale, applied to the product, so the int8 matrix is what
    the step reads from memory."""
    if isinstance(w, dict):
        return (x @ w["q"].astype(x.dtype)) * w["scale"].astype(x.dtype)
    return x @ w


def forward(
    params: Params,
    kv_pools: KVPools,
    fb: ForwardBatch,
    cfg: ModelConfig,
    mode: ForwardMode,
    *,
    kv_tile: int,
    attention_backend: str = "ref",
    mesh: Mesh | None = None,
    mlp: Callable[[jax.Array, dict, ModelConfig], jax.Array] | None = None,
) -> tuple[jax.Array, KVPools]:
    """Run the decoder; returns final-normed hidden states [T, D] and the updated pools.

    `attention_backend` names the KV-write and attention implementation
    (executor/attention_registry.py); nothing else depends on it. With a tensor-parallel `mesh`
    (sgl_tpu/parallel) the params and pools are sharded on it and `cfg` carries the padded
    sizes: attention runs per device on its heads, the embedding is vocab-parallel, and GSPMD
    partitions the matmuls.
    `mlp(x [T, D], layer, cfg) -> [T, D]` replaces the dense SwiGLU MLP (backends/jax/models/moe.py
    passes its mixture of experts).
    """
    mlp = mlp or dense_mlp
    attn = get_attention_backend(attention_backend)
    inv_freq = rope_inv_freq(cfg)
    if mesh is not None:
        attn = shard_attention(attn, mesh)
        h = embed_lookup(params["embed"], fb.input_ids, mesh)  # [T, D]
    else:
        h = params["embed"][fb.input_ids]  # [T, D]
    num_tokens = h.shape[0]
    new_pools = []
    # Named scopes (kept in the compiled program's op names) let a profile split the step into
    # parts: tools/jax_step_profile.py.
    for layer, (k_pool, v_pool) in zip(params["layers"], kv_pools, strict=True):
        with jax.named_scope("qkv_proj"):
            x = rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps)
            q = matmul(x, layer["wq"])  # [T, H*d]
            k = matmul(x, layer["wk"])  # [T, kvh*d]
            v = matmul(x, layer["wv"])
            if cfg.attention_bias:
                q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
            q = apply_rope(q, fb.positions, inv_freq, cfg.long_rope)
            k = apply_rope(k, fb.positions, inv_freq, cfg.long_rope)
        with jax.named_scope("kv_write"):
            k_pool, v_pool = attn.write_kv(k_pool, v_pool, k, v, fb.out_slots)
        new_pools.append((k_pool, v_pool))
        with jax.named_scope("attention"):
            o = _attention(cfg, mode, q, k_pool, v_pool, fb, kv_tile, attn)
        with jax.named_scope("o_proj"):
            h = h + matmul(o.reshape(num_tokens, cfg.q_size), layer["wo"])
        with jax.named_scope("mlp"):
            x = rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps)
            h = h + mlp(x, layer, cfg)
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), new_pools


def dense_mlp(x: jax.Array, layer: dict, cfg: ModelConfig) -> jax.Array:
    """SwiGLU MLP: x [T, D] -> [T, D]."""
    gate = matmul(x, layer["w_gate"])  # [T, F]
    up = matmul(x, layer["w_up"])
    return matmul(jax.nn.silu(gate) * up, layer["w_down"])


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """hidden [N, D] -> float32 logits [N, V]."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("nd,vd->nv", hidden, params["embed"],
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    return logits
