"""The JAX runner's conversion of a scheduled step (host, numpy) to its `ForwardBatch`.

    Scheduler ──list[SeqStep]──► step.build_host_batch ──HostBatch──► to_forward_batch
        (the host arrays, shared with the torch runner)     ──ForwardBatch (numpy)──► jitted step
        to_forward_batch converts them to int32 and adds what the JAX attention kernels read
        (query blocks, work items)

`SeqStep` says, for one sequence, which new tokens run this step, how many of its tokens are
already in the KV pool (`prefix_len`, from the radix cache or earlier steps) and which pages
hold its positions. Everything is padded to static bucket sizes so the jitted step compiles
once per bucket:

    T  tokens in the step   (EXTEND: a token bucket;  DECODE: the sequence bucket)
    S  sequences            (EXTEND: max_extend_seqs; DECODE: the sequence bucket)
    P  page-table width     (max_pages_per_seq; or, for attention backends whose cost grows
                             with it, a width bucket holding the step's longest sequence)
    NB query blocks         (EXTEND only: T // block_q + S, an upper bound)
    W  attention work items (EXTEND only: (block, KV tile) pairs; the loop stops at the last)

Padding tokens write their K/V into reserved page 0 and padding sequences have seq_len 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from sgl_tpu.backends.jax.sampler import SamplingArrays
from sgl_tpu.config import pow2_buckets
from sgl_tpu.executor.step import (
    ForwardMode,
    HostBatch,
    SeqStep,
    build_host_batch,
    pick_bucket,
)
from sgl_tpu.kernels.paged_attention_ref import extend_work_items


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardBatch:
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    out_slots: jax.Array  # i32[T] KV slot each token's K/V is written to
    page_table: jax.Array  # i32[S, P]
    seq_lens: jax.Array  # i32[S] KV length after this step; 0 = padding sequence
    sample_idx: jax.Array  # i32[S] token row whose logits are sampled for each sequence
    block_rows: jax.Array  # i32[NB, block_q] (EXTEND) packed token per aligned row; T = pad
    block_seq: jax.Array  # i32[NB]
    block_q_start: jax.Array  # i32[NB]
    item_block: jax.Array  # i32[W] (EXTEND) attention work items: block of each
    item_tile: jax.Array  # i32[W] KV tile of each work item
    num_items: jax.Array  # i32[] work items in use
    counts_rows: jax.Array  # i32[S] row of the penalty-count buffer of each sequence
    counts_reset: jax.Array  # bool[S] clear that row first (a request's first step)
    sample_valid: jax.Array  # bool[S] the sampled token is a real output (count it)
    sampling: SamplingArrays
    vocab_bitmask: jax.Array  # i32[S, ceil(V/32)] allowed tokens; -1 = all


@dataclass(frozen=True)
class BatchShape:
    """Static sizes of one compiled step."""

    mode: ForwardMode
    num_tokens: int  # T
    num_seqs: int  # S
    max_pages: int  # P
    block_q: int
    vocab_words: int
    pages_per_tile: int  # kv_tile // page_size

    @property
    def num_blocks(self) -> int:
        if self.mode == ForwardMode.DECODE:
            return 1
        return self.num_tokens // self.block_q + self.num_seqs

    @property
    def max_items(self) -> int:
        """Attention work items (EXTEND): at most every block times every KV tile."""
        if self.mode == ForwardMode.DECODE:
            return 1
        return self.num_blocks * (self.max_pages // self.pages_per_tile)

    def host_batch(self, steps: Sequence[SeqStep], page_size: int) -> HostBatch:
        """The step's host arrays at these sizes (T token rows, S sequence rows, P pages)."""
        return build_host_batch(self.mode, steps, num_tokens=self.num_tokens,
                                num_seqs=self.num_seqs, page_size=page_size,
                                max_pages=self.max_pages, num_mask_words=self.vocab_words)


def build_forward_batch(steps: Sequence[SeqStep], shape: BatchShape, page_size: int
                        ) -> ForwardBatch:
    """`steps` as the numpy ForwardBatch of `shape`'s static sizes: the step's HostBatch,
    converted (see the module docstring)."""
    return to_forward_batch(shape.host_batch(steps, page_size), shape, page_size)


