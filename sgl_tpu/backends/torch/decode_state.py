"""Device-resident batch state of the torch backend's static decode step: the tensors on the
device, kept equal to the shared host mirror (executor/decode_rows.py: row layout, fresh rows,
diff), and the splitmix64 uniforms computed from its seed and step columns.

    ints i64[Bmax, NI], floats f32[Bmax, NF], pages i64[Bmax, Pmax]: persistent tensors a CUDA
    graph reads in place; `sync` copies only the rows the mirror's diff names.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from sgl_tpu.executor.decode_rows import (  # noqa: F401  (the column indices: re-exported)
    ACTIVE,
    COUNTS_ROW,
    FLOAT_COLUMNS,
    FREQ,
    IN,
    INT_COLUMNS,
    MATRICES,
    MIN_P,
    POS,
    PRES,
    REP,
    RET_LP,
    SEED,
    STEP,
    TEMP,
    TOP_K,
    TOP_P,
    VALID,
    RowMirror,
    advance_rows,
    check_rows,
    host_rows,
    pages_needed,
)
from sgl_tpu.executor.step import SPLITMIX64, SeqStep


class DecodeState:
    """Persistent device tensors of the static decode step, and the host mirror of what they
    hold (executor/decode_rows.py)."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int, device: torch.device
                 ) -> None:
        self.page_size = page_size
        self.device = device
        self.ints = torch.zeros((max_rows, len(INT_COLUMNS)), dtype=torch.int64, device=device)
        self.floats = torch.zeros((max_rows, len(FLOAT_COLUMNS)), dtype=torch.float32,
                                  device=device)
        self.pages = torch.zeros((max_rows, max_pages), dtype=torch.int64, device=device)
        self.mirror = RowMirror(max_rows, max_pages)
        # (serial, token ids) of steps whose tokens reached the host, for the next sync
        self._resolved: deque[tuple[int, np.ndarray]] = deque()

    @property
    def rows_copied(self) -> int:
        """Rows written host -> device so far (ints + floats + pages)."""
        return self.mirror.rows_copied

    def sync(self, steps: Sequence[SeqStep], num_rows: int, num_page_cols: int,
             prev_token_ids: torch.Tensor | None = None) -> None:
        """Make rows [0, S) (page columns [0, P)) equal to `steps`, copying changed rows; a
        copied placeholder input is resolved on the device from prev_token_ids i64[n_prev]
        (the last step's tokens; placeholders that name their own row match the mirror and
        are not copied: the device already holds that token)."""
        while self._resolved:  # tokens that reached the host since the last sync
            self.mirror.resolve(*self._resolved.popleft())
        fresh = host_rows(steps, num_rows, num_page_cols, self.page_size)
        targets = (self.ints[:num_rows], self.floats[:num_rows],
                   self.pages[:num_rows, :num_page_cols])
        lagged = False  # a copied ints row holds a placeholder input
        for name, (changed, rows), target in zip(
                MATRICES, self.mirror.diff(fresh, num_rows, num_page_cols), targets, strict=True):
            if changed.size == 0:
                continue
            if name == "ints":
                lagged = bool((rows[:, IN] < 0).any())
            if changed.size == num_rows:  # everything: one plain copy
                target.copy_(upload(rows, self.device))
            else:
                target.index_copy_(0, upload(changed, self.device), upload(rows, self.device))
        if lagged:
            if prev_token_ids is None:
                raise RuntimeError("decode state: placeholder input ids but no previous step")
            ids = self.ints[: len(steps), IN]
            ids.copy_(torch.where(ids < 0, prev_token_ids[(-ids - 1).clamp(min=0)], ids))

    def resolved(self, serial: int, token_ids: np.ndarray) -> None:
        """Step `serial`'s tokens reached the host (any thread): the mirror takes them at the
        next sync, unless a step was dispatched since (RowMirror.resolve)."""
        self._resolved.append((serial, token_ids))

    def advance(self, token_ids: torch.Tensor) -> None:
        """After a step on the device: the active rows of [0, S) one token further
        (token_ids i64[S]; padding rows keep their values). Fixed shapes: graph-capturable."""
        ints = self.ints[: token_ids.shape[0]]
        active = ints[:, ACTIVE]
        ints[:, POS] += active
        ints[:, STEP] += active
        ints[:, IN] = torch.where(active.bool(), token_ids, ints[:, IN])

    def check(self, steps: Sequence[SeqStep], token_ids: np.ndarray, num_rows: int,
              num_page_cols: int) -> None:
        """Debug: the device rows [0, S) after a step equal a recomputation from `steps` and
        the sampled `token_ids`, and the mirror equals the device; raises RuntimeError."""
        expected = host_rows(steps, num_rows, num_page_cols, self.page_size)
        advance_rows(expected[0], np.asarray(token_ids, np.int64))
        device = (self.ints[:num_rows].cpu().numpy(), self.floats[:num_rows].cpu().numpy(),
                  self.pages[:num_rows, :num_page_cols].cpu().numpy())
        check_rows(device, expected,
                   self.mirror.resolved_views(num_rows, num_page_cols, token_ids))


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`, enqueued without waiting for the device. On CUDA a copy from
    pageable memory synchronises the stream (it would wait for the step in flight, ending
    overlap); one from pinned memory does not, and torch's pinned allocator keeps the staging
    block until the copy ran. Elsewhere the array as a tensor there."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The step contract's seed-to-uniform rule (`step.row_uniforms`) on the device, in int64
    arithmetic (wrapping multiplies, logical shifts by masking); seeds/steps i64[B] -> f32[B]."""

    def lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
        return (z >> shift) & ((1 << (64 - shift)) - 1)

    z = (seeds << 32) | steps
    z = z + _signed(SPLITMIX64[0])
    z = (z ^ lsr(z, 30)) * _signed(SPLITMIX64[1])
    z = (z ^ lsr(z, 27)) * _signed(SPLITMIX64[2])
    z = z ^ lsr(z, 31)
    return (lsr(z, 40).double() / float(1 << 24)).float()


def _signed(u64: int) -> int:
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64
