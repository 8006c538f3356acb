"""Test-side oracle for the attention kernels: plain dense causal attention of one sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_tpu.kernels.paged_attention_ref import _mask


def dense_attention_oracle(
    q: jax.Array,  # [Lq, H, d] queries at positions kv_len - Lq .. kv_len - 1
    k: jax.Array,  # [kv_len, kvh, d]
    v: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Plain causal attention for one sequence (the oracle of the paged kernels)."""
    lq, num_heads, d = q.shape
    kv_len, kvh, _ = k.shape
    group = num_heads // kvh
    qf = q.astype(jnp.float32).reshape(lq, kvh, group, d) * scale
    s = jnp.einsum("qhgd,khd->qhgk", qf, k.astype(jnp.float32))
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)
    q_pos = jnp.arange(kv_len - lq, kv_len)[:, None]
    ok = _mask(q_pos, jnp.arange(kv_len)[None, :], kv_len, sliding_window)
    s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("qhgk,khd->qhgd", p, v.astype(jnp.float32))
    return o.reshape(lq, num_heads, d)
