"""`--enable-deterministic-inference` on CPUs: the model's projections and vocabulary head on
the fixed-reduction-order GEMM (backends/torch/kernels/invariant_gemm_cpu.py) instead of oneDNN.

oneDNN chooses its bf16 GEMM kernel per call by row count and ISA; on CPUs with AMX a row's
result moved with its batch mates, so the flag's promise (tokens independent of the batch,
the chunking and the cache) did not hold there. Each projection is packed once into the
kernel's panels; `linear` applies them (rounded to the activations' dtype as oneDNN does) and
the head returns float32 logits, exact float32 sums of the bf16 products, so the model's
top-candidate refinement (llama_torch.LlamaTorch.logits) has nothing to do.
"""

from __future__ import annotations

import dataclasses

from sgl_tpu.backends.torch.kernels import invariant_gemm_cpu
from sgl_tpu.backends.torch.models.llama import Weights

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def require_kernel() -> None:
    """ValueError naming the fix when the compiled kernel is missing (the flag would not
    hold without it)."""
    if not invariant_gemm_cpu.available():
        raise ValueError("--enable-deterministic-inference on a CPU needs the fixed-order GEMM: "
                         + invariant_gemm_cpu.why_unavailable())


def invariant_weights(weights: Weights) -> Weights:
    """Plain (unpacked, unquantized) [N, K] projections -> PackedWeights, `linear` -> the
    kernel's, the head -> a float32-output PackedWeight of `head_rows`."""
    layers = [dataclasses.replace(lw, **{name: invariant_gemm_cpu.pack(getattr(lw, name))
                                         for name in PROJECTIONS
                                         if getattr(lw, name) is not None})
              for lw in weights.layers]
    return dataclasses.replace(
        weights, layers=layers, linear=invariant_gemm_cpu.linear,
        lm_head=invariant_gemm_cpu.pack(weights.head_rows, float_output=True))
