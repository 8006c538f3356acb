"""Weight-only quantized linear layers for the torch CPU backend, chosen per call by row count.

    x [M, K] ──M <= max_rows──► quantized kernel (reads 4 or 8 bits per weight: wins while the
            │                   GEMM is bound by memory, i.e. decode)
            └─M >  max_rows──► dense (bf16 oneDNN-prepacked, or float32) weight, kept beside
                               the codes (wins once the integer kernels turn compute-bound:
                               prefill, big batches). Without a dense copy the kernel runs at
                               every M.

Kernels (N % 16 == 0 and K % 32 == 0 for the torch int4 op; K % 32 == 0 for the others):

    Int4Kernel      `_weight_int4pack_mm_for_cpu`, group 32: w = (q - 8) * scale + zero, with
                    scale and zero in the activation dtype (so bfloat16 rounds them)
    Int8Kernel      `_weight_int8pack_mm`: w = q * scale[n], one scale per output feature
    Q4F32Kernel     float32 activations (CPUs without AMX):
    backends/torch/kernels/quant_gemm_cpu.py,
                    the same int4 groups with the stored float32 scales and zeros, exact
    Q8F32Kernel     float32 activations: GGUF Q8_0 blocks (w = q * scale per block of 32),
                    exact; serves the vocabulary head
    Q4A8Kernel      `--quantization gguf-a8`: the same Q4 / Q8_0 blocks, the float32
    Q8A8Kernel      activations quantized to int8 per 32 values (llama.cpp's CPU math:
                    integer block dots, one float FMA per block); not exact. On builds with
                    the tiles (AVX512-VNNI, AVX-VNNI, AVX2) and N % 16 == 0 the weights are
                    stored in tiles of 16 output features (kinds `q4-a8-t16`, `q8-a8-t16`),
                    which run every row count faster than a dense copy (bf16 on AVX512-VNNI,
                    float32 on AVX2): no dense copy is kept

`make_kernel` picks the float32 kernels (the a8 ones when asked for int8 activations) when the
activations are float32 and the compiled module loads (torch's int4 op with float32 activations
measured ~8x slower than a dense float32 GEMV on an AVX2 CPU); bfloat16 keeps the torch ops.

With bfloat16, GGUF Q8_0 (per-block scales) has no kernel and stays dense: `_weight_int8pack_mm`
takes one scale per output feature (not exact for Q8_0). The exact form, two int4 nibble planes
summed (blocks.Int8Groups.split_nibbles), measured 0.76x of bf16 on the default model's
49152-row head at one row on a quiet machine but 1.33x under load, and 0.86-1.14x on layer-sized
matrices (per-matrix timing): at most ~0.5 ms of a 25 ms batch-1 step, not taken.

With int8 activations on the block layout (`gguf-a8` where the kernels have no tiles) on a CPU
whose oneDNN computes bf16 natively (AVX512-BF16, AMX), the dense copy is bfloat16, oneDNN-
prepacked: steps above the kernels' rows cast their float32 activations to bf16 and the result
back (`bf16_dense_linear`), twice dense float32's rate and half its bytes.

`max_rows` comes from `max_kernel_rows`: `MAX_KERNEL_ROWS`, the crossover measured on a 2-core
AVX512-BF16 CPU (no AMX; the float32 kernels on a 2-core AVX2 CPU, and their AVX-512 build on a
2-core AVX-512 Xeon), the kernels forced at every row count in the runner's decode step
(benchmarks/results/README.md lists the commands; docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_tpu.backends.torch.kernels import quant_gemm_cpu
from sgl_tpu.quantization.blocks import GROUP, Int4Groups, Int8Channels, Int8Groups

# Largest batch rows for which each kernel beats the bf16 prepacked GEMM in the runner's decode
# step (default model, 2 threads; kernel forced at every M, step time vs dense): int4 0.66x at
# 1 row, 0.86x at 4, 1.03x at 6, 1.21x at 16; int8 0.93x at 1, 0.95x at 2, 1.08x at 3
# (benchmarks/results/quantization_crossover_int{4,8}.json). The float32 block kernels against
# dense float32 on a 2-core AVX2 CPU (no AMX; gguf = Q4_1 layers + Q8_0 head, kernel at
# every M): 0.42x at 16 rows, 0.56x at 24, 0.80x at 32, 1.13x at 64
# (benchmarks/results/quantization_crossover_f32.json). The int8-activation kernels (gguf-a8)
# against dense float32 in the same step (kernel at every M): 0.42x at 16 rows, 0.76x at 32,
# 0.90x at 64, 0.87x for a 64-token prefill, 1.36x at 512 (quant_executor_a8_f32.json).
MAX_KERNEL_ROWS = {"int4": 4, "int8": 2, "q4-f32": 32, "q8-f32": 32, "q4-a8": 64, "q8-a8": 64}
# The float32 block kernels built for AVX-512 (16 lanes) against dense float32 (oneDNN, which
# uses 16 lanes too), one decoder step's GEMMs on a 2-core AVX-512 Xeon (no AMX): 0.71x at 16
# rows, 0.88x at 20, 1.09x at 24, 1.21x at 28, 1.36x at 32
# (benchmarks/results/quant_linear_crossover_avx512.json): the crossover comes sooner.
AVX512_F32_MAX_ROWS = 20
# The int8-activation kernels against a bf16 dense copy (oneDNN's AVX512-BF16 GEMM) on a 2-core
# AMD EPYC (AVX512-VNNI + BF16, no AMX), one decoder layer's GEMMs of the 1.4B-class model: 1.0x
# at 8 rows, bf16 1.3x faster at 12 and 1.5x at 16 (a8 4.1x faster at 1 row;
# benchmarks/results/speed3_quant_linear_w3.json, tools/quant_linear_bench.py).
A8_BF16_DENSE_MAX_ROWS = 8
# The tiled int8-activation kernels (16 features per vector) against the bf16 dense copy, one
# layer's GEMMs, one thread, same CPU: 0.24x the time at 1 row, 0.58x at 8, 0.78x at 64, 0.79x
# at 512 (135M shapes); 0.23x, 0.61x, 0.76x, 0.77x (1.4B-class shapes;
# tools/quant_linear_bench.py, benchmarks/results/speed3_quant_linear_tiles_w{1,3}.json): they
# take every step.
TILE_KINDS = ("q4-a8-t16", "q8-a8-t16")
A8_BLOCK_KINDS = ("q4-a8", "q8-a8")  # the int8-activation kernels on the block layout
F32_BLOCK_KINDS = ("q4-f32", "q8-f32")  # the float32-activation block kernels


def max_kernel_rows(kind: str, dense_bf16: bool = False) -> int | None:
    """The most rows a step sends to a `kind` kernel (more go to the dense weight, which is
    bfloat16 when `dense_bf16`); None: every step (no dense copy)."""
    if kind in TILE_KINDS:
        return None
    rows = MAX_KERNEL_ROWS[kind]
    if kind in F32_BLOCK_KINDS and quant_gemm_cpu.simd() == "avx512f":
        return min(rows, AVX512_F32_MAX_ROWS)
    if dense_bf16 and kind in A8_BLOCK_KINDS:
        return min(rows, A8_BF16_DENSE_MAX_ROWS)
    return rows


def bf16_dense_available() -> bool:
    """Whether oneDNN runs bf16 linears natively here (AVX512-BF16 or AMX, after
    `ONEDNN_MAX_CPU_ISA`), so a bf16 dense copy outruns a float32 one."""
    from sgl_tpu.backends.torch.device import cpu_prepacks_bf16, onednn_info

    impl = onednn_info()["bf16_linear"] or ""
    return cpu_prepacks_bf16() and ("bf16" in impl or "amx" in impl)


def bf16_dense(w: torch.Tensor) -> torch.Tensor:
    """A float32 [N, K] weight -> its bf16 copy, prepacked for oneDNN."""
    return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)


def bf16_dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """f32[M, K] @ a bf16_dense weight -> f32[M, N] (+ b, in float32)."""
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w, None, "none", [], "")
    y = y.float()
    return y if b is None else y.add_(b)


class Int4Kernel:
    kind = "int4"

    def __init__(self, m: Int4Groups, dtype: torch.dtype) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(m.q.astype("int32")), 1)  # u8[N, K/2]
        sz = torch.stack([torch.from_numpy(m.scale.T.copy()),
                          torch.from_numpy(m.zero.T.copy())], dim=-1)
        self.scales_zeros = sz.to(dtype).contiguous()  # [K/G, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP,
                                                          self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int8Kernel:
    kind = "int8"

    def __init__(self, m: Int8Channels, dtype: torch.dtype) -> None:
        self.q = torch.from_numpy(m.q).contiguous()  # i8[N, K]
        self.scale = torch.from_numpy(m.scale).to(dtype)  # [N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Q4F32Kernel:
    kind = "q4-f32"

    def __init__(self, m: Int4Groups) -> None:
        self.blocks = quant_gemm_cpu.pack_q4(m.q, m.scale, m.zero)  # [N, K/G, 16] + scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # f32[M, K] -> f32[M, N]
        return quant_gemm_cpu.q4_gemm(x, self.blocks)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


class Q8F32Kernel:
    kind = "q8-f32"

    def __init__(self, m: Int8Groups) -> None:
        self.blocks = quant_gemm_cpu.pack_q8(m.q, m.scale)  # [N, K/G, 32] + scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # f32[M, K] -> f32[M, N]
        return quant_gemm_cpu.q8_gemm(x, self.blocks)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


class Q4A8Kernel(Q4F32Kernel):
    kind = "q4-a8"

    def __init__(self, m: Int4Groups) -> None:  # tiles of 16 features where the build takes them
        if quant_gemm_cpu.tiles_for(m.q.shape[0]):
            self.blocks = quant_gemm_cpu.pack_q4_tiles(m.q, m.scale, m.zero)
            self.kind = "q4-a8-t16"
        else:
            super().__init__(m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # f32[M, K] -> f32[M, N]
        return quant_gemm_cpu.q4_gemm_a8(x, self.blocks)


class Q8A8Kernel(Q8F32Kernel):
    kind = "q8-a8"

    def __init__(self, m: Int8Groups) -> None:
        if quant_gemm_cpu.tiles_for(m.q.shape[0]):
            self.blocks = quant_gemm_cpu.pack_q8_tiles(m.q, m.scale)
            self.kind = "q8-a8-t16"
        else:
            super().__init__(m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # f32[M, K] -> f32[M, N]
        return quant_gemm_cpu.q8_gemm_a8(x, self.blocks)


Kernel = Int4Kernel | Int8Kernel | Q4F32Kernel | Q8F32Kernel | Q4A8Kernel | Q8A8Kernel
F32_KINDS = (Q4F32Kernel.kind, Q8F32Kernel.kind, Q4A8Kernel.kind, Q8A8Kernel.kind, *TILE_KINDS)


def f32_kernels_available() -> bool:
    """Whether float32 activations get the compiled block kernels (else torch's ops)."""
    return quant_gemm_cpu.available()


def make_kernel(m: Int4Groups | Int8Groups | Int8Channels, dtype: torch.dtype,
                int8_activations: bool = False) -> Kernel | None:
    """The kernel for a quantized matrix, or None where none exists (Q8_0 blocks with bfloat16
    activations) or the CPU op cannot take its shape. `int8_activations` (gguf-a8): the
    float32 block kernels that quantize the activations (ValueError without them)."""
    n, k = m.q.shape
    if int8_activations:
        if dtype != torch.float32 or not f32_kernels_available():
            raise ValueError("int8 activations need float32 and the compiled CPU GEMM ("
                             f"{quant_gemm_cpu.why_unavailable() or 'dtype ' + str(dtype)})")
        if k % GROUP or not isinstance(m, Int4Groups | Int8Groups):
            return None
        return Q4A8Kernel(m) if isinstance(m, Int4Groups) else Q8A8Kernel(m)
    if dtype == torch.float32 and k % GROUP == 0 and f32_kernels_available():
        if isinstance(m, Int4Groups):
            return Q4F32Kernel(m)
        if isinstance(m, Int8Groups):
            return Q8F32Kernel(m)
    if isinstance(m, Int8Channels):
        return Int8Kernel(m, dtype)
    if isinstance(m, Int4Groups) and n % 16 == 0 and k % GROUP == 0:
        return Int4Kernel(m, dtype)
    return None


@dataclass(frozen=True)
class QuantizedLinear:
    """One projection: the kernel for up to `max_rows` rows, `dense` (the layout the runner's
    dense linear takes, or a bf16_dense copy) above, or the kernel at every M when `dense` is
    None."""

    kernel: Kernel
    dense: torch.Tensor | None
    max_rows: int | None
    dense_bf16: bool = False  # `dense` is a bf16_dense copy under float32 activations


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def dispatching_linear(dense_linear: Linear) -> Linear:
    """linear(x, w, b) taking a dense weight (-> `dense_linear`) or a QuantizedLinear."""

    def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, QuantizedLinear):
            return dense_linear(x, w, b)
        if w.dense is not None and x.shape[0] > w.max_rows:
            if w.dense_bf16:
                return bf16_dense_linear(x, w.dense, b)
            return dense_linear(x, w.dense, b)
        y = w.kernel(x)
        return y if b is None else y.add_(b)

    return linear
