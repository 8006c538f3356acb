"""Gemma 2 / Gemma 3 decoder in JAX over the paged KV pool (the layer structure is described in
`ModelConfig.gemma`; the torch twin is `gemma_torch.py`).

Data flow of one step (T = padded token count), per layer:

    h [T, D] -> RMSNorm(1+w) -> q/k/v [T, heads, d] -> q/k RMSNorm (Gemma 3) -> RoPE with the
      layer kind's base -> write k/v at out_slots -> paged attention (local layers: sliding
      window; Gemma 2: soft-capped scores) -> o-proj -> RMSNorm -> + h
    -> RMSNorm -> GeGLU MLP (tanh GELU) -> RMSNorm -> + h

Sliding windows are masks inside the attention kernels: local layers keep their whole context
in the pool like global ones (the radix cache shares pages across layers, so a page cannot be
freed for some layers only); the kernels skip KV tiles wholly below the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_tpu.backends.jax.forward_batch import ForwardBatch
from sgl_tpu.backends.jax.models.llama import KVPools, Params, apply_rope, matmul, rms_norm
from sgl_tpu.executor.attention_registry import get_attention_backend
from sgl_tpu.executor.step import ForwardMode
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.rope import gemma_inv_freqs


def gemma_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm scaled by (1 + w), in float32."""
    return rms_norm(x, 1.0 + weight.astype(jnp.float32), eps)


def forward(
    params: Params,
    kv_pools: KVPools,
    fb: ForwardBatch,
    cfg: ModelConfig,
    mode: ForwardMode,
    *,
    kv_tile: int,
    attention_backend: str = "ref",
) -> tuple[jax.Array, KVPools]:
    """Run the decoder; returns final-normed hidden states [T, D] and the updated pools."""
    g = cfg.gemma
    attn = get_attention_backend(attention_backend)
    inv_global, inv_local = gemma_inv_freqs(cfg)
    eps, scale = cfg.rms_norm_eps, g.query_pre_attn_scalar**-0.5
    embed = params["embed"]
    h = embed[fb.input_ids] * jnp.asarray(cfg.hidden_size**0.5, embed.dtype)  # [T, D]
    num_tokens = h.shape[0]
    new_pools = []
    for layer, (k_pool, v_pool), sliding in zip(params["layers"], kv_pools, g.sliding_layers,
                                                strict=True):
        window = g.sliding_window if sliding else None
        with jax.named_scope("qkv_proj"):  # scopes as in llama.py
            x = gemma_norm(h, layer["attn_norm"], eps)
            q = matmul(x, layer["wq"]).reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = matmul(x, layer["wk"]).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = matmul(x, layer["wv"]).reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = gemma_norm(q, layer["q_norm"], eps)
                k = gemma_norm(k, layer["k_norm"], eps)
            inv_freq = inv_local if sliding else inv_global
            q = apply_rope(q, fb.positions, inv_freq)
            k = apply_rope(k, fb.positions, inv_freq)
        with jax.named_scope("kv_write"):
            k_pool, v_pool = attn.write_kv(k_pool, v_pool, k, v, fb.out_slots)
        new_pools.append((k_pool, v_pool))
        kw = dict(kv_tile=kv_tile, scale=scale, sliding_window=window,
                  logit_cap=g.attn_logit_softcap)
        with jax.named_scope("attention"):
            if mode == ForwardMode.DECODE:
                o = attn.decode_attention(q, k_pool, v_pool, fb.page_table, fb.seq_lens, **kw)
            else:
                o = attn.extend_attention(
                    q, k_pool, v_pool, fb.page_table, fb.block_rows, fb.block_seq,
                    fb.block_q_start, fb.seq_lens, fb.item_block, fb.item_tile, fb.num_items,
                    **kw)
        with jax.named_scope("o_proj"):
            a = matmul(o.reshape(num_tokens, cfg.q_size), layer["wo"])
            h = h + gemma_norm(a, layer["post_attn_norm"], eps)
        with jax.named_scope("mlp"):
            x = gemma_norm(h, layer["mlp_norm"], eps)
            gate = matmul(x, layer["w_gate"])  # [T, F]
            up = matmul(x, layer["w_up"])
            m = matmul(jax.nn.gelu(gate, approximate=True) * up, layer["w_down"])
            h = h + gemma_norm(m, layer["post_mlp_norm"], eps)
    return gemma_norm(h, params["final_norm"], eps), new_pools


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """hidden [N, D] -> float32 logits [N, V] (Gemma 2's final soft-cap applied)."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("nd,vd->nv", hidden, params["embed"],
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    cap = cfg.gemma.final_logit_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap
