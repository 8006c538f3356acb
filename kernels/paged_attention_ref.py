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

KV layout per layer: `[num_kv_heads, num_pages, page_size, head_dim]` (head-major: gathered tiles
are ready for batched dots with the heads leading, which ran ~3x faster on XLA:CPU than
head-minor layouts); a KV tile of `kv_tile` tokens is `kv_tile // page_size` whole pages.
The new tokens' K/V must have been written into the pool before calling (see `write_kv`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG_INF = -1e30


def write_kv(
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    k: jax.Array,  # [T, kvh, d]
    v: jax.Array,  # [T, kvh, d]
    slots: jax.Array,  # i32[T]; padding tokens point into reserved page 0
) -> tuple[jax.Array, jax.Array]:
    """Scatter the step's new K/V into their slots; in place when the pools are donated."""
    kvh, num_pages, page_size, d = k_pool.shape
    flat = (kvh, num_pages * page_size, d)
    k_new = k.astype(k_pool.dtype).transpose(1, 0, 2)  # [kvh, T, d]
    v_new = v.astype(v_pool.dtype).transpose(1, 0, 2)
    if k.shape[0] == 1:
        # One token (a batch-1 decode): XLA turns the scatter into a dynamic-update-slice, and
        # on the flattened view of a donated pool XLA:CPU then copied the whole pool (up to four
        # times per layer when attention read it whole). Indexing (page, offset) keeps it in
        # place; for more tokens the flat scatter is faster.
        pages, offsets = slots // page_size, slots % page_size
        return (k_pool.at[:, pages, offsets].set(k_new, mode="promise_in_bounds"),
                v_pool.at[:, pages, offsets].set(v_new, mode="promise_in_bounds"))
    flat_k = k_pool.reshape(flat).at[:, slots].set(k_new)
    flat_v = v_pool.reshape(flat).at[:, slots].set(v_new)
    return flat_k.reshape(k_pool.shape), flat_v.reshape(v_pool.shape)


