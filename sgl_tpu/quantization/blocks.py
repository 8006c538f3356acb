"""Quantized weight matrices in numpy, independent of any kernel: the GGUF block formats decoded
into integer codes and float scales, and weight-only quantization of float matrices.

Dimensions: N = output features (rows, as stored in GGUF and `F.linear`), K = input features,
G = 32 (the group / block length along K).

    Int4Groups   q u8[N, K] in 0..15, scale f32[N, K/G], zero f32[N, K/G]
                 w[n, k] = (q - 8) * scale[n, k // G] + zero[n, k // G]
                 (the convention of torch's `_weight_int4pack_mm_for_cpu`, verified in tests)
    Int8Groups   q i8[N, K], scale f32[N, K/G]           w = q * scale[n, k // G]
    Int8Channels q i8[N, K], scale f32[N]                w = q * scale[n]

GGUF blocks (ggml's layouts; a block holds 32 weights of one row, or 256 for the K-quant
Q4_K; d and m are float16; weight j of a 32-weight block is the low nibble of qs[j] for j < 16
and the high nibble of qs[j - 16]):

    Q4_0  [d | qs 16 B]          w = d * (q - 8)   -> Int4Groups(scale d, zero 0)
    Q4_1  [d | m | qs 16 B]      w = d * q + m     -> Int4Groups(scale d, zero m + 8 d)
    Q5_0  [d | qh 4 B | qs 16 B] w = d * (q - 16)  -> Int8Groups(scale d), codes q - 16
          q = the nibble of qs plus bit j of qh (little-endian u32) as its fifth bit
    Q8_0  [d | qs i8 x 32]       w = d * q         -> Int8Groups(scale d)
    Q4_K  [d | dmin | scales 12 B | qs 128 B], 8 groups of 32: 6-bit sc[g] and mn[g] packed
          in `scales`, group 2c the low nibbles of qs[32 c : 32 c + 32], group 2c + 1 the high
          w = (d sc[g]) * q - dmin mn[g] -> Int4Groups(scale d sc, zero 8 d sc - dmin mn)

The mappings are exact: d and m are float16 values, so scale, zero (m + 8 d, whose terms lie
within 2^13 of each other for any real block) and every (q - 8) * d are exact in float32.
Q4_K's scale d sc (17 significant bits) and every (q - 8) * scale are exact too; its zero is
exact where d sc and dmin mn lie within 2^7 of each other (17 + 7 bits fit float32's 24), as
a group's step and minimum do in real files (every Q4_K block of Gemma 3 270M's, tested). A
block where it is not has no exact form: decoding checks the whole matrix against ggml's
formula and raises ValueError (the projection stays dense).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32

# GGML type name -> (weights per block, bytes per block), for the types with a quantized form
GGUF_BLOCKS = {"Q4_0": (GROUP, 2 + 16), "Q4_1": (GROUP, 2 + 2 + 16),
               "Q5_0": (GROUP, 2 + 4 + 16), "Q8_0": (GROUP, 2 + 32),
               "Q4_K": (8 * GROUP, 2 + 2 + 12 + 128)}


@dataclass(frozen=True, eq=False)
class Int4Groups:
    q: np.ndarray  # u8[N, K], 0..15
    scale: np.ndarray  # f32[N, K/G]
    zero: np.ndarray  # f32[N, K/G]

    def dequantize(self) -> np.ndarray:  # f32[N, K]
        s = np.repeat(self.scale, GROUP, axis=1)
        z = np.repeat(self.zero, GROUP, axis=1)
        return (self.q.astype(np.float32) - 8) * s + z


@dataclass(frozen=True, eq=False)
class Int8Groups:
    q: np.ndarray  # i8[N, K]
    scale: np.ndarray  # f32[N, K/G]

    def dequantize(self) -> np.ndarray:  # f32[N, K]
        return self.q.astype(np.float32) * np.repeat(self.scale, GROUP, axis=1)

    def split_nibbles(self) -> tuple[Int4Groups, Int4Groups]:
        """Two Int4Groups whose dequantized sum is this matrix exactly: q = 16 hi + lo with
        lo in 0..15 and hi in -8..7, so w = (hi + 8 - 8) * 16 d + (lo - 8) * d + 8 d."""
        q = self.q.astype(np.int16)
        lo = (q & 0xF).astype(np.uint8)
        hi = ((q >> 4) + 8).astype(np.uint8)  # arithmetic shift: -8..7 -> 0..15
        zeros = np.zeros_like(self.scale)
        return (Int4Groups(hi, self.scale * 16, zeros), Int4Groups(lo, self.scale, self.scale * 8))


@dataclass(frozen=True, eq=False)
class Int8Channels:
    q: np.ndarray  # i8[N, K]
    scale: np.ndarray  # f32[N]

    def dequantize(self) -> np.ndarray:  # f32[N, K]
        return self.q.astype(np.float32) * self.scale[:, None]


QuantizedMatrix = Int4Groups | Int8Groups | Int8Channels


def rows(m: QuantizedMatrix, index: np.ndarray) -> QuantizedMatrix:
    """The same matrix with its rows (output features) taken in `index` order."""
    if isinstance(m, Int4Groups):
        return Int4Groups(m.q[index], m.scale[index], m.zero[index])
    if isinstance(m, Int8Groups):
        return Int8Groups(m.q[index], m.scale[index])
    return Int8Channels(m.q[index], m.scale[index])


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
    """Stack matrices along N (a fused projection); None when their formats differ."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    cat = np.concatenate
    if isinstance(first, Int4Groups):
        return Int4Groups(cat([p.q for p in parts]), cat([p.scale for p in parts]),
                          cat([p.zero for p in parts]))
    if isinstance(first, Int8Groups):
        return Int8Groups(cat([p.q for p in parts]), cat([p.scale for p in parts]))
    return Int8Channels(cat([p.q for p in parts]), cat([p.scale for p in parts]))


