"""Host-side page allocator for the paged KV pool.

The device pool holds ``num_pages`` pages of ``page_size`` tokens each; this module only hands
out page ids (Python ints / numpy, never JAX). Page 0 is reserved as the padding target of
padded batches and is never allocated, so ``num_usable_pages == num_pages - 1``.

A KV *slot* is the flat index of one token's KV entry::

    slot = page_id * page_size + offset        0 <= offset < page_size

    pages  [7, 2]           page_size = 4, num_tokens = 6
    slots  [28 29 30 31 | 8 9]                (page 7 full, page 2 half used)

Every page is, at any time, exactly one of: free (owned by this allocator), held by a running
request, or held by the radix cache. The allocator tracks the first with a stack of free ids and
a boolean ``is_free`` array, so a double free or a foreign page id is caught in O(n) numpy work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PADDING_PAGE = 0


def pages_to_slots(
    pages: np.ndarray | Sequence[int], num_tokens: int, page_size: int
) -> np.ndarray:
    """int32 slots of the first ``num_tokens`` tokens laid, in order, on ``pages``."""
    pages = np.asarray(pages, dtype=np.int32)
    if num_tokens < 0 or num_tokens > pages.size * page_size:
        raise ValueError(f"{num_tokens} tokens do not fit on {pages.size} pages of {page_size}")
    # [num_pages, page_size] -> flat [num_pages * page_size] -> first num_tokens
    offsets = np.arange(page_size, dtype=np.int32)
    return (pages[:, None] * page_size + offsets).reshape(-1)[:num_tokens]


def slots_to_pages(slots: np.ndarray | Sequence[int], page_size: int) -> np.ndarray:
    """int32 distinct pages, in order, of ``slots`` made of page-aligned runs.

    ``slots`` must start each page at offset 0 (as ``pages_to_slots`` lays them); a trailing
    partial page counts as one page. Only the run starts are checked (cheap), not contiguity.
    """
    slots = np.asarray(slots, dtype=np.int32)
    starts = slots[::page_size]
    if np.any(starts % page_size):
        raise ValueError("slots are not page-aligned runs")
    return starts // page_size


class PageAllocator:
    """Free list of page ids; ``alloc`` is all-or-nothing, ``free`` rejects double frees."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self._page_size = page_size
        self._free_stack = np.empty(num_pages - 1, dtype=np.int32)
        self._num_free = 0
        self._is_free = np.zeros(num_pages, dtype=bool)
        self.reset()

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def reset(self) -> None:
        """Mark every usable page free; the next ``alloc(n)`` returns pages 1..n."""
        # The stack's top is its end; store descending so low page ids come out first.
        self._free_stack[:] = np.arange(self.num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = self.num_pages - 1
        self._is_free[:] = True
        self._is_free[PADDING_PAGE] = False

    def alloc(self, n: int) -> np.ndarray | None:
        """Take ``n`` pages (int32 ids), or return None and take nothing if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._num_free:
            return None
        top = self._num_free
        pages = self._free_stack[top - n : top][::-1].copy()
        self._num_free = top - n
        self._is_free[pages] = False
        return pages

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Return ``pages`` to the free list. Raises ValueError (freeing nothing) on page 0,
        an out-of-range id, a page that is already free, or a page repeated in ``pages``."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return
        if np.any((pages <= PADDING_PAGE) | (pages >= self.num_pages)):
            bad = pages[(pages <= PADDING_PAGE) | (pages >= self.num_pages)]
            raise ValueError(
                f"cannot free pages {bad.tolist()} (valid ids: 1..{self.num_pages - 1})"
            )
        if np.any(self._is_free[pages]):
            raise ValueError(f"double free of pages {pages[self._is_free[pages]].tolist()}")
        if pages.size > 1 and np.unique(pages).size != pages.size:
            raise ValueError("double free: a page is repeated in one free() call")
        top = self._num_free
        self._free_stack[top : top + pages.size] = pages
        self._num_free = top + pages.size
        self._is_free[pages] = True

    def is_page_free(self, pages: np.ndarray | Sequence[int]) -> np.ndarray:
        """Boolean mask, one entry per page id (ids must be in ``0..num_pages-1``)."""
        return self._is_free[np.asarray(pages, dtype=np.int64)]

    def pages_to_slots(self, pages: np.ndarray | Sequence[int], num_tokens: int) -> np.ndarray:
        return pages_to_slots(pages, num_tokens, self._page_size)

    def slots_to_pages(self, slots: np.ndarray | Sequence[int]) -> np.ndarray:
        return slots_to_pages(slots, self._page_size)
