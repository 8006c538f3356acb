"""The sliding-window half of a hybrid KV pool (host side, numpy only).

A hybrid model (Gemma 2 and 3) has global layers, whose queries see every earlier token, and
local layers, whose queries see only the last W tokens (the sliding window). The global layers
keep every token's K/V in the main pool, on the pages `PageAllocator` hands out as for any
model. The local layers keep theirs in a second, smaller pool of *window pages*, and each main
page may hold one:

    window_of[page] = its window page id, or 0: dropped (only the global layers' K/V is left)

    main pages of one request     [ 7 | 2 | 9 | 4 | 5 ]      W = 2 pages, computing from page 5
    window_of                     [ 0 | 0 | 3 | 1 | 6 ]      pages 7 and 2 lie outside every
                                                              window: their window pages dropped

A page takes a window page when it is allocated (a step writes every layer's K/V) and gives it
back when it is freed, or earlier, when no running request's window covers it and the window
pool runs short (`KVManager` decides which: `reclaim`). A prefix cached in the radix tree is
usable up to a point whose W tokens before it still hold their window pages (`usable_prefix`);
past that point the tokens are computed again, as SGLang's SWA radix cache treats its
tombstones.

`SwaPageAllocator` is a `PageAllocator` of the main pool that keeps `window_of` in step: whoever
allocates or frees main pages (requests, the radix tree) needs to know nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sgl_tpu.mem_cache.allocator import PageAllocator


def pool_split(total_tokens: int, num_layers: int, num_local: int, ratio: float,
               min_window_tokens: int, page_size: int) -> tuple[int, int] | None:
    """(main pool tokens, window pool tokens) in the memory of `total_tokens` tokens of every
    layer: the window pool holds `ratio` of the main pool's tokens, at least
    `min_window_tokens`; both in whole pages. None when the main pool would hold no more than
    `total_tokens` (the split does not pay)."""
    num_global = num_layers - num_local
    budget = total_tokens * num_layers  # tokens x layers of K/V
    main = int(budget / (num_global + ratio * num_local))
    window = max(int(ratio * main), min_window_tokens)
    window = -(-window // page_size) * page_size
    main = (budget - window * num_local) // num_global // page_size * page_size
    return (main, window) if main > total_tokens else None


class SwaPageAllocator(PageAllocator):
    """Main-pool pages, each allocated with a window page; see the module docstring.

    `reclaim(n)` is called when an allocation finds fewer than `n` window pages free: it may
    `drop_windows` of pages no one needs (the KV manager knows who needs which)."""

    def __init__(self, num_pages: int, page_size: int, window: int, num_window_pages: int,
                 reclaim: Callable[[int], None] = lambda n: None) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {window}")
        self.window = window
        self.windows = PageAllocator(num_window_pages, page_size)
        self.window_of = np.zeros(num_pages, dtype=np.int32)
        self.reclaim = reclaim
        self.num_dropped = 0  # pages whose window pages `drop_windows` gave back early
        super().__init__(num_pages, page_size)

    def reset(self) -> None:
        super().reset()
        self.windows.reset()
        self.window_of[:] = 0

    def alloc(self, n: int, windows: int | None = None) -> np.ndarray | None:
        """`n` main pages, the last `windows` of them (all by default) with a window page;
        None (taking nothing) if either is short after `reclaim`."""
        k = n if windows is None else windows
        if n > self.num_free_pages:
            return None
        short = k - self.windows.num_free_pages
        if short > 0:
            self.reclaim(short)
            if k > self.windows.num_free_pages:
                return None
        pages = super().alloc(n)
        self.window_of[pages[n - k:]] = self.windows.alloc(k)
        return pages

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        super().free(pages)  # (raises before anything changes)
        self._give_back(pages)

    def drop_windows(self, pages: np.ndarray | Sequence[int]) -> None:
        """Give back the window pages of `pages` (in use, each holding one) before the pages
        themselves: only their global layers' K/V is left."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if self._is_free[pages].any() or not self.window_of[pages].all():
            raise ValueError("drop_windows takes pages in use that hold window pages")
        self._give_back(pages)
        self.num_dropped += pages.size

    def _give_back(self, pages: np.ndarray) -> None:
        held = self.window_of[pages]
        self.windows.free(held[held > 0])
        self.window_of[pages] = 0

    def adopt(self, keep: Sequence[int], dup: Sequence[int]) -> None:
        """`dup[i]` holds the same tokens as `keep[i]` and is about to be freed: a `keep` page
        without a window page takes `dup`'s (a request computed tokens the tree held, and may
        still read their window)."""
        keep, dup = np.asarray(keep, np.int64), np.asarray(dup, np.int64)
        move = (self.window_of[keep] == 0) & (self.window_of[dup] > 0)
        self.window_of[keep[move]] = self.window_of[dup[move]]
        self.window_of[dup[move]] = 0

    def first_window_page(self, kv_len: int | np.ndarray) -> int | np.ndarray:
        """Index of the first page a sequence computing from position `kv_len` (an int, or an
        array of them) reads in its local layers (one page early: a decode step may lag a
        token behind)."""
        first = np.maximum(0, (np.asarray(kv_len) - self.window + 1) // self.page_size - 1)
        return int(first) if first.ndim == 0 else first

    def usable_prefix(self, pages: Sequence[int], prefix_len: int) -> int:
        """The longest page-aligned length <= `prefix_len` of a cached prefix on `pages` whose
        W tokens before it all hold their window pages (0 always qualifies)."""
        ps = self.page_size
        n = prefix_len // ps
        has = self.window_of[np.asarray(pages[:n], np.int64)] > 0
        if has.all():
            return n * ps
        # a prefix of `end` pages qualifies if the last page before it without a window page
        # lies before its first window page
        ends = np.arange(1, n + 1)
        lacking = np.maximum.accumulate(np.where(has, -1, ends - 1))
        ok = np.flatnonzero(lacking < self.first_window_page(ends * ps))
        return int(ends[ok[-1]]) * ps if ok.size else 0

    def info(self) -> dict[str, int]:
        return {"window": self.window, "num_window_pages_total": self.windows.num_usable_pages,
                "num_window_pages_free": self.windows.num_free_pages,
                "num_windows_dropped": self.num_dropped}

    def check(self) -> None:
        """RuntimeError unless each window page in use belongs to exactly one main page in
        use, and no free main page holds one."""
        held = self.window_of[self.window_of > 0]
        used = self.windows.num_usable_pages - self.windows.num_free_pages
        if held.size != used or np.unique(held).size != held.size:
            raise RuntimeError(f"window pages: {held.size} mapped ({np.unique(held).size} "
                               f"distinct), {used} in use")
        if self.windows.is_page_free(held).any():
            raise RuntimeError("a main page maps to a free window page")
        if (self.window_of[self._is_free] > 0).any():
            raise RuntimeError("a free main page holds a window page")
