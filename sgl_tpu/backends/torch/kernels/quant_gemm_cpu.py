"""Weight-only Q4 / Q8 block GEMM with float32 activations for CPUs (csrc/quant_gemm_cpu.cpp,
built at install time by cpu_extension.py), for decode-sized row counts.

Dimensions: M activation rows, K input features, N output features, G = 32, nb = K / G.

    pack_q4(q u8[N, K] in 0..15, scale f32[N, nb], zero f32[N, nb])
        -> Q4Blocks(qs u8[N, nb, 16], scale, zero)      w = (q - 8) * scale + zero
           byte t of a block = weight 2t (low nibble) | weight 2t + 1 (high nibble): each
           32-bit word holds 8 consecutive weights, widened to 8 lanes by one shift and mask
    pack_q8(q i8[N, K], scale f32[N, nb]) -> Q8Blocks(qs i8[N, nb, 32], scale)   w = q * scale

    q4_gemm(x f32[M, K], Q4Blocks) / q8_gemm(x, Q8Blocks) -> f32[M, N] = x @ w.T

The codes are widened to float32 in registers and multiplied with the float32 activations:
the weights are exactly the stored ones (no activation quantization), float32 accumulation.

    q4_gemm_a8(x, Q4Blocks) / q8_gemm_a8(x, Q8Blocks) -> f32[M, N]   (`--quantization gguf-a8`)

quantize each activation row per block of 32 to int8 first (llama.cpp's Q8_0: d = max|x| / 127,
xq = round_half_even(x / d)) and take integer block dots (exact in int32: AVX512-VNNI vpdpbusd,
a block pair per instruction, where the build has it, else AVX2 maddubs/madd), one float FMA
per block (pair) with scale * d; the Q4 zero term uses the quantized block sums d * sum(xq)
(llama.cpp's Q8_1 s), so a block computes the stored weights times d * xq. The module's
`simd` ("avx512f", "avx2-fma", "scalar") and `vnni` attributes say which code it holds.
`quantize_a8(x) -> (xq i8[M, K], d f32[M, nb])` is that quantization, for tests.

Where the build has tile kernels (`tiles_for(n)`: N % 16 == 0 and `tile_dot()` non-empty) the
a8 kernels take the weights in tiles of 16 output features instead, one feature per 32-bit
vector lane, so a `vpdpbusd` adds 16 features' dots of 4 broadcast activations and no lane sums
are needed. AVX512-VNNI builds take a tile's 16 features in one 512-bit vector; builds without
AVX-512 take them as two 256-bit halves, with `vpdpbusd ymm` (AVX-VNNI) or AVX2's
`vpmaddubsw` + `vpmaddwd` (exact: csrc/quant_gemm_cpu.cpp gives the bounds), the same integer
dots and float operations per lane, so the same bits as the 512-bit kernels:

    pack_q4_tiles(q, scale, zero) -> Q4Tiles(qt u8[N/16, nb, 256], st, mt [N/16, nb, 16])
        256 bytes per tile block: 4 vectors x 16 features x 4 bytes; byte c of vector i,
        feature f = code k = 4i + c (low nibble) | code k = 16 + 4i + c (high nibble);
        mt = zero - 8 scale (w = q scale + mt: a GGUF Q4_1's m, Q4_0's -8 d)
    pack_q8_tiles(q, scale) -> Q8Tiles(qt u8[N/16, nb, 512], st)    byte = code + 128

Scales are float16 where every value is one (a GGUF's: its d and m are float16), else float32.
The same math (integer block dots, one FMA per block, the Q4 min term on the quantized block
sums); the float32 summation order differs from the block layout's kernels, and the Q4 term is
min * xsum, one product, where they take zero * xsum - 8 scale * xsum.
`available()` / `why_unavailable()` say whether the compiled module loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sgl_tpu.backends.torch.kernels import cpu_extension

GROUP = 32


_EXT = cpu_extension.QUANT_GEMM
available, why_unavailable, simd = _EXT.available, _EXT.why_unavailable, _EXT.simd
flavour = _EXT.flavour


def kernel_module():
    """The compiled module (after `available()`)."""
    return _EXT.module()


def vnni() -> bool:
    """Whether the loaded build holds the a8 kernels' AVX512-VNNI path (False when unbuilt)."""
    return available() and bool(getattr(kernel_module(), "vnni", False))


def tile_dot() -> str:
    """The tile kernels' integer dot product in the loaded build ("" without tile kernels or
    unbuilt): "vpdpbusd-zmm" (AVX512-VNNI, 16 features per vector), "vpdpbusd-ymm-vex"
    (AVX-VNNI), "vpdpbusd-ymm-evex" (the avx2-vnni build on a CPU with AVX512-VNNI + VL but no
    AVX-VNNI: the same instruction, EVEX-encoded), "vpmaddubsw-ymm" (AVX2)."""
    return getattr(kernel_module(), "tile_dot", "") if available() else ""


@dataclass(frozen=True, eq=False)
class Q4Blocks:
    qs: torch.Tensor  # u8[N, nb, 16]
    scale: torch.Tensor  # f32[N, nb]
    zero: torch.Tensor  # f32[N, nb]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes + self.zero.nbytes


@dataclass(frozen=True, eq=False)
class Q8Blocks:
    qs: torch.Tensor  # i8[N, nb, 32]
    scale: torch.Tensor  # f32[N, nb]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes


@dataclass(frozen=True, eq=False)
class Q4Tiles:
    qt: torch.Tensor  # u8[N/16, nb, 256]
    st: torch.Tensor  # f16 or f32 [N/16, nb, 16]
    mt: torch.Tensor  # the same dtype [N/16, nb, 16]

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes + self.st.nbytes + self.mt.nbytes


