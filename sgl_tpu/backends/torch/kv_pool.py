"""The torch backend's KV cache: `KVPool` owns its element type (an entry of sgl_tpu/kv_dtypes.py),
its tensors and their layout; `store_rows` / `load_rows` are the only code that writes or reads
head rows in a pool's element type (attention and the K/V write call them).

    pool, per layer: K [slots, kvh, row], V the same       slot = page * page_size + offset
    row = one head row (kv_dtypes.py): head_dim values, then the scale of a scaled type

Layers differ only in their slot count: a hybrid model's local layers keep [swa_num_pages *
page_size] slots (mem_cache/swa_pool.py). A pool is a sequence of per-layer (K, V) tensors, the
form the models and the compiled layer ops take. Page rows for the host and disk tiers are
kv_pages.py's, over the same tensors, so a scaled type's rows carry their scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sgl_tpu.backends.torch import kv_pages
from sgl_tpu.kv_dtypes import KVDtype

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}
_E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344: larger values would round to inf


class KVPool(Sequence):
    """Every layer's K and V pool tensors. `layer_slots`: each layer's slot count (pages *
    page_size); `local`: which layers are a sliding-window pool's (their pages are window
    pages)."""

    def __init__(self, dtype: KVDtype, layer_slots: Sequence[int], local: Sequence[bool],
                 page_size: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.dtype = dtype
        self.page_size = page_size
        self.head_dim = head_dim
        self.local = list(local)
        storage = TORCH_DTYPES[dtype.name]
        row = dtype.head_row_bytes(head_dim) // storage.itemsize
        self.layers = [tuple(torch.zeros((slots, num_kv_heads, row), dtype=storage, device=device)
                             for _ in range(2)) for slots in layer_slots]

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    def page_layout(self) -> str:
        """The page rows' layout and element type, as a fingerprint string."""
        return kv_pages.page_layout(self.layers, self.page_size)

    def read_pages(self, pages: np.ndarray, out: np.ndarray | None = None,
                   window_pages: np.ndarray | None = None) -> np.ndarray:
        return kv_pages.read_pages(self.layers, pages, self.page_size, out, window_pages,
                                   self.local)

    def write_pages(self, pages: np.ndarray, rows: np.ndarray,
                    window_pages: np.ndarray | None = None) -> None:
        kv_pages.write_pages(self.layers, pages, rows, self.page_size, window_pages, self.local)


def head_row(pool: torch.Tensor, head_dim: int) -> int:
    """Elements per head row of `pool` (an int8 pool's rows end in their scale's 2 bytes)."""
    return head_dim + 2 if pool.dtype == torch.int8 else head_dim


def quantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., d] -> int8 head rows [..., d + 2]: q = round(x / scale) in [-127, 127], then
    the scale's bfloat16 bytes; scale = max |x| / 127 rounded up to bfloat16 (0 for a zero
    vector). Dequantized, each value is within scale / 2 of x."""
    x = rows.float()
    amax = x.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = (amax / 127).view(torch.int32)
    scale = ((scale + 0xFFFF) & ~0xFFFF).view(torch.float32)  # rounded up to bfloat16
    q = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.to(torch.bfloat16).view(torch.int8)], dim=-1)


def dequantize_int8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 head rows [..., d + 2] -> [..., d] in `dtype` (q * scale in float32)."""
    scale = packed[..., -2:].contiguous().view(torch.bfloat16).float()  # [..., 1]
    return (packed[..., :-2].float() * scale).to(dtype)


def store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[slots] = rows [T, kvh, d] in the pool's element type. An int8 pool quantizes each
    head row (`quantize_int8`). An fp8 pool saturates at its largest finite value (torch's
    conversion gives inf) and is written through a byte view: index_copy_ has no float8
    kernel."""
    if pool.dtype == torch.int8:
        pool.index_copy_(0, slots, quantize_int8(rows))
        return
    if pool.dtype == torch.float8_e5m2:
        rows = rows.clamp(-_E5M2_MAX, _E5M2_MAX).to(torch.float8_e5m2)
        pool.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
        return
    pool.index_copy_(0, slots, rows.to(pool.dtype))


def load_rows(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool[slots] as [len(slots), kvh, d] in `dtype` (a narrower pool's rows widened, an int8
    pool's dequantized)."""
    rows = pool.index_select(0, slots)
    return dequantize_int8(rows, dtype) if pool.dtype == torch.int8 else rows.to(dtype)
