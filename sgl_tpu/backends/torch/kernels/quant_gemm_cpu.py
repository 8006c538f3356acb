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
per block (pair) with scale * d; the Q4 zero term uses the exact float block sums. The module's
`simd` ("avx512f", "avx2-fma", "scalar") and `vnni` attributes say which code it holds.
`quantize_a8(x) -> (xq i8[M, K], d f32[M, nb])` is that quantization, for tests.
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


def _kernel():
    return _EXT.module()


def vnni() -> bool:
    """Whether the loaded build holds the a8 kernels' AVX512-VNNI path (False when unbuilt)."""
    return available() and bool(getattr(_kernel(), "vnni", False))


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


def q4_gemm(x: torch.Tensor, w: Q4Blocks) -> torch.Tensor:
    """x f32[M, K] -> f32[M, N]."""
    return _kernel().q4_gemm(x.contiguous(), w.qs, w.scale, w.zero)


def q8_gemm(x: torch.Tensor, w: Q8Blocks) -> torch.Tensor:
    """x f32[M, K] -> f32[M, N]."""
    return _kernel().q8_gemm(x.contiguous(), w.qs, w.scale)


def q4_gemm_a8(x: torch.Tensor, w: Q4Blocks) -> torch.Tensor:
    """x f32[M, K] (quantized to int8 per 32 values inside) -> f32[M, N]."""
    return _kernel().q4_gemm_a8(x.contiguous(), w.qs, w.scale, w.zero)


def q8_gemm_a8(x: torch.Tensor, w: Q8Blocks) -> torch.Tensor:
    """x f32[M, K] (quantized to int8 per 32 values inside) -> f32[M, N]."""
    return _kernel().q8_gemm_a8(x.contiguous(), w.qs, w.scale)


def quantize_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32[M, K] -> (xq i8[M, K], d f32[M, K/G]): the activations the a8 kernels multiply."""
    return _kernel().quantize_a8(x.contiguous())