@dataclass(frozen=True, eq=False)
class Q8Tiles:
    qt: torch.Tensor  # u8[N/16, nb, 512]
    st: torch.Tensor  # f16 or f32 [N/16, nb, 16]

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes + self.st.nbytes


TILE = 16  # output features per tile


def tiles_for(n: int) -> bool:
    """Whether the a8 kernels take N = n output features in tiles (builds with tile kernels:
    AVX512-VNNI, or AVX2 + F16C with 256-bit vectors)."""
    return n % TILE == 0 and tile_dot() != ""


def _tile_scales(*arrays: np.ndarray) -> list[torch.Tensor]:
    """f32[N, nb] each -> [N/16, nb, 16], float16 if every value of every array is one (so the
    kernel reads one dtype), else float32."""
    tiled = [np.ascontiguousarray(np.asarray(a, np.float32).reshape(
        a.shape[0] // TILE, TILE, a.shape[1]).transpose(0, 2, 1)) for a in arrays]
    with np.errstate(over="ignore"):
        half = all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in tiled)
    return [torch.from_numpy(t.astype(np.float16) if half else t) for t in tiled]


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def pack_q4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Q4Blocks:
    """q u8[N, K] (0..15), scale / zero f32[N, K/G] -> the kernel's blocks."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"Q4 blocks need K divisible by {GROUP}, got {k}")
    g = q.reshape(n, k // GROUP, GROUP).astype(np.uint8)
    qs = (g[..., 0::2] & 0xF) | ((g[..., 1::2] & 0xF) << 4)  # [N, nb, 16]
    return Q4Blocks(torch.from_numpy(np.ascontiguousarray(qs)), _f32(scale), _f32(zero))


def pack_q8(q: np.ndarray, scale: np.ndarray) -> Q8Blocks:
    """q i8[N, K], scale f32[N, K/G] -> the kernel's blocks."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"Q8 blocks need K divisible by {GROUP}, got {k}")
    qs = np.ascontiguousarray(q, dtype=np.int8).reshape(n, k // GROUP, GROUP)
    return Q8Blocks(torch.from_numpy(qs), _f32(scale))


def pack_q4_tiles(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Q4Tiles:
    """q u8[N, K] (0..15), scale / zero f32[N, K/G], N % 16 == 0 -> Q4 tiles (module doc)."""
    n, k = q.shape
    if k % GROUP or n % TILE:
        raise ValueError(f"Q4 tiles need N divisible by {TILE} and K by {GROUP}, got {n}x{k}")
    g = q.reshape(n // TILE, TILE, k // GROUP, 2, 4, 4).astype(np.uint8)  # [T, f, b, half, i, c]
    byte = (g[:, :, :, 0] & 0xF) | ((g[:, :, :, 1] & 0xF) << 4)  # [T, f, b, i, c]
    qt = byte.transpose(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 256)  # [T, b, (i f c)]
    mins = np.asarray(zero, np.float32) - np.float32(8) * np.asarray(scale, np.float32)
    return Q4Tiles(torch.from_numpy(np.ascontiguousarray(qt)), *_tile_scales(scale, mins))


def pack_q8_tiles(q: np.ndarray, scale: np.ndarray) -> Q8Tiles:
    """q i8[N, K], scale f32[N, K/G], N % 16 == 0 -> Q8 tiles (module doc)."""
    n, k = q.shape
    if k % GROUP or n % TILE:
        raise ValueError(f"Q8 tiles need N divisible by {TILE} and K by {GROUP}, got {n}x{k}")
    g = (q.astype(np.int8).view(np.uint8) ^ 0x80).reshape(n // TILE, TILE, k // GROUP, 8, 4)
    qt = g.transpose(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 512)  # [T, b, (i f c)]
    return Q8Tiles(torch.from_numpy(np.ascontiguousarray(qt)), *_tile_scales(scale))


def q4_gemm(x: torch.Tensor, w: Q4Blocks) -> torch.Tensor:
    """x f32[M, K] -> f32[M, N]."""
    return kernel_module().q4_gemm(x.contiguous(), w.qs, w.scale, w.zero)


def q8_gemm(x: torch.Tensor, w: Q8Blocks) -> torch.Tensor:
    """x f32[M, K] -> f32[M, N]."""
    return kernel_module().q8_gemm(x.contiguous(), w.qs, w.scale)


def q4_gemm_a8(x: torch.Tensor, w: Q4Blocks | Q4Tiles) -> torch.Tensor:
    """x f32[M, K] (quantized to int8 per 32 values inside) -> f32[M, N]."""
    if isinstance(w, Q4Tiles):
        return kernel_module().q4_gemm_a8_tiles(x.contiguous(), w.qt, w.st, w.mt)
    return kernel_module().q4_gemm_a8(x.contiguous(), w.qs, w.scale, w.zero)


def q8_gemm_a8(x: torch.Tensor, w: Q8Blocks | Q8Tiles) -> torch.Tensor:
    """x f32[M, K] (quantized to int8 per 32 values inside) -> f32[M, N]."""
    if isinstance(w, Q8Tiles):
        return kernel_module().q8_gemm_a8_tiles(x.contiguous(), w.qt, w.st)
    return kernel_module().q8_gemm_a8(x.contiguous(), w.qs, w.scale)


def quantize_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32[M, K] -> (xq i8[M, K], d f32[M, K/G]): the activations the a8 kernels multiply."""
    return kernel_module().quantize_a8(x.contiguous())
