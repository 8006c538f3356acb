"""The step contract between the scheduler and every model runner (numpy only, no JAX or torch).

    Scheduler ──(ForwardMode, list[SeqStep])──► ModelRunner.forward ──► StepResult (numpy)
                                                   │
           host side, once per step, shared here:  │  backend side, per runner: converts
             step_rows         bucket T            │    jax:   HostBatch -> ForwardBatch
             build_host_batch  HostBatch: token    │           -> jitted step
               rows (ids, positions, KV slots),    │    torch: HostBatch -> tensors
               sequence rows (lengths, sampled     │           -> eager/compiled layers
               rows, page table, sampling_columns) │

DECODE steps over a device-resident batch state (the JAX runner's `jax_decode_state`, the torch
runner's `static_decode`) copy only changed rows instead: their host description is
executor/decode_rows.py's `host_rows`, from the same SeqSteps.

Overlap scheduling (`Scheduler`, `--disable-overlap-schedule`): a runner that also has
`dispatch(mode, steps) -> PendingStep` starts a step without waiting for it, so the host can
post-process step t while the device runs step t+1. A DECODE step dispatched before step t's
tokens reached the host names them by placeholder: `placeholder_id(i)` as a sequence's input
token means "the token step t sampled for its sequence i", and the runner resolves it on the
device from the last dispatched step's token ids (`resolve_placeholders`). Steps run in
dispatch order.

A runner pads every step to a shape bucket so compiled programs are reused: EXTEND steps to a
token bucket (`RunnerConfig.token_buckets`), DECODE steps to a sequence bucket (`seq_buckets`).
Padding tokens write their K/V into the reserved page 0; padding sequences sample greedily into
the scratch penalty-count row 0 and are dropped from the result.

Dimensions: T tokens in the step (padded), n real sequences, S padded sequences, P page-table
columns, V vocabulary, W = mask_words(V) packed-mask words.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import numpy as np

from sgl_tpu.sampling_params import SamplingParams

# Rows with a temperature below this are greedy (SGLang's _SAMPLING_EPS); both samplers use it.
GREEDY_TEMPERATURE_EPS = 1e-6
PAD_PAGE = 0  # reserved KV page: padding tokens write here, no request ever owns it
SCRATCH_COUNTS_ROW = 0  # penalty-count row of padding sequences; requests use 1..max_running
MASK_BITS_PER_WORD = 32


def placeholder_id(row: int) -> int:
    """The input token id that stands for "what the previous step sampled for sequence `row`"
    (negative: real token ids are >= 0)."""
    return -(row + 1)


def resolve_placeholders(input_ids: np.ndarray, prev_token_ids: np.ndarray) -> np.ndarray:
    """input_ids [T] with placeholders replaced from the previous step's token ids [n_prev]
    (the numpy statement of what each runner does on its device)."""
    input_ids = np.asarray(input_ids)
    if not (input_ids < 0).any():
        return input_ids
    prev_rows = np.maximum(-input_ids - 1, 0)
    return np.where(input_ids < 0, np.asarray(prev_token_ids)[prev_rows], input_ids)


def mask_words(vocab_size: int) -> int:
    """Words of one packed allowed-token mask row: token t is bit t % 32 of word t // 32."""
    return -(-vocab_size // MASK_BITS_PER_WORD)


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens (possibly after a cached prefix, possibly a chunk)
    DECODE = 2  # one new token per running sequence


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    token_ids: Sequence[int] | np.ndarray  # tokens to run now (or a placeholder_id)
    prefix_len: int  # tokens of this sequence already in the KV pool
    pages: Sequence[int] | np.ndarray  # page ids covering [0, prefix_len + len(token_ids))
    sampling: SamplingParams
    seed: int  # resolved per-request seed
    num_output_tokens: int  # index of the token sampled this step (its `step` in the RNG)
    counts_row: int = SCRATCH_COUNTS_ROW
    counts_reset: bool = False
    sample_valid: bool = True  # False for a non-final prefill chunk
    bitmask: np.ndarray | None = None  # i32[W]
    return_logprob: bool = True  # False: the runner may skip this row's log-prob work
    # a hybrid model's sliding-window pool (mem_cache/swa_pool.py): the window page of each of
    # `pages` (0: dropped, outside the sequence's window); None without that pool
    swa_pages: Sequence[int] | np.ndarray | None = None
    lora_id: int = 0  # the LoRA adapter its tokens run with (0: the base model; sgl_tpu/lora.py)


@dataclass(frozen=True)
class StepResult:
    """Host copies of one step's outputs, one row per real sequence."""

    token_ids: np.ndarray  # i32[n]
    # Log-probs are only meaningful on rows whose SeqStep.return_logprob is set; a runner
    # may leave zeros on the others.
    logprobs: np.ndarray  # f32[n]
    top_ids: np.ndarray  # i32[n, K]
    top_logprobs: np.ndarray  # f32[n, K]
    hidden: Any  # [T, D] backend-owned device array (EXTEND only): hand it back to the runner


def has_placeholders(steps: Sequence[SeqStep]) -> bool:
    """Whether any sequence's input is a placeholder (only ever a DECODE sequence's single
    input token)."""
    return any(len(st.token_ids) and int(st.token_ids[0]) < 0 for st in steps)


class PendingStep(Protocol):
    """A dispatched step; `result()` waits for it and returns its host copies."""

    def result(self) -> StepResult: ...


@dataclass(frozen=True)
class DoneStep:
    """A step that already finished (runners that cannot overlap, tests)."""

    step_result: StepResult

    def result(self) -> StepResult:
        return self.step_result


class ModelRunner(Protocol):
    """What the scheduler needs from an executor backend (see the module docstring)."""

    backend: str  # "jax" or "torch"

    @property
    def kv_bytes(self) -> int: ...

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        """Run one step (write K/V, attend, sample one token per sequence)."""

    # Optional (overlap scheduling): `dispatch(mode, steps) -> PendingStep` starts the step
    # and returns at once; its input ids may hold placeholders (see the module docstring).

    # Optional: `decode_row_limit -> int | None`, the most rows a DECODE step runs on the
    # kernels of a one-row step (speculative verify rows stay within it; absent or None: any).

    # Optional (the lower cache tiers, mem_cache/tiers.py), on single-device runners:
    # `read_kv_pages(pages, out=None) -> rows` copies whole KV pages to host memory as raw-bit
    # rows [len(pages), row elements] (into `out` when given), `write_kv_pages(pages, rows)`
    # stores such rows back (both with `window_pages=`, the pages' window pages, where a
    # sliding-window pool holds the local layers: torch), and
    # `kv_page_layout() -> str` names the rows' layout and dtype (part of a disk file's key).

    def token_logprobs(self, hidden: Any, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probs of target_ids[t] under row t of an EXTEND step's hidden states, with the
        top-K ids/log-probs of each row (rows padded to the step's bucket)."""

    def row_logits(self, hidden: Any, rows: np.ndarray) -> np.ndarray:
        """Float32 logits [len(rows), V] at the given rows of an EXTEND step's hidden states."""

    def hidden_rows(self, hidden: Any, rows: np.ndarray) -> np.ndarray:
        """Float32 hidden states [len(rows), D] (after the final norm) at the given rows of an
        EXTEND step's hidden states, on the host (embeddings: scheduler/pooling.py)."""

    def warmup(self) -> float:
        """Compile every shape bucket; returns seconds spent."""

    def num_compilations(self) -> int:
        """Compiled step variants so far (tests assert it stays fixed after warm-up)."""

    def compute_info(self) -> dict[str, Any]:
        """Device, dtype and kernels the steps run on (`/server_info`'s "compute")."""


# ---- buckets --------------------------------------------------------------------------------
def pick_bucket(buckets: Sequence[int], n: int, what: str) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


def step_rows(mode: ForwardMode, steps: Sequence[SeqStep], *, token_buckets: Sequence[int],
              seq_buckets: Sequence[int], max_extend_seqs: int) -> tuple[int, int]:
    """(bucketed rows T, exact rows) of a step: tokens for EXTEND, sequences for DECODE."""
    if mode == ForwardMode.DECODE:
        exact = len(steps)
        return pick_bucket(seq_buckets, exact, "decode batch size"), exact
    if len(steps) > max_extend_seqs:
        raise ValueError(f"{len(steps)} sequences exceed max_extend_seqs {max_extend_seqs}")
    exact = sum(len(st.token_ids) for st in steps)
    return pick_bucket(token_buckets, exact, "extend batch tokens"), exact


# ---- sampling columns -----------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingColumns:
    """Per-sequence sampling inputs, S rows (rows past the real sequences: greedy padding)."""

    temperature: np.ndarray  # f32[S]; < GREEDY_TEMPERATURE_EPS = greedy
    top_p: np.ndarray  # f32[S]; 1 = off
    top_k: np.ndarray  # i32[S]; <= 0 = off
    min_p: np.ndarray  # f32[S]; 0 = off
    frequency_penalty: np.ndarray  # f32[S]
    presence_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]; 1 = off
    seed: np.ndarray  # u32[S]
    step: np.ndarray  # i32[S] index of the output token being sampled
    counts_rows: np.ndarray  # i32[S] penalty-count row of each sequence
    counts_reset: np.ndarray  # bool[S] clear that row first (a request's first step)
    sample_valid: np.ndarray  # bool[S] the sampled token is a real output (count it)
    return_logprob: np.ndarray  # bool[S] the row's log-probs are read (padding: False)
    uses_penalties: bool  # any sequence uses a frequency/presence/repetition penalty
    bitmask: np.ndarray | None  # i32[S, W] allowed tokens (-1 = all); None: no row constrained


def sampling_columns(steps: Sequence[SeqStep], num_seqs: int, num_mask_words: int
                     ) -> SamplingColumns:
    """The columns of `steps`, padded to `num_seqs` rows; masks have `mask_words(V)` words."""

    def col(fn, default, dtype) -> np.ndarray:
        a = np.full(num_seqs, default, dtype)
        a[: len(steps)] = [fn(s) for s in steps]
        return a

    return SamplingColumns(
        temperature=col(lambda s: s.sampling.temperature, 0.0, np.float32),
        top_p=col(lambda s: s.sampling.top_p, 1.0, np.float32),
        top_k=col(lambda s: s.sampling.top_k, -1, np.int32),
        min_p=col(lambda s: s.sampling.min_p, 0.0, np.float32),
        frequency_penalty=col(lambda s: s.sampling.frequency_penalty, 0.0, np.float32),
        presence_penalty=col(lambda s: s.sampling.presence_penalty, 0.0, np.float32),
        repetition_penalty=col(lambda s: s.sampling.repetition_penalty, 1.0, np.float32),
        seed=col(lambda s: s.seed & 0xFFFFFFFF, 0, np.uint32),
        step=col(lambda s: s.num_output_tokens, 0, np.int32),
        counts_rows=col(lambda s: s.counts_row, SCRATCH_COUNTS_ROW, np.int32),
        counts_reset=col(lambda s: s.counts_reset, False, np.bool_),
        sample_valid=col(lambda s: s.sample_valid, False, np.bool_),
        return_logprob=col(lambda s: s.return_logprob, False, np.bool_),
        uses_penalties=any(s.sampling.uses_penalties for s in steps),
        bitmask=pack_bitmask(steps, num_seqs, num_mask_words),
    )


def pack_bitmask(steps: Sequence[SeqStep], num_seqs: int, num_mask_words: int
                 ) -> np.ndarray | None:
    """i32[S, W] the allowed tokens of each sequence (-1 = all: unconstrained and padding
    rows), or None when no sequence is constrained."""
    if all(s.bitmask is None for s in steps):
        return None
    bitmask = np.full((num_seqs, num_mask_words), -1, np.int32)
    for i, s in enumerate(steps):
        if s.bitmask is not None:
            bitmask[i] = s.bitmask
    return bitmask


# ---- the host batch -------------------------------------------------------------------------
@dataclass(frozen=True)
class HostBatch:
    """One step's host arrays, built once per step (`build_host_batch`); each runner only
    converts them to its device arrays (jax: backends/jax/forward_batch.py, torch:
    backends/torch/runner.py).

        token rows T:      | seq 0 new tokens | seq 1 new tokens | ... | padding          |
                           sequence i: rows [starts[i], starts[i] + extend_lens[i]), its last
                           row sampled (sample_rows[i]); padding: token 0 at position 0,
                           written to slot 0 (the reserved PAD_PAGE)
        sequence rows S:   | seq 0 | seq 1 | ... | seq n-1 | padding                     |
                           padding: every length and row 0, greedy sampling, penalty row
                           SCRATCH_COUNTS_ROW, not valid
        page columns P:    | sequence i's pages | PAD_PAGE ...                            |
    """

    mode: ForwardMode
    num_seqs: int  # n real sequences
    input_ids: np.ndarray  # i64[T] (a DECODE input may be a placeholder_id)
    positions: np.ndarray  # i64[T] position of each token in its sequence
    out_slots: np.ndarray  # i64[T] KV slot its K/V is written to (page * page_size + offset)
    starts: np.ndarray  # i64[S] first token row of each sequence
    extend_lens: np.ndarray  # i64[S] new tokens of each sequence
    prefix_lens: np.ndarray  # i64[S] tokens already in the KV pool
    seq_lens: np.ndarray  # i64[S] KV length after this step (prefix_lens + extend_lens)
    sample_rows: np.ndarray  # i64[S] token row whose logits are sampled
    page_table: np.ndarray  # i32[S, P] page ids of each sequence's positions
    sampling: SamplingColumns  # S rows

    @property
    def num_tokens(self) -> int:
        """Real token rows (the rest of T is padding)."""
        return int(self.extend_lens.sum())


def build_host_batch(mode: ForwardMode, steps: Sequence[SeqStep], *, num_tokens: int,
                     num_seqs: int, page_size: int, max_pages: int, num_mask_words: int,
                     trim_pages: bool = False) -> HostBatch:
    """`steps` laid out in T = `num_tokens` token rows and S = `num_seqs` sequence rows (see
    HostBatch), the page table `max_pages` wide (`trim_pages`: as wide as the longest
    sequence's pages, for a runner with no compiled page-table shape). Checks that every
    sequence's pages hold its tokens and number at most `max_pages`, and that the tokens fit."""
    n, T, S = len(steps), num_tokens, num_seqs
    if n > S:
        raise ValueError(f"{n} sequences exceed the batch's {S}")
    lens = np.zeros((S, 3), np.int64)
    if n:  # one list -> array conversion (per-sequence numpy assignments cost ~10x more)
        lens[:n] = [(len(st.token_ids), st.prefix_len, len(st.pages)) for st in steps]
    extend_lens, prefix_lens, num_pages = lens.T.copy()
    seq_lens = prefix_lens + extend_lens
    bad = (num_pages * page_size < seq_lens) | (num_pages > max_pages)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"sequence {i}: {num_pages[i]} pages cannot hold {seq_lens[i]} tokens")
    ends = np.cumsum(extend_lens)
    total = int(ends[-1]) if S else 0
    if total > T:
        raise ValueError(f"batch needs more than {T} tokens")
    starts = np.zeros(S, np.int64)
    starts[1:n] = ends[: n - 1]
    sample_rows = np.zeros(S, np.int64)
    sample_rows[:n] = ends[:n] - 1

    width = int(num_pages.max(initial=1)) if trim_pages else max_pages
    page_table = np.full((S, width), PAD_PAGE, np.int32)
    if n:  # (fromiter over the chained lists: the cheapest conversion of many short ones)
        page_table[:n][np.arange(width) < num_pages[:n, None]] = np.fromiter(
            chain.from_iterable(st.pages for st in steps), np.int32, int(num_pages.sum()))

    input_ids = np.zeros(T, np.int64)
    positions = np.zeros(T, np.int64)
    out_slots = np.full(T, PAD_PAGE * page_size, np.int64)
    if total:
        input_ids[:total] = np.fromiter(chain.from_iterable(st.token_ids for st in steps),
                                        np.int64, total)
        # row r of sequence i: position r - starts[i] + prefix_lens[i], on page table row i
        pos = np.repeat(prefix_lens[:n] - starts[:n], extend_lens[:n]) + np.arange(total)
        positions[:total] = pos
        table_at = np.repeat(np.arange(n) * width, extend_lens[:n]) + pos // page_size
        out_slots[:total] = (page_table.ravel()[table_at].astype(np.int64) * page_size
                             + pos % page_size)
    return HostBatch(
        mode=mode, num_seqs=n, input_ids=input_ids, positions=positions, out_slots=out_slots,
        starts=starts, extend_lens=extend_lens, prefix_lens=prefix_lens, seq_lens=seq_lens,
        sample_rows=sample_rows, page_table=page_table,
        sampling=sampling_columns(steps, S, num_mask_words))


# ---- seed to uniform ------------------------------------------------------------------------
# A sampled row draws one uniform u in [0, 1) from its (seed, step) alone, by this rule, on every
# backend (each implements it in its own arithmetic and checks it against this function), then
# walks its kept tokens in vocabulary order to the first whose running weight exceeds u times
# their total: the same seed draws the same token on both backends, whatever the batch.
#
#     z = seed << 32 | step                     (seed u32, step u32: one u64)
#     z = splitmix64(z)                         (Steele, Lea, Flood 2014; Vigna's constants)
#     u = (z >> 40) / 2^24                      (24 bits: exact in float32)
SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # increment, mults


def row_uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """u32 seeds, steps [S] -> f32[S] in [0, 1): the rule above (the reference)."""
    z = (seeds.astype(np.uint64) << np.uint64(32)) | (steps.astype(np.uint64) & np.uint64(
        0xFFFFFFFF))
    with np.errstate(over="ignore"):
        z = z + np.uint64(SPLITMIX64[0])
        z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX64[1])
        z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX64[2])
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)


# ---- warm-up --------------------------------------------------------------------------------
def warmup_step() -> SeqStep:
    """A one-token greedy sequence on the reserved page whose output is discarded: runners warm
    up each bucket with copies of it."""
    return SeqStep(token_ids=[0], prefix_len=0, pages=np.full(1, PAD_PAGE, np.int64),
                   sampling=SamplingParams(temperature=0.0, max_new_tokens=1), seed=0,
                   num_output_tokens=0, sample_valid=False)