def _gather_tile(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """pool [kvh, P, ps, d], pages [..., n] -> head-major tile [kvh, ..., n * ps, d]."""
    # Page ids come from the page table and are valid by construction: skipping the bounds
    # handling made XLA:CPU's gather ~30% faster.
    tile = jnp.take(pool, pages, axis=1, mode="clip")  # [kvh, ..., n, ps, d]
    return tile.reshape(pool.shape[0], *pages.shape[:-1], -1, pool.shape[-1])


def _online_softmax_step(carry, s, v):
    """One KV tile of online softmax, head-major.

    carry: m, l [..., M], acc [..., M, d]; s [..., M, KT] masked scores; v [..., KT, d].
    (Head-major batched dots ran ~3x faster than head-minor einsums on XLA:CPU.)
    """
    m, l_sum, acc = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l_new = l_sum * alpha + p.sum(axis=-1)
    pv = jnp.einsum("...mk,...kd->...md", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    return m_new, l_new, acc * alpha[..., None] + pv


def _finish(m, l_sum, acc, out_dtype) -> jax.Array:
    del m
    safe = jnp.where(l_sum > 0, l_sum, 1.0)
    return (acc / safe[..., None]).astype(out_dtype)


def _softcap(s: jax.Array, logit_cap: float | None) -> jax.Array:
    return s if logit_cap is None else logit_cap * jnp.tanh(s / logit_cap)


def _mask(q_pos, k_pos, kv_len, sliding_window: int | None):
    """q_pos [R, 1], k_pos [1, KT] or [R, KT], kv_len [R, 1] -> bool [R, KT]."""
    ok = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window is not None:
        ok &= k_pos > q_pos - sliding_window
    return ok


def extend_work_items(
    block_seq: np.ndarray,  # i32[nb_used]
    block_q_start: np.ndarray,  # i32[nb_used]
    seq_lens: np.ndarray,  # i32[S]
    block_q: int,
    kv_tile: int,
    max_items: int,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Host side: the (block, kv tile) pairs to visit, block by block, tiles in order.

    Returns item_block i32[max_items], item_tile i32[max_items] and the number of items used.
    Each block visits the tiles from its window start to its causal horizon only.
    """
    blocks, tiles = [], []
    for b, (seq, q0) in enumerate(zip(block_seq, block_q_start, strict=True)):
        horizon = min(int(q0) + block_q, int(seq_lens[seq]))
        first = 0 if sliding_window is None else max(int(q0) - sliding_window + 1, 0) // kv_tile
        last = -(-horizon // kv_tile)
        blocks.extend([b] * (last - first))
        tiles.extend(range(first, last))
    n = len(blocks)
    if n > max_items:
        raise ValueError(f"extend attention needs {n} work items, more than {max_items}")
    item_block = np.zeros(max_items, np.int32)
    item_tile = np.zeros(max_items, np.int32)
    item_block[:n], item_tile[:n] = blocks, tiles
    return item_block, item_tile, n


def extend_attention(
    q: jax.Array,  # [T, H, d] packed query tokens
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[S, max_pages]
    block_rows: jax.Array,  # i32[NB, block_q] packed token of each aligned row; T = padding
    block_seq: jax.Array,  # i32[NB] page-table row of each block
    block_q_start: jax.Array,  # i32[NB] position of each block's first row
    seq_lens: jax.Array,  # i32[S] KV length of each sequence (after this step's tokens)
    item_block: jax.Array,  # i32[W] block of each work item (see `extend_work_items`)
    item_tile: jax.Array,  # i32[W] KV tile of each work item
    num_items: jax.Array,  # i32[] work items in use
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Causal attention for sequence-aligned query blocks; returns [T, H, d].

    One flat loop over (block, tile) work items (nested loops made XLA copy the KV pool per
    outer iteration). The online-softmax state restarts at a block's first item and is written
    out at its last: each block gathers its rows from the packed queries and scatters its
    output back, so the aligned layout exists only as indices; padding rows use row T.
    """
    page_table, block_rows, block_seq, block_q_start, seq_lens, item_block, item_tile = map(
        jnp.asarray,
        (page_table, block_rows, block_seq, block_q_start, seq_lens, item_block, item_tile))
    num_tokens, num_heads, d = q.shape
    block_q = block_rows.shape[1]
    kvh, page_size = k_pool.shape[0], k_pool.shape[2]
    group = num_heads // kvh
    pages_per_tile = kv_tile // page_size
    q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(num_tokens, kvh, group, d)
    q = jnp.concatenate([q, jnp.zeros((1, kvh, group, d), q.dtype)])  # row T = padding
    q = q.transpose(1, 0, 2, 3)  # [kvh, T + 1, G, d]
    m_rows = block_q * group
    init = (
        jnp.full((kvh, m_rows), NEG_INF, jnp.float32),
        jnp.zeros((kvh, m_rows), jnp.float32),
        jnp.zeros((kvh, m_rows, d), jnp.float32),
    )
    last_item = num_items - 1

    def item_body(w, carry):
        out, state = carry
        b, j = item_block[w], item_tile[w]
        is_first = (w == 0) | (item_block[jnp.maximum(w - 1, 0)] != b)
        is_last = (w == last_item) | (item_block[jnp.minimum(w + 1, item_block.shape[0] - 1)]
                                      != b)
        state = jax.tree.map(lambda s, i: jnp.where(is_first, i, s), state, init)
        seq = block_seq[b]
        kv_len = seq_lens[seq]
        rows = block_rows[b]  # [BQ]
        qb = q[:, rows].reshape(kvh, m_rows, d)  # [kvh, BQ*G, d]
        q_pos = (block_q_start[b] + jnp.arange(block_q, dtype=jnp.int32))[:, None]  # [BQ, 1]
        pages = lax.dynamic_slice_in_dim(page_table[seq], j * pages_per_tile, pages_per_tile)
        kt = _gather_tile(k_pool, pages)  # [kvh, KT, d]
        vt = _gather_tile(v_pool, pages)
        s = jnp.einsum("hmd,hkd->hmk", qb, kt, preferred_element_type=jnp.float32)
        s = _softcap(s, logit_cap).reshape(kvh, block_q, group, kv_tile)
        k_pos = (j * kv_tile + jnp.arange(kv_tile, dtype=jnp.int32))[None, :]
        ok = _mask(q_pos, k_pos, kv_len, sliding_window)  # [BQ, KT]
        s = jnp.where(ok[None, :, None, :], s, NEG_INF).reshape(kvh, m_rows, kv_tile)
        state = _online_softmax_step(state, s, vt)
        ob = _finish(*state, q.dtype).reshape(kvh, block_q, group, d)
        ob = jnp.where(is_last, ob, out[:, rows])
        return out.at[:, rows].set(ob), state

    out = jnp.zeros((kvh, num_tokens + 1, group, d), q.dtype)
    out, _ = lax.fori_loop(0, num_items, item_body, (out, init))
    out = out[:, :num_tokens].transpose(1, 0, 2, 3)  # [T, kvh, G, d]
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
    kvh, page_size = k_pool.shape[0], k_pool.shape[2]
    group = num_heads // kvh
    pages_per_tile = kv_tile // page_size
    q = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(batch, kvh, group, d)
    q = q.transpose(1, 0, 2, 3)  # [kvh, B, G, d]
    q_pos = (seq_lens - 1)[:, None]  # [B, 1]
    kv_len = seq_lens[:, None]
    last_tile = (jnp.max(seq_lens) + kv_tile - 1) // kv_tile
    first_tile = 0
    if sliding_window is not None:
        first_tile = jnp.maximum(jnp.min(jnp.where(seq_lens > 0, seq_lens, 1 << 30))
                                 - sliding_window, 0) // kv_tile

    def tile_body(j, carry):
        pages = lax.dynamic_slice_in_dim(page_table, j * pages_per_tile, pages_per_tile, axis=1)
        kt = _gather_tile(k_pool, pages)  # [kvh, B, KT, d]
        vt = _gather_tile(v_pool, pages)
        s = jnp.einsum("hbgd,hbkd->hbgk", q, kt, preferred_element_type=jnp.float32)
        s = _softcap(s, logit_cap)  # [kvh, B, G, KT]
        k_pos = (j * kv_tile + jnp.arange(kv_tile, dtype=jnp.int32))[None, :]
        ok = _mask(q_pos, k_pos, kv_len, sliding_window)  # [B, KT]
        s = jnp.where(ok[None, :, None, :], s, NEG_INF)
        return _online_softmax_step(carry, s, vt)

    init = (
        jnp.full((kvh, batch, group), NEG_INF, jnp.float32),
        jnp.zeros((kvh, batch, group), jnp.float32),
        jnp.zeros((kvh, batch, group, d), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(first_tile, last_tile, tile_body, init)
    out = _finish(m, l_sum, acc, q.dtype).transpose(1, 0, 2, 3)  # [B, kvh, G, d]
    out = jnp.where((seq_lens > 0)[:, None, None, None], out, 0)
    return out.reshape(batch, num_heads, d)