# ---------------------------------------------------------------- GGUF blocks


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs u8[..., 16] -> codes u8[..., 32]: low nibbles are weights 0..15, high 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _half(b: np.ndarray) -> np.ndarray:
    """u8[..., 2] float16 fields -> f32[...]."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _q5_0_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks u8[N, nb, 22] -> int8 codes q - 16, [N, nb, 32]."""
    qh = blocks[..., 2:6].copy().view("<u4")  # [N, nb, 1]
    high = ((qh >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)  # fifth bits
    return (_nibbles(blocks[..., 6:]) | (high << 4)).astype(np.int8) - 16


def _q4_k(blocks: np.ndarray, n: int, num_cols: int) -> Int4Groups:
    """Q4_K super-blocks u8[N, nb, 144] -> Int4Groups of 32 (module doc)."""
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [N, nb]
    s = blocks[..., 4:16]
    # ggml's get_scale_min_k4: groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    # (mins); groups 4-7 from the nibbles of bytes 8-11 plus those bytes' top 2 bits
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    scale = (d[..., None] * sc).reshape(n, -1)  # [N, K/G]
    minimum = (dmin[..., None] * mn).reshape(n, -1)
    qs = blocks[..., 16:].reshape(n, -1, 4, GROUP)  # [N, nb, chunk, 32]
    q = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(n, num_cols)
    out = Int4Groups(q, scale, 8 * scale - minimum)
    ggml = q.astype(np.float32) * np.repeat(scale, GROUP, axis=1) - np.repeat(minimum, GROUP, 1)
    if not np.array_equal(out.dequantize(), ggml):
        raise ValueError("Q4_K blocks whose scale and minimum differ too much in size have no "
                         "exact int4 form")
    return out


def decode_gguf_blocks(type_name: str, data: np.ndarray, num_cols: int) -> QuantizedMatrix:
    """Raw GGUF tensor bytes u8[N, K / block weights * block bytes] of `type_name` -> its exact
    quantized form. ValueError for a type or a block without one."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(f"no quantized form for GGUF type {type_name}")
    block_weights, block_bytes = GGUF_BLOCKS[type_name]
    if num_cols % block_weights:
        raise ValueError(f"{type_name} row length {num_cols} is not a multiple of "
                         f"{block_weights}")
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, num_cols // block_weights, block_bytes)
    if type_name == "Q4_K":
        return _q4_k(blocks, n, num_cols)
    d = _half(blocks[..., :2])  # [N, K/G]
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, num_cols)
        return Int8Groups(q, d)
    if type_name == "Q5_0":
        return Int8Groups(_q5_0_codes(blocks).reshape(n, num_cols), d)
    if type_name == "Q4_0":
        q = _nibbles(blocks[..., 2:]).reshape(n, num_cols)
        return Int4Groups(q, d, np.zeros_like(d))
    m = _half(blocks[..., 2:4])
    q = _nibbles(blocks[..., 4:]).reshape(n, num_cols)
    return Int4Groups(q, d, m + 8 * d)


# ---------------------------------------------------------------- quantizing float weights


def quantize_int4(w: np.ndarray) -> Int4Groups:
    """f32[N, K] -> asymmetric 4-bit codes per group of 32 (min/max: the group's range spread
    over 16 levels, as GGUF's Q4_1 does)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs input features divisible by {GROUP}, got {k}")
    g = w.reshape(n, k // GROUP, GROUP).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scale = (hi - lo) / 15
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.rint((g - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return Int4Groups(q.reshape(n, k), scale, lo + 8 * scale)


def quantize_int8(w: np.ndarray) -> Int8Channels:
    """f32[N, K] -> symmetric 8-bit codes with one scale per output feature (absmax / 127)."""
    scale = np.abs(w).max(axis=1).astype(np.float32) / 127
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return Int8Channels(q, scale)
