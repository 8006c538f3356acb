"""The tiled paged-attention reference equals plain dense causal attention, per sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import dense_attention_oracle

from sgl_tpu.kernels import paged_attention_ref as attn


def _make_case(rng, seqs, *, page_size, kvh, group, d, num_pages=160):
    """seqs: list of (prefix_len, new_len). Returns pools, per-seq pages, packed q, dense k/v."""
    pages_free = list(rng.permutation(np.arange(1, num_pages)))
    k_pool = np.zeros((num_pages, page_size, kvh, d), np.float32)
    v_pool = np.zeros_like(k_pool)
    per_seq = []
    for prefix, new in seqs:
        total = prefix + new
        n_pages = -(-total // page_size)
        pages = np.array([pages_free.pop() for _ in range(n_pages)], np.int32)
        k = rng.standard_normal((total, kvh, d)).astype(np.float32)
        v = rng.standard_normal((total, kvh, d)).astype(np.float32)
        pos = np.arange(total)
        k_pool[pages[pos // page_size], pos % page_size] = k
        v_pool[pages[pos // page_size], pos % page_size] = v
        q = rng.standard_normal((new, kvh * group, d)).astype(np.float32)
        per_seq.append((prefix, new, pages, q, k, v))
    # pool layout is head-major: [kvh, num_pages, page_size, d]
    return k_pool.transpose(2, 0, 1, 3), v_pool.transpose(2, 0, 1, 3), per_seq


@pytest.mark.parametrize("page_size,kv_tile,block_q", [(1, 8, 4), (4, 8, 8), (16, 32, 16)])
@pytest.mark.parametrize("sliding_window,logit_cap", [(None, None), (7, None), (None, 5.0)])
def test_extend_matches_dense(page_size, kv_tile, block_q, sliding_window, logit_cap):
    rng = np.random.default_rng(0)
    kvh, group, d = 2, 3, 16
    seqs = [(0, 13), (9, 1), (21, 30), (5, 0 + 4)]
    k_pool, v_pool, per_seq = _make_case(rng, seqs, page_size=page_size, kvh=kvh, group=group,
                                         d=d)
    max_pages = 128 // page_size
    max_pages = -(-max_pages // (kv_tile // page_size)) * (kv_tile // page_size)
    S = 6
    page_table = np.zeros((S, max_pages), np.int32)
    seq_lens = np.zeros(S, np.int32)
    q_packed, rows, bseq, bstart = [], [], [], []
    t = 0
    for i, (prefix, new, pages, q, _, _) in enumerate(per_seq):
        page_table[i, : len(pages)] = pages
        seq_lens[i] = prefix + new
        q_packed.append(q)
        for q0 in range(0, new, block_q):
            r = np.full(block_q, -1, np.int32)
            n = min(block_q, new - q0)
            r[:n] = np.arange(t + q0, t + q0 + n)
            rows.append(r)
            bseq.append(i)
            bstart.append(prefix + q0)
        t += new
    T = t + 3  # some padding tokens
    q_all = np.concatenate(q_packed + [np.zeros((3, kvh * group, d), np.float32)])
    rows = np.array(rows + [np.full(block_q, -1)] * 2, np.int32)
    rows[rows < 0] = T
    nb_used = len(bseq)
    bseq = np.array(bseq + [0, 0], np.int32)
    bstart = np.array(bstart + [0, 0], np.int32)
    items, tiles, n_items = attn.extend_work_items(
        bseq[:nb_used], bstart[:nb_used], seq_lens, block_q, kv_tile, 64, sliding_window)
    out = attn.extend_attention(
        jnp.asarray(q_all), jnp.asarray(k_pool), jnp.asarray(v_pool), page_table, rows, bseq,
        bstart, seq_lens, items, tiles, jnp.int32(n_items), kv_tile=kv_tile, scale=d**-0.5,
        sliding_window=sliding_window, logit_cap=logit_cap)
    t = 0
    for _prefix, new, _, q, k, v in per_seq:
        ref = dense_attention_oracle(q, k, v, scale=d**-0.5, sliding_window=sliding_window,
                                          logit_cap=logit_cap)
        np.testing.assert_allclose(np.asarray(out[t : t + new]), np.asarray(ref), atol=2e-5)
        t += new


@pytest.mark.parametrize("page_size,kv_tile", [(1, 4), (4, 8), (16, 16)])
def test_decode_matches_dense(page_size, kv_tile):
    rng = np.random.default_rng(1)
    kvh, group, d = 3, 3, 8
    seqs = [(10, 1), (0, 1), (40, 1), (17, 1)]
    k_pool, v_pool, per_seq = _make_case(rng, seqs, page_size=page_size, kvh=kvh, group=group,
                                         d=d)
    max_pages = -(-64 // kv_tile) * (kv_tile // page_size)
    B = 6
    page_table = np.zeros((B, max_pages), np.int32)
    seq_lens = np.zeros(B, np.int32)
    qs = np.zeros((B, kvh * group, d), np.float32)
    for i, (prefix, new, pages, q, _, _) in enumerate(per_seq):
        page_table[i, : len(pages)] = pages
        seq_lens[i] = prefix + new
        qs[i] = q[0]
    out = attn.decode_attention(jnp.asarray(qs), jnp.asarray(k_pool), jnp.asarray(v_pool),
                                page_table, seq_lens, kv_tile=kv_tile, scale=d**-0.5)
    for i, (_, _, _, q, k, v) in enumerate(per_seq):
        ref = dense_attention_oracle(q, k, v, scale=d**-0.5)
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(ref[0]), atol=2e-5)
    assert not np.asarray(out[len(per_seq):]).any(), "padding rows must be zero"


@pytest.mark.parametrize("slots", [[3, 4], [5]])  # one token: the (page, offset) scatter
def test_write_kv_touches_only_given_slots(slots):
    pool = jnp.ones((1, 4, 2, 3))  # [kvh, pages, page_size, d]
    k = jnp.full((len(slots), 1, 3), 7.0)
    new_k, _ = attn.write_kv(pool, pool, k, k, jnp.array(slots))
    flat = np.asarray(new_k).reshape(8, 3)
    assert (flat[slots] == 7).all()
    assert (np.delete(flat, slots, axis=0) == 1).all()


def test_bfloat16_close_to_float32():
    rng = np.random.default_rng(2)
    kvh, group, d, ps = 1, 2, 16, 4
    k_pool, v_pool, per_seq = _make_case(rng, [(30, 1)], page_size=ps, kvh=kvh, group=group,
                                         d=d)
    _, _, pages, q, k, v = per_seq[0]
    page_table = np.zeros((1, 16), np.int32)
    page_table[0, : len(pages)] = pages
    args = (page_table, np.array([31], np.int32))
    o32 = attn.decode_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                                *args, kv_tile=8, scale=d**-0.5)
    o16 = attn.decode_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k_pool, jnp.bfloat16),
                                jnp.asarray(v_pool, jnp.bfloat16), *args, kv_tile=8,
                                scale=d**-0.5)
    assert o16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o16, np.float32), np.asarray(o32), atol=3e-2)


@pytest.mark.parametrize("backend", ["ref", "gathered"])
def test_one_token_write_keeps_donated_pools_in_place(backend):
    """A batch-1 decode step writes one token then attends: the compiled program must not copy
    the donated pools (the flat scatter's dynamic-update-slice made XLA:CPU copy each one)."""
    import re

    import jax

    from sgl_tpu.executor.attention_registry import get_attention_backend

    impl = get_attention_backend(backend)
    kvh, num_pages, ps, d = 2, 33, 4, 16

    def step(pools, k, slots, page_table, seq_lens, q):
        out, o = [], 0
        for k_pool, v_pool in pools:
            k_pool, v_pool = impl.write_kv(k_pool, v_pool, k, k, slots)
            out.append((k_pool, v_pool))
            o = o + impl.decode_attention(q, k_pool, v_pool, page_table, seq_lens, kv_tile=8,
                                          scale=0.25)
        return out, o

    pools = [(jnp.zeros((kvh, num_pages, ps, d)),) * 2 for _ in range(2)]
    args = (pools, jnp.ones((1, kvh, d)), jnp.array([9], jnp.int32),
            jnp.ones((1, 8), jnp.int32), jnp.array([10], jnp.int32), jnp.ones((1, 2 * kvh, d)))
    hlo = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    pool_copy = rf"= f32\[{kvh},({num_pages * ps}|{num_pages},{ps}),{d}\]\S* copy\("
    assert not re.findall(pool_copy, hlo)
