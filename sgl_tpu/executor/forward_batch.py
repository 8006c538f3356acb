"""The one conversion from a scheduled batch (host, Python/numpy) to device-side `ForwardBatch`.

    Scheduler ──list[SeqStep]──► build_forward_batch ──ForwardBatch (numpy)──► ModelRunner (jit)

`SeqStep` says, for one sequence, which new tokens run this step, how many of its tokens are
already in the KV pool (`prefix_len`, from the radix cache or earlier steps) and which pages
hold its positions. Everything is padded to static bucket sizes so the jitted step compiles
once per bucket:

    T  tokens in the step   (EXTEND: a token bucket;  DECODE: the sequence bucket)
    S  sequences            (EXTEND: max_extend_seqs; DECODE: the sequence bucket)
    P  page-table width     (max_pages_per_seq, fixed)
    NB query blocks         (EXTEND only: T // block_q + S, an upper bound)
    W  attention work items (EXTEND only: (block, KV tile) pairs; the loop stops at the last)

Padding tokens write their K/V into reserved page 0 and padding sequences have seq_len 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from sgl_tpu.executor.sampler import SamplingArrays
from sgl_tpu.kernels.paged_attention_ref import extend_work_items
from sgl_tpu.scheduler.schedule_batch import ForwardMode, SeqStep


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
    use_penalties: jax.Array  # bool[] any sequence uses frequency/presence/repetition penalty
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


def pick_bucket(buckets: Sequence[int], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


def _sampling_arrays(steps: Sequence[SeqStep], num_seqs: int) -> SamplingArrays:
    def col(fn, default, dtype):
        a = np.full(num_seqs, default, dtype)
        a[: len(steps)] = [fn(s) for s in steps]
        return a

    return SamplingArrays(
        temperature=col(lambda s: s.sampling.temperature, 0.0, np.float32),
        top_p=col(lambda s: s.sampling.top_p, 1.0, np.float32),
        top_k=col(lambda s: s.sampling.top_k, -1, np.int32),
        min_p=col(lambda s: s.sampling.min_p, 0.0, np.float32),
        frequency_penalty=col(lambda s: s.sampling.frequency_penalty, 0.0, np.float32),
        presence_penalty=col(lambda s: s.sampling.presence_penalty, 0.0, np.float32),
        repetition_penalty=col(lambda s: s.sampling.repetition_penalty, 1.0, np.float32),
        seed=col(lambda s: s.seed & 0xFFFFFFFF, 0, np.uint32),
        step=col(lambda s: s.num_output_tokens, 0, np.int32),
    )


def build_forward_batch(steps: Sequence[SeqStep], shape: BatchShape, page_size: int
                        ) -> ForwardBatch:
    """Pack `steps` into numpy arrays of `shape`'s static sizes (see the module docstring)."""
    T, S, P, BQ = shape.num_tokens, shape.num_seqs, shape.max_pages, shape.block_q
    n_seq = len(steps)
    if n_seq > S:
        raise ValueError(f"{n_seq} sequences exceed the batch shape's {S}")
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    out_slots = np.zeros(T, np.int32)  # page 0 is reserved: padding writes land there
    page_table = np.zeros((S, P), np.int32)
    seq_lens = np.zeros(S, np.int32)
    sample_idx = np.zeros(S, np.int32)
    nb = shape.num_blocks
    block_rows = np.full((nb, BQ), T, np.int32)
    block_seq = np.zeros(nb, np.int32)
    block_q_start = np.zeros(nb, np.int32)
    bitmask = np.full((S, shape.vocab_words), -1, np.int32)

    t = 0
    b = 0
    for i, st in enumerate(steps):
        n = len(st.token_ids)
        end = st.prefix_len + n
        pages = np.asarray(st.pages, np.int32)
        if len(pages) * page_size < end or len(pages) > P:
            raise ValueError(f"sequence {i}: {len(pages)} pages cannot hold {end} tokens")
        if t + n > T:
            raise ValueError(f"batch needs more than {T} tokens")
        pos = np.arange(st.prefix_len, end, dtype=np.int32)
        input_ids[t : t + n] = st.token_ids
        positions[t : t + n] = pos
        out_slots[t : t + n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[i, : len(pages)] = pages
        seq_lens[i] = end
        sample_idx[i] = t + n - 1
        if shape.mode == ForwardMode.EXTEND:
            for q0 in range(0, n, BQ):
                rows = min(BQ, n - q0)
                block_rows[b, :rows] = np.arange(t + q0, t + q0 + rows, dtype=np.int32)
                block_seq[b] = i
                block_q_start[b] = st.prefix_len + q0
                b += 1
        if st.bitmask is not None:
            bitmask[i] = st.bitmask
        t += n

    def flags(fn) -> np.ndarray:
        a = np.zeros(S, np.bool_)
        a[:n_seq] = [fn(s) for s in steps]
        return a

    if shape.mode == ForwardMode.EXTEND:
        item_block, item_tile, num_items = extend_work_items(
            block_seq[:b], block_q_start[:b], seq_lens, BQ, shape.pages_per_tile * page_size,
            shape.max_items)
    else:
        item_block = item_tile = np.zeros(1, np.int32)
        num_items = 0
    counts_rows = np.zeros(S, np.int32)
    counts_rows[:n_seq] = [s.counts_row for s in steps]
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        out_slots=out_slots,
        page_table=page_table,
        seq_lens=seq_lens,
        sample_idx=sample_idx,
        block_rows=block_rows,
        block_seq=block_seq,
        block_q_start=block_q_start,
        item_block=item_block,
        item_tile=item_tile,
        num_items=np.int32(num_items),
        counts_rows=counts_rows,
        counts_reset=flags(lambda s: s.counts_reset),
        sample_valid=flags(lambda s: s.sample_valid),
        use_penalties=np.bool_(any(s.sampling.uses_penalties for s in steps)),
        sampling=_sampling_arrays(steps, S),
        vocab_bitmask=bitmask,
    )


def batch_shape_for(
    mode: ForwardMode,
    steps: Sequence[SeqStep],
    *,
    token_buckets: Sequence[int],
    seq_buckets: Sequence[int],
    max_extend_seqs: int,
    max_pages: int,
    block_q: int,
    vocab_words: int,
    pages_per_tile: int,
) -> BatchShape:
    if mode == ForwardMode.DECODE:
        s = pick_bucket(seq_buckets, len(steps), "decode batch size")
        return BatchShape(mode, s, s, max_pages, 1, vocab_words, pages_per_tile)
    n_tokens = sum(len(st.token_ids) for st in steps)
    t = pick_bucket(token_buckets, n_tokens, "extend batch tokens")
    return BatchShape(mode, t, max_extend_seqs, max_pages, block_q, vocab_words, pages_per_tile)