def to_forward_batch(host: HostBatch, shape: BatchShape, page_size: int) -> ForwardBatch:
    """A HostBatch of `shape`'s sizes -> ForwardBatch (numpy): its arrays as int32, plus the
    query blocks and work items the JAX attention reads (EXTEND)."""
    T, S, BQ = shape.num_tokens, shape.num_seqs, shape.block_q
    seq_lens = host.seq_lens.astype(np.int32)
    nb = shape.num_blocks
    block_rows = np.full((nb, BQ), T, np.int32)
    block_seq = np.zeros(nb, np.int32)
    block_q_start = np.zeros(nb, np.int32)
    if shape.mode == ForwardMode.EXTEND:  # query blocks of block_q rows, per sequence
        b = 0
        for i in range(host.num_seqs):
            t, n = int(host.starts[i]), int(host.extend_lens[i])
            for q0 in range(0, n, BQ):
                rows = min(BQ, n - q0)
                block_rows[b, :rows] = np.arange(t + q0, t + q0 + rows, dtype=np.int32)
                block_seq[b] = i
                block_q_start[b] = host.prefix_lens[i] + q0
                b += 1
        item_block, item_tile, num_items = extend_work_items(
            block_seq[:b], block_q_start[:b], seq_lens, BQ, shape.pages_per_tile * page_size,
            shape.max_items)
    else:
        item_block = item_tile = np.zeros(1, np.int32)
        num_items = 0
    cols = host.sampling
    bitmask = cols.bitmask if cols.bitmask is not None else np.full(
        (S, shape.vocab_words), -1, np.int32)
    return ForwardBatch(
        input_ids=host.input_ids.astype(np.int32),
        positions=host.positions.astype(np.int32),
        out_slots=host.out_slots.astype(np.int32),
        page_table=host.page_table,
        seq_lens=seq_lens,
        sample_idx=host.sample_rows.astype(np.int32),
        block_rows=block_rows,
        block_seq=block_seq,
        block_q_start=block_q_start,
        item_block=item_block,
        item_tile=item_tile,
        num_items=np.int32(num_items),
        counts_rows=cols.counts_rows,
        counts_reset=cols.counts_reset,
        sample_valid=cols.sample_valid,
        sampling=SamplingArrays(
            temperature=cols.temperature, top_p=cols.top_p, top_k=cols.top_k,
            min_p=cols.min_p, frequency_penalty=cols.frequency_penalty,
            presence_penalty=cols.presence_penalty,
            repetition_penalty=cols.repetition_penalty, seed=cols.seed, step=cols.step,
            return_logprob=cols.return_logprob),
        vocab_bitmask=bitmask,
    )


def page_buckets(max_pages: int, pages_per_tile: int) -> tuple[int, ...]:
    """Page-table widths of a bucketing attention backend: 1, 2, 4, ... KV tiles, up to
    `max_pages` (a whole number of tiles)."""
    return tuple(b * pages_per_tile for b in pow2_buckets(1, max_pages // pages_per_tile))


@dataclass(frozen=True)
class ShapeBuckets:
    """The static sizes a runner pads its steps to: `shape_for` picks one step's shape,
    `warmup_shapes` lists every shape it can pick (what warm-up compiles)."""

    token_buckets: tuple[int, ...]  # EXTEND: tokens per step (T)
    seq_buckets: tuple[int, ...]  # DECODE: sequences per step (S = T)
    max_extend_seqs: int  # EXTEND: S
    max_pages: int  # P, the full page-table width
    block_q: int
    vocab_words: int  # 32-token words of the grammar bitmask
    pages_per_tile: int  # pages per KV tile
    # Ascending widths (see `page_buckets`) the page table is cut to: the smallest holding
    # every sequence's pages. None: always `max_pages`.
    page_widths: tuple[int, ...] | None = None

    def shape_for(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> BatchShape:
        """The step's static sizes."""
        max_pages = self.max_pages
        if self.page_widths is not None:
            longest = max((len(st.pages) for st in steps), default=1)
            max_pages = min(max_pages, pick_bucket(self.page_widths, longest,
                                                   "pages per sequence"))
        if mode == ForwardMode.DECODE:
            s = pick_bucket(self.seq_buckets, len(steps), "decode batch size")
            return BatchShape(mode, s, s, max_pages, 1, self.vocab_words, self.pages_per_tile)
        n_tokens = sum(len(st.token_ids) for st in steps)
        t = pick_bucket(self.token_buckets, n_tokens, "extend batch tokens")
        return BatchShape(mode, t, self.max_extend_seqs, max_pages, self.block_q,
                          self.vocab_words, self.pages_per_tile)

    def warmup_shapes(self) -> list[BatchShape]:
        """Every shape `shape_for` can return."""
        widths = ([self.max_pages] if self.page_widths is None
                  else [min(w, self.max_pages) for w in self.page_widths])
        shapes = []
        for width in dict.fromkeys(widths):
            shapes += [BatchShape(ForwardMode.EXTEND, t, self.max_extend_seqs, width,
                                  self.block_q, self.vocab_words, self.pages_per_tile)
                       for t in self.token_buckets]
            shapes += [BatchShape(ForwardMode.DECODE, s, s, width, 1, self.vocab_words,
                                  self.pages_per_tile) for s in self.seq_buckets]
        return shapes
