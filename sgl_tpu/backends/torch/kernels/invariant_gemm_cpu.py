"""Fixed-reduction-order GEMM for `--enable-deterministic-inference` on CPUs
(csrc/invariant_gemm_cpu.cpp, built at install time by cpu_extension.py).

oneDNN picks its bf16 GEMM kernel per call from the shapes and the CPU's ISA: on CPUs with AMX
the reduction order of one row changes with the number of rows beside it, so a request's
logits depended on its batch mates and on whether its prefix came from the radix cache. Here
each output is one chain of float32 fused multiply-adds over K in order, so a row's result
depends on that row and the weights only: not on M, the threads, or the ISA (every x86 build,
AVX-512, AVX2 or portable, gives the same bits; `tests/test_invariant_gemm_cpu.py`).

Dimensions: M rows, K input features, N output features.

    matmul(a [..., M, K], b [..., K, N])   -> f32[..., M, N]   (a widened to float32; b float32
                                                                or bfloat16, rows contiguous)
    pack(w [N, K])                         -> PackedWeight     (a projection, `F.linear`'s
                                                                layout, in 16-column panels)
    linear(x [..., K], PackedWeight, bias) -> [..., N]         in x's dtype, or float32 for a
                                                                weight packed `float_output`

The cost against oneDNN is `python tools/invariant_gemm_bench.py` (docs/determinism.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_tpu.backends.torch.kernels import cpu_extension

_EXT = cpu_extension.INVARIANT_GEMM
available, why_unavailable, simd = _EXT.available, _EXT.why_unavailable, _EXT.simd


def _kernel():
    return _EXT.module()


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (the same leading dims) -> float32 [..., M, N]."""
    lead = a.shape[:-2]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.dtype not in (torch.float32, torch.bfloat16):
        b = b.float()
    a3 = _rows_contiguous(a.float()).reshape(-1, m, k)
    b3 = _rows_contiguous(b).reshape(-1, k, n)
    return _kernel().gemm(a3, b3).view(*lead, m, n)


@dataclass(frozen=True)
class PackedWeight:
    """One projection [N, K] in the kernel's panels [ceil(N / 16), K, 16] (its dtype)."""

    panels: torch.Tensor
    out_features: int
    float_output: bool = False  # linear() returns float32 (the vocabulary head's logits)


def pack(w: torch.Tensor, float_output: bool = False) -> PackedWeight:
    return PackedWeight(_kernel().pack(w), w.shape[0], float_output)


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N], rounded once to x's dtype (float32 when the
    weight was packed with `float_output`)."""
    y = _kernel().gemm_packed(_rows_contiguous(x.reshape(-1, x.shape[-1]).float()), w.panels,
                              w.out_features)
    if bias is not None:
        y.add_(bias.float())
    y = y.view(*x.shape[:-1], w.out_features)
    return y if w.float_output else y.to(x.dtype)
