"""Device-resident batch state of the torch backend's static decode step.

    this step's SeqSteps ──host_rows──► fresh rows (numpy)          S rows of the bucket,
                                          │ diff against the mirror  P page-table columns
                                          ▼ (what the device holds)
    only the rows that differ ──copy──► ints   i64[Bmax, NI]   input id, position, seed, ...
                                        floats f32[Bmax, NF]   temperature, top-p, penalties
                                        pages  i64[Bmax, Pmax] page table
    the step reads rows [0, S), page columns [0, P)

After the step the device advances its own real rows (position + 1, output step + 1, input
id = the token just sampled) and the mirror does the same with the tokens the host received,
so the next step of an unchanged batch (each sequence one token further, no new page) copies
nothing: a new page copies one page-table row; a finished request shifts the rows after it
(re-copied); a jump-forward or a new request rewrites its row.

Row i is the i-th SeqStep; rows n .. S-1 are padding: token 0 at position 0 on the reserved
page 0, greedy, penalty row 0, not valid. Page columns past a row's last page are 0 (the step
masks them by length). `check` compares the device with a host recomputation (a debug mode the
tests enable): a mismatch raises.

Dimensions: n real sequences, S = the batch bucket, P = the page bucket, NI/NF columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sgl_tpu.executor.step import PAD_PAGE, SCRATCH_COUNTS_ROW, SeqStep

INT_COLUMNS = ("input_id", "position", "seed", "step", "counts_row", "sample_valid",
               "return_logprob", "top_k", "active")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
IN, POS, SEED, STEP, COUNTS_ROW, VALID, RET_LP, TOP_K, ACTIVE = range(len(INT_COLUMNS))
TEMP, TOP_P, MIN_P, FREQ, PRES, REP = range(len(FLOAT_COLUMNS))
# padding row: greedy (temperature 0), no truncation, no penalty
_PAD_INTS = {COUNTS_ROW: SCRATCH_COUNTS_ROW, TOP_K: -1}
_PAD_FLOATS = {TOP_P: 1.0, REP: 1.0}


def pages_needed(step: SeqStep, page_size: int) -> int:
    """Pages covering a decode step's context (its cached tokens and the new one)."""
    return -(-(step.prefix_len + 1) // page_size)


def host_rows(steps: Sequence[SeqStep], num_rows: int, num_page_cols: int, page_size: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The state rows of a decode step, fresh from its SeqSteps (one token each):
    (ints i64[S, NI], floats f32[S, NF], pages i64[S, P]), padded to S rows."""
    ints = np.zeros((num_rows, len(INT_COLUMNS)), np.int64)
    floats = np.zeros((num_rows, len(FLOAT_COLUMNS)), np.float32)
    for col, value in _PAD_INTS.items():
        ints[:, col] = value
    for col, value in _PAD_FLOATS.items():
        floats[:, col] = value
    pages = np.full((num_rows, num_page_cols), PAD_PAGE, np.int64)
    n = len(steps)
    if n == 0:
        return ints, floats, pages
    # one list -> array conversion per matrix (a per-row numpy assignment costs ~10x more)
    ints[:n] = [(st.token_ids[0], st.prefix_len, st.seed & 0xFFFFFFFF, st.num_output_tokens,
                 st.counts_row, st.sample_valid, st.return_logprob, st.sampling.top_k, 1)
                for st in steps]
    floats[:n] = [(s.temperature, s.top_p, s.min_p, s.frequency_penalty, s.presence_penalty,
                   s.repetition_penalty) for s in (st.sampling for st in steps)]
    for i, st in enumerate(steps):
        k = pages_needed(st, page_size)
        pages[i, :k] = st.pages[:k]
    return ints, floats, pages


def advance_rows(ints: np.ndarray, token_ids: np.ndarray) -> None:
    """Host twin of `DecodeState.advance`: rows [0, n) one token further, in place."""
    n = len(token_ids)
    ints[:n, POS] += 1
    ints[:n, STEP] += 1
    ints[:n, IN] = token_ids


class DecodeState:
    """Persistent device tensors of the static decode step, and the host mirror of what they
    hold (see the module docstring)."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int, device: torch.device
                 ) -> None:
        self.page_size = page_size
        self.device = device
        self.ints = torch.zeros((max_rows, len(INT_COLUMNS)), dtype=torch.int64, device=device)
        self.floats = torch.zeros((max_rows, len(FLOAT_COLUMNS)), dtype=torch.float32,
                                  device=device)
        self.pages = torch.zeros((max_rows, max_pages), dtype=torch.int64, device=device)
        self._ints = np.zeros(tuple(self.ints.shape), np.int64)  # mirrors, same contents
        self._floats = np.zeros(tuple(self.floats.shape), np.float32)
        self._pages = np.zeros(tuple(self.pages.shape), np.int64)
        self.rows_copied = 0  # rows written host -> device so far (ints + floats + pages)

    def sync(self, steps: Sequence[SeqStep], num_rows: int, num_page_cols: int) -> None:
        """Make rows [0, S) (page columns [0, P)) equal to `steps`, copying changed rows."""
        fresh = host_rows(steps, num_rows, num_page_cols, self.page_size)
        mirrors = (self._ints[:num_rows], self._floats[:num_rows],
                   self._pages[:num_rows, :num_page_cols])
        targets = (self.ints[:num_rows], self.floats[:num_rows],
                   self.pages[:num_rows, :num_page_cols])
        for new, mirror, target in zip(fresh, mirrors, targets, strict=True):
            changed = np.flatnonzero((new != mirror).any(axis=1))
            if changed.size == 0:
                continue
            if changed.size == num_rows:  # everything: one plain copy
                target.copy_(torch.from_numpy(new))
            else:
                idx = torch.from_numpy(changed).to(self.device)
                target.index_copy_(0, idx, torch.from_numpy(new[changed]).to(self.device))
            mirror[changed] = new[changed]
            self.rows_copied += changed.size

    def advance(self, token_ids: torch.Tensor) -> None:
        """After a step on the device: the active rows of [0, S) one token further
        (token_ids i64[S]; padding rows keep their values). Fixed shapes: graph-capturable."""
        ints = self.ints[: token_ids.shape[0]]
        active = ints[:, ACTIVE]
        ints[:, POS] += active
        ints[:, STEP] += active
        ints[:, IN] = torch.where(active.bool(), token_ids, ints[:, IN])

    def advance_mirror(self, token_ids: np.ndarray) -> None:
        advance_rows(self._ints, np.asarray(token_ids, np.int64))

    def check(self, steps: Sequence[SeqStep], token_ids: np.ndarray, num_rows: int,
              num_page_cols: int) -> None:
        """Debug: the device rows [0, S) after a step equal a recomputation from `steps` and
        the sampled `token_ids`, and the mirror equals the device; raises RuntimeError."""
        ints, floats, pages = host_rows(steps, num_rows, num_page_cols, self.page_size)
        advance_rows(ints, np.asarray(token_ids, np.int64))
        got = {"ints": (self.ints[:num_rows].cpu().numpy(), ints, self._ints[:num_rows]),
               "floats": (self.floats[:num_rows].cpu().numpy(), floats,
                          self._floats[:num_rows]),
               "pages": (self.pages[:num_rows, :num_page_cols].cpu().numpy(), pages,
                         self._pages[:num_rows, :num_page_cols])}
        for name, (device, expected, mirror) in got.items():
            for what, other in (("recomputed", expected), ("mirror", mirror)):
                bad = np.argwhere(device != other)
                if bad.size:
                    r, c = bad[0]
                    raise RuntimeError(
                        f"decode state {name}[{r}, {c}] on the device is {device[r, c]}, "
                        f"{what} {other[r, c]} ({len(bad)} cells differ)")


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`sampler.row_uniforms` on the device: splitmix64 of (seed << 32 | step) in int64
    arithmetic (wrapping multiplies, logical shifts by masking); seeds/steps i64[B] -> f32[B]."""

    def lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
        return (z >> shift) & ((1 << (64 - shift)) - 1)

    z = (seeds << 32) | steps
    z = z + _signed(0x9E3779B97F4A7C15)
    z = (z ^ lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ lsr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ lsr(z, 31)
    return (lsr(z, 40).double() / float(1 << 24)).float()


def _signed(u64: int) -> int:
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64
