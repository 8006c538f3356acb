"""Batch-invariant paged attention in `jax.numpy` (`ref-invariant`, selected by
`--enable-deterministic-inference`; see sgl_tpu/executor/batch_invariant.py).

The reference kernel (paged_attention_ref.py) walks EXTEND in query blocks of `block_q` rows and
DECODE one row per sequence: the score and value dots have other shapes on the two paths, so a
token's attention output (and from the next layer on, its K/V) differed between a whole
prefill, a chunked one, a radix-cache hit (EXTEND of the suffix) and DECODE. Here both entry
points run one per-row loop:

    row r (a query token: its sequence's page-table row, its position p)
    for KV tile j = 0, 1, ... up to the step's last horizon (kv_tile keys, whole pages):
        s   = q_r . K_j  for the G query heads of each KV head     [kvh, R, G, KT] f32
        keys past p masked; online softmax in f32 (the reference's `_online_softmax_step`)

A tile past a row's horizon is an exact no-op for that row (all scores masked: the running
max is kept, p = 0, alpha = 1), so the row's result depends on its query and its keys
0 .. p only. Every row gathers its own tiles ([kvh, R, KT, d] per tile): EXTEND reads the
context once per query row instead of once per block, which is what this costs.

Same signatures as the reference (its extend arguments give each packed token's sequence and
position); the K/V write is the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sgl_tpu.kernels.paged_attention_ref import (
    NEG_INF,
    _finish,
    _gather_tile,
    _online_softmax_step,
)


def _rows_attention(q, k_pool, v_pool, row_pages, row_pos, row_valid, *, kv_tile: int,
                    scale: float) -> jax.Array:
    """q [R, H, d]; row_pages i32[R, P] the page-table row of each query's sequence; row_pos
    i32[R] its position; row_valid bool[R] -> [R, H, d] (invalid rows zero)."""
    num_rows, num_heads, d = q.shape
    kvh, page_size = k_pool.shape[0], k_pool.shape[2]
    group = num_heads // kvh
    pages_per_tile = kv_tile // page_size
    q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(num_rows, kvh, group, d)
    q = q.transpose(1, 0, 2, 3)  # [kvh, R, G, d]
    q_pos = row_pos[:, None]  # [R, 1]
    last_tile = (jnp.max(jnp.where(row_valid, row_pos, 0)) + kv_tile) // kv_tile

    def tile_body(j, carry):
        pages = lax.dynamic_slice_in_dim(row_pages, j * pages_per_tile, pages_per_tile, axis=1)
        kt = _gather_tile(k_pool, pages)  # [kvh, R, KT, d]
        vt = _gather_tile(v_pool, pages)
        s = jnp.einsum("hrgd,hrkd->hrgk", q, kt, preferred_element_type=jnp.float32)
        k_pos = (j * kv_tile + jnp.arange(kv_tile, dtype=jnp.int32))[None, :]
        ok = k_pos <= q_pos  # [R, KT]
        s = jnp.where(ok[None, :, None, :], s, NEG_INF)
        return _online_softmax_step(carry, s, vt)

    init = (
        jnp.full((kvh, num_rows, group), NEG_INF, jnp.float32),
        jnp.zeros((kvh, num_rows, group), jnp.float32),
        jnp.zeros((kvh, num_rows, group, d), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(0, last_tile, tile_body, init)
    out = _finish(m, l_sum, acc, q.dtype).transpose(1, 0, 2, 3)  # [R, kvh, G, d]
    out = jnp.where(row_valid[:, None, None, None], out, 0)
    return out.reshape(num_rows, num_heads, d)


def extend_attention(q, k_pool, v_pool, page_table, block_rows, block_seq, block_q_start,
                     seq_lens, item_block, item_tile, num_items, *, kv_tile: int, scale: float,
                     sliding_window: int | None = None, logit_cap: float | None = None
                     ) -> jax.Array:
    """The reference's EXTEND signature; each packed token attends as its own row. The query
    blocks only say which sequence and position each token has (padding rows point at T)."""
    del seq_lens, item_block, item_tile, num_items
    if sliding_window is not None or logit_cap is not None:
        raise NotImplementedError("ref-invariant: no sliding window or logit cap")
    num_tokens = q.shape[0]
    block_q = block_rows.shape[1]
    rows = jnp.asarray(block_rows).reshape(-1)  # [NB * BQ], T = padding
    seq = jnp.repeat(jnp.asarray(block_seq), block_q)
    pos = (jnp.asarray(block_q_start)[:, None] + jnp.arange(block_q, dtype=jnp.int32)).reshape(-1)
    tok_seq = jnp.zeros(num_tokens + 1, jnp.int32).at[rows].set(seq)[:num_tokens]
    tok_pos = jnp.zeros(num_tokens + 1, jnp.int32).at[rows].set(pos)[:num_tokens]
    valid = jnp.zeros(num_tokens + 1, bool).at[rows].set(True)[:num_tokens]
    row_pages = jnp.asarray(page_table)[tok_seq]  # [T, P]
    return _rows_attention(q, k_pool, v_pool, row_pages, tok_pos, valid, kv_tile=kv_tile,
                           scale=scale)


def decode_attention(q, k_pool, v_pool, page_table, seq_lens, *, kv_tile: int, scale: float,
                     sliding_window: int | None = None, logit_cap: float | None = None
                     ) -> jax.Array:
    """The reference's DECODE signature: row b is sequence b at position seq_lens[b] - 1."""
    if sliding_window is not None or logit_cap is not None:
        raise NotImplementedError("ref-invariant: no sliding window or logit cap")
    seq_lens = jnp.asarray(seq_lens)
    return _rows_attention(q, k_pool, v_pool, jnp.asarray(page_table), seq_lens - 1,
                           seq_lens > 0, kv_tile=kv_tile, scale=scale)
