"""KV pages between the torch backend's pool and host memory, for the lower cache tiers
(`mem_cache/tiers.py`, the step contract's `read_kv_pages` / `write_kv_pages`).

    pool, per layer: K [slots, H, D], V [slots, H, D]        slot = page * page_size + offset
    page row (host): [layer, k/v, offset, H, D], flattened; the pool's dtype as raw bits
                     (bfloat16 -> int16, fp8 and int8 -> uint8, float32 -> int32), so numpy
                     can hold it; D is the pool's head row (kv_pool.py: an int8 pool's ends in
                     its scale), so the rows carry the scales

A read gathers the pages of every K and V tensor with one `index_select` each, into the rows'
strided view of a buffer the caller passes (reused: fresh memory costs a page fault per 4 KiB,
more than the copy); a write is one `index_copy_` per tensor. With a sliding-window pool the
local layers' tensors are indexed by the pages' window pages (`window_pages`; `local` says
which layers are local); the rows are the same. The page rows are this backend's
own layout (`page_layout` names it, and disk files are keyed by it): a JAX server does not read
a torch server's files.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_RAW = {1: np.uint8, 2: np.int16, 4: np.int32}
_RAW_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

KVPools = list[tuple[torch.Tensor, torch.Tensor]]


def page_layout(kv_pools: KVPools, page_size: int) -> str:
    """The page rows' layout and dtype, as a fingerprint string."""
    k, _ = kv_pools[0]
    _, heads, dim = k.shape
    return (f"torch page rows [layer {len(kv_pools)}, kv 2, token {page_size}, head {heads}, "
            f"dim {dim}] {k.dtype}")


def _page_index(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(device)


def _tensor_indices(kv_pools: KVPools, pages: np.ndarray, window_pages: np.ndarray | None,
                    local: Sequence[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, the page index it is read or written at) for every K and V tensor in row
    order: local layers at `window_pages` when given, every other at `pages`."""
    k, _ = kv_pools[0]
    idx = _page_index(pages, k.device)
    window = idx if window_pages is None else _page_index(window_pages, k.device)
    local = local or [False] * len(kv_pools)
    return [(t, window if is_local else idx)
            for layer, is_local in zip(kv_pools, local, strict=True) for t in layer]


def _row_view(rows: np.ndarray, kv_pools: KVPools, page_size: int) -> torch.Tensor:
    """Host rows as a raw-bit [pages, 2 * layers, page_size, H, D] tensor (no copy)."""
    k, _ = kv_pools[0]
    x = torch.from_numpy(rows).view(_RAW_TORCH[k.element_size()])
    return x.view(len(rows), 2 * len(kv_pools), page_size, *k.shape[1:])


def _pages_of(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool tensor as raw bits [pages, page_size, H, D] (no copy; every dtype copies alike,
    fp8 included)."""
    return t.view(_RAW_TORCH[t.element_size()]).view(-1, page_size, *t.shape[1:])


@torch.inference_mode()
def read_pages(kv_pools: KVPools, pages: np.ndarray, page_size: int,
               out: np.ndarray | None = None, window_pages: np.ndarray | None = None,
               local: Sequence[bool] = ()) -> np.ndarray:
    """[len(pages), row elements] raw-bit host rows of `pages` (see the module docstring),
    written into `out` when given (a C-contiguous array of that shape and the raw dtype: a
    buffer the caller reuses, so no fresh memory is faulted in per call)."""
    k, _ = kv_pools[0]
    row_elems = 2 * len(kv_pools) * page_size * k.shape[1] * k.shape[2]
    if out is None:
        out = np.empty((len(pages), row_elems), dtype=_RAW[k.element_size()])
    dst = _row_view(out, kv_pools, page_size)
    for i, (t, idx) in enumerate(_tensor_indices(kv_pools, pages, window_pages, local)):
        dst[:, i].copy_(_pages_of(t, page_size).index_select(0, idx))
    return out


@torch.inference_mode()
def write_pages(kv_pools: KVPools, pages: np.ndarray, rows: np.ndarray, page_size: int,
                window_pages: np.ndarray | None = None, local: Sequence[bool] = ()) -> None:
    """Store host rows made by `read_pages` (any pool of the same layout) into `pages`."""
    src = _row_view(np.ascontiguousarray(rows), kv_pools, page_size)
    for i, (t, idx) in enumerate(_tensor_indices(kv_pools, pages, window_pages, local)):
        _pages_of(t, page_size).index_copy_(0, idx, src[:, i].to(t.device))
