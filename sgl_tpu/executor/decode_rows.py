"""Device-resident decode batch state, the backend-neutral part (numpy only): the row layout,
the rows of a step fresh from its SeqSteps, and the host mirror of what the device holds.

    this step's SeqSteps ──host_rows──► fresh rows (numpy)          S rows of the bucket,
                                          │ RowMirror.diff            P page-table columns
                                          ▼ (against what the device holds)
    only the rows that differ ──copy──► ints   [Bmax, NI]   input id, position, seed, ...
       (each backend's own copy)        floats [Bmax, NF]   temperature, top-p, penalties
                                        pages  [Bmax, Pmax] page table
    the step reads rows [0, S), page columns [0, P)

After a step the device advances its own real rows (position + 1, output step + 1, input id =
the token just sampled) and the mirror does the same, so the next step of an unchanged batch
(each sequence one token further, no new page) copies nothing: a new page copies one page-table
row; a finished request shifts the rows after it (re-copied); a jump-forward or a new request
rewrites its row.

Overlap placeholders: a step dispatched before the previous one's tokens reached the host names
row i's input by `placeholder_id(i)`. The device holds the real token there (its advance wrote
it), so when a step is dispatched (`RowMirror.dispatched`) the mirror records an advanced row's
input as `placeholder_id(row)`, "what the last step sampled here": a following step whose row j
names placeholder_id(j) matches it and copies nothing. A row whose placeholder names another
row is copied as is, and the backend resolves it on the device from the previous step's token
ids. Once the step's tokens reach the host (`resolve`, only if no step was dispatched since)
the mirror takes the real tokens; any other step dispatched in between (an EXTEND, a packed
DECODE) turns the mirror's placeholders into STALE, which matches nothing (those rows are
copied again).

Row i is the i-th SeqStep; rows n .. S-1 are padding: token 0 at position 0 on the reserved
page 0, greedy, penalty row 0, not valid. Page columns past a row's last page are 0 (the step
masks them by length). `check_rows` compares the device with a host recomputation (a debug mode
the tests enable): a mismatch raises.

Used by backends/torch/decode_state.py and backends/jax/decode_state.py.
Dimensions: n real sequences, S = the batch bucket, P = the page bucket, NI/NF columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sgl_tpu.executor.step import PAD_PAGE, SCRATCH_COUNTS_ROW, SeqStep, placeholder_id

INT_COLUMNS = ("input_id", "position", "seed", "step", "counts_row", "sample_valid",
               "return_logprob", "top_k", "active")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
IN, POS, SEED, STEP, COUNTS_ROW, VALID, RET_LP, TOP_K, ACTIVE = range(len(INT_COLUMNS))
TEMP, TOP_P, MIN_P, FREQ, PRES, REP = range(len(FLOAT_COLUMNS))
MATRICES = ("ints", "floats", "pages")
STALE = -(2**40)  # mirror input id of a row whose placeholder's step is no longer the last
# padding row: greedy (temperature 0), no truncation, no penalty
_PAD_INTS = {COUNTS_ROW: SCRATCH_COUNTS_ROW, TOP_K: -1}
_PAD_FLOATS = {TOP_P: 1.0, REP: 1.0}

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # (ints i64[S, NI], floats f32[S, NF],
#                                                    pages i64[S, P])


def pages_needed(step: SeqStep, page_size: int) -> int:
    """Pages covering a decode step's context (its cached tokens and the new one)."""
    return -(-(step.prefix_len + 1) // page_size)


def host_rows(steps: Sequence[SeqStep], num_rows: int, num_page_cols: int, page_size: int
              ) -> Rows:
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
        if len(st.pages) < k or k > num_page_cols:
            raise ValueError(f"sequence {i}: {len(st.pages)} pages cannot hold "
                             f"{st.prefix_len + 1} tokens in {num_page_cols} page columns")
        pages[i, :k] = st.pages[:k]
    return ints, floats, pages


def advance_rows(ints: np.ndarray, token_ids: np.ndarray) -> None:
    """Host twin of the device's advance: rows [0, n) one token further, in place."""
    n = len(token_ids)
    ints[:n, POS] += 1
    ints[:n, STEP] += 1
    ints[:n, IN] = token_ids


class RowMirror:
    """The host's copy of what the device rows hold (ints i64[R, NI], floats f32[R, NF],
    pages i64[R, Pmax]); `diff` says which rows a step must copy."""

    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.ints = np.zeros((max_rows, len(INT_COLUMNS)), np.int64)
        self.floats = np.zeros((max_rows, len(FLOAT_COLUMNS)), np.float32)
        self.pages = np.zeros((max_rows, max_pages), np.int64)
        self.rows_copied = 0  # rows written host -> device so far (ints + floats + pages)
        self._serial = 0  # steps dispatched (any kind), to date `resolve`
        self._placeholder_serial: int | None = None  # the step whose placeholders it holds

    def views(self, num_rows: int, num_page_cols: int) -> Rows:
        return (self.ints[:num_rows], self.floats[:num_rows],
                self.pages[:num_rows, :num_page_cols])

    def diff(self, fresh: Rows, num_rows: int, num_page_cols: int
             ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per matrix (ints, floats, pages): (changed row indices i64[k], their fresh rows
        [k, ...]) within rows [0, S), page columns [0, P). The mirror takes the fresh rows:
        the caller must copy them to the device."""
        out = []
        for new, mirror in zip(fresh, self.views(num_rows, num_page_cols), strict=True):
            changed = np.flatnonzero((new != mirror).any(axis=1))
            rows = new[changed]
            mirror[changed] = rows
            self.rows_copied += changed.size
            out.append((changed, rows))
        return out

    def advance(self, token_ids: np.ndarray) -> None:
        advance_rows(self.ints, np.asarray(token_ids, np.int64))

    def dispatched(self, num_seqs: int | None) -> int:
        """Bookkeeping after a step is dispatched: `num_seqs` rows of the state advanced by it
        (their inputs now placeholders), or None for a step that did not use the state.
        Returns the step's serial."""
        self._serial += 1
        ids = self.ints[:, IN]
        ids[ids < 0] = STALE  # the placeholders named the step before this one
        if num_seqs is None:
            self._placeholder_serial = None
            return self._serial
        self.advance(np.array([placeholder_id(i) for i in range(num_seqs)], np.int64))
        self._placeholder_serial = self._serial
        return self._serial

    def resolve(self, serial: int, token_ids: np.ndarray) -> None:
        """Step `serial`'s tokens reached the host: if no step was dispatched since, the mirror
        takes them in place of its placeholders."""
        if serial != self._placeholder_serial or serial != self._serial:
            return
        n = len(token_ids)
        ids = self.ints[:n, IN]
        named = ids == -np.arange(1, n + 1)
        ids[named] = np.asarray(token_ids, np.int64)[named]
        self._placeholder_serial = None

    def resolved_views(self, num_rows: int, num_page_cols: int, token_ids: np.ndarray) -> Rows:
        """Copies of `views` with the placeholders of rows [0, n) read as the tokens they name
        (token_ids [n]: the last step's), for `check_rows`."""
        ints, floats, pages = (a.copy() for a in self.views(num_rows, num_page_cols))
        n = len(token_ids)
        named = ints[:n, IN] == -np.arange(1, n + 1)
        ints[:n, IN][named] = np.asarray(token_ids, np.int64)[named]
        return ints, floats, pages


def check_rows(device: Rows, expected: Rows, mirror: Rows) -> None:
    """Debug: the device's rows after a step equal a host recomputation (`expected`) and the
    mirror; raises RuntimeError naming the first differing cell."""
    for name, got, want, mine in zip(MATRICES, device, expected, mirror, strict=True):
        for what, other in (("recomputed", want), ("mirror", mine)):
            bad = np.argwhere(got != other)
            if bad.size:
                r, c = bad[0]
                raise RuntimeError(
                    f"decode state {name}[{r}, {c}] on the device is {got[r, c]}, "
                    f"{what} {other[r, c]} ({len(bad)} cells differ)")
