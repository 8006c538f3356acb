"""The host-memory tier below the KV pool: whole pages as raw-bit rows, keyed by chain hash.

    rows  [capacity, row elements]   one page of every layer's K and V per row (the runner's
                                     page-row layout, `read_kv_pages`), preallocated
    index chain hash -> (row, page tokens), least recently used first

A full tier makes room by dropping its least recently used page, which `put` hands back (with a
copy of its row) so the caller can write it to the disk tier.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostTier:
    def __init__(self, capacity_pages: int, row_elems: int, dtype: np.dtype) -> None:
        if capacity_pages < 1:
            raise ValueError(f"the host tier needs at least one page, got {capacity_pages}")
        self.capacity = capacity_pages
        # np.empty: the operating system maps the memory as pages are first written
        self.rows = np.empty((capacity_pages, row_elems), dtype=dtype)
        self.index: OrderedDict[bytes, tuple[int, np.ndarray]] = OrderedDict()
        self._free = list(range(capacity_pages - 1, -1, -1))

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.itemsize

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self.index

    def get(self, page_hash: bytes) -> np.ndarray | None:
        """The page's row (a view: copy it before the tier changes), or None; refreshes it."""
        entry = self.index.get(page_hash)
        if entry is None:
            return None
        self.index.move_to_end(page_hash)
        return self.rows[entry[0]]

    def put(self, page_hash: bytes, tokens: np.ndarray, row: np.ndarray
            ) -> tuple[bytes, np.ndarray, np.ndarray] | None:
        """Store a page; when full, drop the least recently used one and return it as
        (hash, tokens, row copy). A page already held is only refreshed."""
        if page_hash in self.index:
            self.index.move_to_end(page_hash)
            return None
        dropped = None
        if not self._free:
            old_hash, (old_row, old_tokens) = self.index.popitem(last=False)
            dropped = (old_hash, old_tokens, self.rows[old_row].copy())
            self._free.append(old_row)
        r = self._free.pop()
        self.rows[r] = row
        self.index[page_hash] = (r, tokens)
        return dropped

    def clear(self) -> None:
        self.index.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def check(self) -> str | None:
        """The first broken invariant as a message, or None."""
        used = [r for r, _ in self.index.values()]
        if len(set(used)) != len(used):
            return "host tier: a row is held by two pages"
        if set(used) & set(self._free):
            return "host tier: a row is both held and free"
        if len(used) + len(self._free) != self.capacity:
            return f"host tier: {len(used)} held + {len(self._free)} free != {self.capacity}"
        return None
