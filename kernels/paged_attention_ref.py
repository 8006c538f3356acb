"""Reference paged attention in pure `jax.numpy` (runs on CPU, GPU and TPU; the kernel test oracle).

Two entry points share one tiled, online-softmax inner loop over KV tiles read through a page
table, so no `[T, T]` score matrix is ever materialised and work stops at each block's causal
horizon (a 2,048-token prompt costs about as much per token as a 512-token one):

* `extend_attention` -- queries of several sequences packed on one token axis, walked in query
  blocks of `block_q` rows that each belong to one sequence (`block_rows` maps aligned rows to
  packed tokens; only indices are aligned, the data stays packed):

      packed tokens   [a a a a a b b c c c c c c c]                     (T tokens)
      aligned rows    [a a a a a . . . | b b . . . . . . | c c c c c c c .]  (NB x block_q)
                       block 0 (seq a)   block 1 (seq b)   block 2 (seq c)

  Each block knows its sequence row in the page table and the position of its first row; the
  sequence's KV length bounds its keys. Padding rows point at an extra row T that is dropped.

* `decode_attention` -- one query per sequence; all sequences walk their KV tiles together.

KV layout per layer: `[num_pages, page_size, num_kv_heads, head_dim]`; a KV tile of `kv_tile`
tokens is `kv_tile // page_size` whole pages gathered by page id. The new tokens' K/V must have
been written into the pool before calling (see `write_kv`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30


def write_kv(
    k_pool: jax.Array,  # [num_pages, page_size, kvh, d]
    v_pool: jax.Array,  # [num_pages, page_size, kvh, d]
    k: jax.Array,  # [T, kvh, d]
    v: jax.Array,  # [T, kvh, d]
    slots: jax.Array,  # i32[T]; padding tokens point into reserved page 0
) -> tuple[jax.Array, jax.Array]:
    """Scatter the step's new K/V into their slots; in place when the pools are donated."""
    num_pages, page_size, kvh, d = k_pool.shape
    flat_k = k_pool.reshape(num_pages * page_size, kvh, d).at[slots].set(k.astype(k_pool.dtype))
    flat_v = v_pool.reshape(num_pages * page_size, kvh, d).at[slots].set(v.astype(v_pool.dtype))
    return flat_k.reshape(k_pool.shape), flat_v.reshape(v_pool.shape)


def _gather_tile(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """pages [..., pages_per_tile] -> [..., pages_per_tile * page_size, kvh, d]."""
    tile = pool[pages]  # [..., ppt, page_size, kvh, d]
    return tile.reshape(*pages.shape[:-1], -1, *pool.shape[2:])


def _tile_scores(
    q: jax.Array,  # [R, kvh, G, d] (already scaled)
    k: jax.Array,  # [R or 1..., KT, kvh, d] broadcastable per caller
    logit_cap: float | None,
    batched: bool,
) -> jax.Array:
    if batched:  # one KV tile per query row (decode: row = sequence)
        s = jnp.einsum("bhgd,bkhd->bhgk", q, k, preferred_element_type=jnp.float32)
    else:  # one KV tile shared by all rows of the block
        s = jnp.einsum("rhgd,khd->rhgk", q, k, preferred_element_type=jnp.float32)
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)
    return s  # [R, kvh, G, KT]


