"""The tensor directory of a GGUF file: name -> (GGML type, shape, memory-mapped bytes), read
without `gguf.GGUFReader`, which decodes every metadata array into numpy views (10 s for the
default model's 49k-token vocabulary on a loaded 2-core machine; this walk takes well under one).

GGUF (v2/v3) layout, little-endian:

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x  [key: str | value type u32 | value]      str = u64 length + UTF-8 bytes
    n_tensors x [name: str | n_dims u32 | dims u64 x n_dims (fastest first) | type u32 |
                 offset u64 (from the data section)]
    padding to `general.alignment` (default 32) | data section
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGML type id -> name, for the types this package has an exact quantized form of
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K"}
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    name: str
    type_id: int
    dims: tuple[int, ...]  # GGUF order: the row length (fastest dimension) first
    data: np.ndarray  # u8[bytes], memory-mapped

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.type_id, f"type {self.type_id}")

    def rows(self) -> np.ndarray:  # u8[N, bytes per row] of a 2-D tensor
        return self.data.reshape(self.dims[1], -1)


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def skip_value(self, vtype: int) -> int | None:
        """Skip one metadata value; returns it when it is a u32 (the alignment key's type)."""
        if vtype == _STRING:
            (n,) = self.unpack("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif vtype == _UINT32:
            return self.unpack("<I")[0]
        elif vtype in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[vtype]
        else:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        return None


def _tensor_bytes(type_id: int, dims: tuple[int, ...]) -> int:
    from sgl_tpu.quantization.blocks import GGUF_BLOCKS

    count = int(np.prod(dims))
    name = GGML_TYPE_NAMES.get(type_id)
    if name == "F32":
        return 4 * count
    if name == "F16":
        return 2 * count
    if name in GGUF_BLOCKS:
        block_weights, block_bytes = GGUF_BLOCKS[name]
        return count // block_weights * block_bytes
    return 0  # a type without a quantized form here: its bytes are not needed


def read_gguf_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF at `path`; ValueError for a file that is not GGUF v2/v3.
    Tensors of other types carry an empty `data` (only their type and shape are read)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    magic, version = cur.unpack("<4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file")
    n_tensors, n_kv = cur.unpack("<QQ")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        value = cur.skip_value(vtype)
        if key == _ALIGNMENT_KEY and value is not None:
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        dims = cur.unpack(f"<{n_dims}Q")
        type_id, offset = cur.unpack("<IQ")
        infos.append((name, type_id, tuple(int(d) for d in dims), offset))
    start = -(-cur.pos // alignment) * alignment
    out = {}
    for name, type_id, dims, offset in infos:
        size = _tensor_bytes(type_id, dims)
        out[name] = GGUFTensor(name, type_id, dims, buf[start + offset : start + offset + size])
    return out
