"""Test-side helpers for the attention kernels: plain dense causal attention of one sequence
(the oracle), and random paged batches and pools built with the runner's real packing."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sgl_tpu.backends.jax.forward_batch import ForwardBatch, ShapeBuckets, build_forward_batch
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.kernels.paged_attention_ref import _mask
from sgl_tpu.sampling_params import SamplingParams


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


def paged_batch(rng, mode: ForwardMode, seqs: Sequence[tuple[int, int]], *, page_size: int,
                kv_tile: int, block_q: int, num_pages: int, max_pages: int = 16,
                token_buckets=(32, 64, 128), seq_buckets=(4, 8), shared_pages: int = 0,
                page_widths: Sequence[int] | None = None) -> ForwardBatch:
    """seqs: (prefix_len, new_len) per sequence -> ForwardBatch (numpy) on random pages.

    `shared_pages`: every sequence's first pages are the first sequence's (a shared radix
    prefix; each prefix must cover them). `page_widths`: cut the page table to a width bucket
    as the runner does for bucketing attention backends."""
    free = list(rng.permutation(np.arange(1, num_pages)))
    steps, first = [], []
    for prefix, new in seqs:
        n_pages = -(-(prefix + new) // page_size)
        if first:
            assert prefix >= shared_pages * page_size, "the shared pages must be in the prefix"
            pages = first[:shared_pages] + [free.pop() for _ in range(n_pages - shared_pages)]
        else:
            pages = first = [free.pop() for _ in range(n_pages)]
        steps.append(SeqStep(token_ids=[1] * new, prefix_len=prefix, pages=np.array(pages),
                             sampling=SamplingParams(temperature=0.0), seed=0,
                             num_output_tokens=0))
    buckets = ShapeBuckets(
        token_buckets=tuple(token_buckets), seq_buckets=tuple(seq_buckets),
        max_extend_seqs=seq_buckets[0], max_pages=max_pages, block_q=block_q, vocab_words=1,
        pages_per_tile=kv_tile // page_size,
        page_widths=None if page_widths is None else tuple(page_widths))
    shape = buckets.shape_for(mode, steps)
    return build_forward_batch(steps, shape, page_size)


def random_pools(rng, *, kvh, num_pages, page_size, d, dtype):
    """Random K/V everywhere, so reading a wrong page or slot changes the result."""
    shape = (kvh, num_pages, page_size, d)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))
