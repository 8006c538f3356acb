"""KV pages between the JAX backend's pool and host memory, for the lower cache tiers
(`mem_cache/tiers.py`, the step contract's `read_kv_pages` / `write_kv_pages`).

    pool, per layer: K [H, pages, page_size, D], V the same
    page row (host): [layer, k/v, H, offset, D], flattened; the pool's dtype as raw bits
                     (bfloat16 -> uint16, float32 -> uint32), so numpy can hold it

Both directions are jitted programs over a page count padded to a power of two (padding pages
name the reserved page 0, which padding tokens already write), so a handful of sizes compile.
The write donates the pools: it updates them in place, in order with the steps.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sgl_tpu.executor.step import PAD_PAGE

_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def page_layout(kv_pools: list) -> str:
    """The page rows' layout and dtype, as a fingerprint string."""
    k, _ = kv_pools[0]
    heads, _, page_size, dim = k.shape
    return (f"jax page rows [layer {len(kv_pools)}, kv 2, head {heads}, token {page_size}, "
            f"dim {dim}] {k.dtype}")


def padded_pages(pages: np.ndarray) -> np.ndarray:
    """`pages` padded with PAD_PAGE to the next power of two (the compiled sizes)."""
    n = len(pages)
    size = 1 << max(0, (n - 1).bit_length())
    out = np.full(size, PAD_PAGE, dtype=np.int32)
    out[:n] = pages
    return out


@jax.jit
def _gather(kv_pools, pages):
    # -> [P, 2L, H, page_size, D]
    return jnp.stack([t[:, pages] for layer in kv_pools for t in layer], axis=1).swapaxes(0, 2)


@partial(jax.jit, donate_argnums=0)
def _scatter(kv_pools, pages, rows):
    # rows [P, 2L, H, page_size, D]
    rows = rows.swapaxes(0, 2)  # [H, 2L, P, page_size, D]
    out, i = [], 0
    for k, v in kv_pools:
        out.append((k.at[:, pages].set(rows[:, i]), v.at[:, pages].set(rows[:, i + 1])))
        i += 2
    return out


def read_pages(kv_pools: list, pages: np.ndarray, out: np.ndarray | None = None
               ) -> np.ndarray:
    """[len(pages), row elements] raw-bit host rows of `pages` (see the module docstring),
    copied into `out` when given."""
    n = len(pages)
    rows = np.asarray(_gather(kv_pools, padded_pages(np.asarray(pages))))[:n]
    rows = rows.view(_RAW[rows.dtype.itemsize]).reshape(n, -1)
    if out is None:
        return rows
    out[...] = rows
    return out


def write_pages(kv_pools: list, pages: np.ndarray, rows: np.ndarray) -> list:
    """The pools with host rows made by `read_pages` stored into `pages` (donates the pools)."""
    n = len(pages)
    k, _ = kv_pools[0]
    heads, _, page_size, dim = k.shape
    padded = padded_pages(np.asarray(pages))
    full = np.zeros((len(padded), rows.shape[1]), dtype=rows.dtype)
    full[:n] = rows
    full = full.view(k.dtype).reshape(len(padded), 2 * len(kv_pools), heads, page_size, dim)
    return _scatter(kv_pools, jnp.asarray(padded), jnp.asarray(full))