def _online_softmax_step(carry, s, v, batched: bool):
    m, l_sum, acc = carry  # [R, kvh, G], [R, kvh, G], [R, kvh, G, d]
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])  # [R, kvh, G, KT]
    l_new = l_sum * alpha + p.sum(axis=-1)
    pv_eq = "bhgk,bkhd->bhgd" if batched else "rhgk,khd->rhgd"
    pv = jnp.einsum(pv_eq, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l_new, acc * alpha[..., None] + pv


def _finish(m, l_sum, acc, out_dtype) -> jax.Array:
    del m
    safe = jnp.where(l_sum > 0, l_sum, 1.0)
    return (acc / safe[..., None]).astype(out_dtype)


def _mask(q_pos, k_pos, kv_len, sliding_window: int | None):
    """q_pos [R, 1], k_pos [1, KT] or [R, KT], kv_len [R, 1] -> bool [R, KT]."""
    ok = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window is not None:
        ok &= k_pos > q_pos - sliding_window
    return ok


def extend_attention(
    q: jax.Array,  # [T, H, d] packed query tokens
    k_pool: jax.Array,  # [num_pages, page_size, kvh, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[S, max_pages]
    block_rows: jax.Array,  # i32[NB, block_q] packed token of each aligned row; T = padding
    block_seq: jax.Array,  # i32[NB] page-table row of each block
    block_q_start: jax.Array,  # i32[NB] position of each block's first row
    seq_lens: jax.Array,  # i32[S] KV length of each sequence (after this step's tokens)
    num_blocks: jax.Array,  # i32[] blocks in use (the rest are skipped)
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Causal attention for sequence-aligned query blocks; returns [T, H, d].

    Each block gathers its rows from the packed queries and scatters its output back, so the
    aligned layout exists only as indices; padding rows read and write the extra row T.
    """
    page_table, block_rows, block_seq, block_q_start, seq_lens = map(
        jnp.asarray, (page_table, block_rows, block_seq, block_q_start, seq_lens))
    num_tokens, num_heads, d = q.shape
    block_q = block_rows.shape[1]
    page_size, kvh = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // kvh
    pages_per_tile = kv_tile // page_size
    q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(num_tokens, kvh, group, d)
    q = jnp.concatenate([q, jnp.zeros((1, kvh, group, d), q.dtype)])  # row T = padding
    out = jnp.zeros((num_tokens + 1, kvh, group, d), q.dtype)

    def block_body(i, out):
        seq = block_seq[i]
        q_start = block_q_start[i]
        kv_len = seq_lens[seq]
        rows = block_rows[i]  # [BQ]
        qb = q[rows]  # [BQ, kvh, G, d]
        q_pos = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]  # [BQ, 1]
        horizon = jnp.minimum(q_start + block_q, kv_len)
        first_tile = 0
        if sliding_window is not None:
            first_tile = jnp.maximum(q_start - sliding_window + 1, 0) // kv_tile
        last_tile = (horizon + kv_tile - 1) // kv_tile
        page_row = page_table[seq]

        def tile_body(j, carry):
            pages = lax.dynamic_slice_in_dim(page_row, j * pages_per_tile, pages_per_tile)
            kt = _gather_tile(k_pool, pages)  # [KT, kvh, d]
            vt = _gather_tile(v_pool, pages)
            s = _tile_scores(qb, kt, logit_cap, batched=False)  # [BQ, kvh, G, KT]
            k_pos = (j * kv_tile + jnp.arange(kv_tile, dtype=jnp.int32))[None, :]
            ok = _mask(q_pos, k_pos, kv_len, sliding_window)  # [BQ, KT]
            s = jnp.where(ok[:, None, None, :], s, NEG_INF)
            return _online_softmax_step(carry, s, vt, batched=False)

        init = (
            jnp.full((block_q, kvh, group), NEG_INF, jnp.float32),
            jnp.zeros((block_q, kvh, group), jnp.float32),
            jnp.zeros((block_q, kvh, group, d), jnp.float32),
        )
        m, l_sum, acc = lax.fori_loop(first_tile, last_tile, tile_body, init)
        return out.at[rows].set(_finish(m, l_sum, acc, q.dtype))

    out = lax.fori_loop(0, num_blocks, block_body, out)
    return out[:num_tokens].reshape(num_tokens, num_heads, d)


def decode_attention(
    q: jax.Array,  # [B, H, d] one query per sequence, at position seq_lens - 1
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[B, max_pages]
    seq_lens: jax.Array,  # i32[B]; 0 for padding rows
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Attention of each sequence's newest token over its whole paged KV; returns [B, H, d]."""
    page_table, seq_lens = jnp.asarray(page_table), jnp.asarray(seq_lens)
    batch, num_heads, d = q.shape
    page_size, kvh = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // kvh
    pages_per_tile = kv_tile // page_size
    q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(batch, kvh, group, d)
    q_pos = (seq_lens - 1)[:, None]  # [B, 1]
    kv_len = seq_lens[:, None]
    last_tile = (jnp.max(seq_lens) + kv_tile - 1) // kv_tile
    first_tile = 0
    if sliding_window is not None:
        first_tile = jnp.maximum(jnp.min(jnp.where(seq_lens > 0, seq_lens, 1 << 30))
                                 - sliding_window, 0) // kv_tile

    def tile_body(j, carry):
        pages = lax.dynamic_slice_in_dim(page_table, j * pages_per_tile, pages_per_tile, axis=1)
        kt = _gather_tile(k_pool, pages)  # [B, KT, kvh, d]
        vt = _gather_tile(v_pool, pages)
        s = _tile_scores(q, kt, logit_cap, batched=True)  # [B, kvh, G, KT]
        k_pos = (j * kv_tile + jnp.arange(kv_tile, dtype=jnp.int32))[None, :]
        ok = _mask(q_pos, k_pos, kv_len, sliding_window)  # [B, KT]
        s = jnp.where(ok[:, None, None, :], s, NEG_INF)
        return _online_softmax_step(carry, s, vt, batched=True)

    init = (
        jnp.full((batch, kvh, group), NEG_INF, jnp.float32),
        jnp.zeros((batch, kvh, group), jnp.float32),
        jnp.zeros((batch, kvh, group, d), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(first_tile, last_tile, tile_body, init)
    out = jnp.where((seq_lens > 0)[:, None, None, None], _finish(m, l_sum, acc, q.dtype), 0)
    return out.reshape(batch, num_heads, d)


def dense_attention_oracle(
    q: jax.Array,  # [Lq, H, d] queries at positions kv_len - Lq .. kv_len - 1
    k: jax.Array,  # [kv_len, kvh, d]
    v: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Plain causal attention for one sequence (tests only)."""
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
