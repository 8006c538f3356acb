"""Paged attention over a gathered dense view (`--attention-backend gathered`; `auto` on GPUs).

The reference (kernels/paged_attention_ref.py) walks KV tiles in a loop, which on a GPU becomes
a long chain of small kernels per layer. Here each query block instead gathers its sequence's
whole page-table row into one padded dense K/V view and attends in a few large ops:

    page_table [N, P] ──gather──► K, V [kvh, N, L, d]        L = P * page_size (the view)
    queries    [N, M, H, d]  (decode: M = 1 per sequence; extend: M = block_q rows per block)
    mask       [N, M, L]     key <= query position, key < kv_len, inside the sliding window
    scores  -> soft-cap -> mask -> softmax -> PV   ──► [N, M, H, d]

The work is proportional to the page-table width P, not to the tokens in use, so the runner
passes page tables cut to a width bucket (`AttentionBackend.bucket_page_table`: the smallest
power-of-two number of KV tiles that holds the longest sequence of the step). Without a
soft-cap the scores go through `jax.nn.dot_product_attention` (its implementation left to
XLA, which may pick a fused kernel); a soft-cap, which that API lacks, takes plain einsums.

Same signatures and results as the reference (the tests check it on ragged, paged,
shared-prefix batches): `extend_work_items` and the work-item arguments are accepted and
unused, and padding decode rows (seq_len 0) return zeros. KV layout and `write_kv` are the
reference's: `[num_kv_heads, num_pages, page_size, head_dim]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_tpu.kernels.paged_attention_ref import NEG_INF, _gather_tile, _mask, _softcap, write_kv

__all__ = ["decode_attention", "extend_attention", "write_kv"]


def _attend(
    q: jax.Array,  # [N, M, H, d] already scaled
    k: jax.Array,  # [kvh, N, L, d]
    v: jax.Array,  # [kvh, N, L, d]
    ok: jax.Array,  # bool[N, M, L]
    logit_cap: float | None,
) -> jax.Array:
    """Masked softmax attention of each row's queries over its own dense K/V; [N, M, H, d]."""
    n, m, num_heads, d = q.shape
    kvh = k.shape[0]
    group = num_heads // kvh
    if logit_cap is None:
        out = jax.nn.dot_product_attention(
            q, k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3),  # K/V [N, L, kvh, d]
            mask=ok[:, None], scale=1.0)
        return out.astype(q.dtype)
    # Head-major grouped einsums, the reference's order: scores in float32, p cast to V's
    # dtype before the PV product, normalised after it.
    qh = q.reshape(n, m, kvh, group, d).transpose(2, 0, 1, 3, 4).reshape(kvh, n, m * group, d)
    s = jnp.einsum("hnqd,hnkd->hnqk", qh, k, preferred_element_type=jnp.float32)
    s = _softcap(s, logit_cap).reshape(kvh, n, m, group, -1)
    s = jnp.where(ok[None, :, :, None, :], s, NEG_INF).reshape(kvh, n, m * group, -1)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    pv = jnp.einsum("hnqk,hnkd->hnqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = pv / p.sum(axis=-1, keepdims=True)  # the row max contributes 1: never zero
    return o.reshape(kvh, n, m, group, d).transpose(1, 2, 0, 3, 4).reshape(
        n, m, num_heads, d).astype(q.dtype)


def _scaled(q: jax.Array, scale: float) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def decode_attention(
    q: jax.Array,  # [B, H, d] one query per sequence, at position seq_lens - 1
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[B, P]
    seq_lens: jax.Array,  # i32[B]; 0 for padding rows
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Attention of each sequence's newest token over its whole paged KV; returns [B, H, d]."""
    del kv_tile  # the view is the whole page-table row
    page_table, seq_lens = jnp.asarray(page_table), jnp.asarray(seq_lens)
    k = _gather_tile(k_pool, page_table)  # [kvh, B, L, d]
    v = _gather_tile(v_pool, page_table)
    k_pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]  # [1, L]
    ok = _mask((seq_lens - 1)[:, None], k_pos, seq_lens[:, None], sliding_window)  # [B, L]
    out = _attend(_scaled(q, scale)[:, None], k, v, ok[:, None], logit_cap)[:, 0]
    return jnp.where((seq_lens > 0)[:, None, None], out, 0)


def extend_attention(
    q: jax.Array,  # [T, H, d] packed query tokens
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[S, P]
    block_rows: jax.Array,  # i32[NB, block_q] packed token of each aligned row; T = padding
    block_seq: jax.Array,  # i32[NB] page-table row of each block
    block_q_start: jax.Array,  # i32[NB] position of each block's first row
    seq_lens: jax.Array,  # i32[S] KV length of each sequence (after this step's tokens)
    item_block: jax.Array,  # unused (the reference's work items)
    item_tile: jax.Array,  # unused
    num_items: jax.Array,  # unused
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> jax.Array:
    """Causal attention of sequence-aligned query blocks (see the reference's layout diagram),
    each over its sequence's dense K/V view; returns [T, H, d]."""
    del item_block, item_tile, num_items, kv_tile
    page_table, block_rows, block_seq, block_q_start, seq_lens = map(
        jnp.asarray, (page_table, block_rows, block_seq, block_q_start, seq_lens))
    num_tokens, num_heads, d = q.shape
    block_q = block_rows.shape[1]
    q = jnp.concatenate([_scaled(q, scale), jnp.zeros((1, num_heads, d), q.dtype)])  # row T pad
    pages = page_table[block_seq]  # [NB, P]
    k = _gather_tile(k_pool, pages)  # [kvh, NB, L, d]
    v = _gather_tile(v_pool, pages)
    q_pos = block_q_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)  # [NB, BQ]
    k_pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, None, :]  # [1, 1, L]
    kv_len = seq_lens[block_seq][:, None, None]  # [NB, 1, 1]
    ok = _mask(q_pos[:, :, None], k_pos, kv_len, sliding_window)  # [NB, BQ, L]
    ob = _attend(q[block_rows], k, v, ok, logit_cap)  # [NB, BQ, H, d]
    out = jnp.zeros_like(q).at[block_rows].set(ob)  # padding rows all land on row T
    return out[:num_tokens]
