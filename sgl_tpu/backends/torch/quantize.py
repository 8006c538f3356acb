"""`--quantization` on the torch backend: the quantized form of each fused projection, and the
model weights with those projections swapped for `QuantizedLinear`s.

    gguf       read_gguf_quantized(file)        the stored Q4_x blocks, exact (and the Q8_0
                                                vocabulary head, served with float32 only)
    gguf-a8    the same blocks                  float32 only: kernels that quantize the
                                                activations to int8 per 32 values; in tiles
                                                of 16 features where the kernels have them
                                                (AVX512-VNNI, AVX-VNNI, AVX2; no dense
                                                copy), else a dense copy in bf16 where oneDNN
                                                computes bf16
    auto       gguf's or gguf-a8's blocks       auto_method: gguf-a8 with float32 activations
                                                where the kernels have the tiles, else gguf
    int8/int4  quantize_int8/int4(params)       from the loader's float32 params
                   ──quantize_weights(Weights)──► Weights whose wqkv / wo / w_gate_up / w_down
                                                  are QuantizedLinear(kernel, dense copy) and
                                                  whose `linear` dispatches on the weight type

Memory: each quantized projection keeps its dense copy for steps above the kernel's row limit
(the int kernels run 1.5-2.5x slower than bf16 at prefill sizes, see bench/quant_linear.py),
so quantization adds the kernels' bytes (about a quarter of the bf16 bytes for int4, a half
for int8) rather than saving memory; it saves memory traffic per decode step. The tiled
int8-activation kernels are the exception: they outrun bf16 (AVX512-VNNI) and dense float32
(AVX2) at every row count, so their projections keep no dense copy and the model takes the
blocks' bytes only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from sgl_tpu.backends.torch.kernels import quant_gemm_cpu
from sgl_tpu.backends.torch.quant_linear import (
    F32_KINDS,
    QuantizedLinear,
    bf16_dense,
    bf16_dense_available,
    dispatching_linear,
    make_kernel,
    max_kernel_rows,
)
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.quantization import QUANTIZATION_METHODS
from sgl_tpu.quantization.blocks import QuantizedMatrix, quantize_int4, quantize_int8
from sgl_tpu.quantization.gguf_weights import HEAD

logger = logging.getLogger(__name__)

# fused torch weight -> the loader's canonical [in, out] params stacked along out
_FUSED_PARAMS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
                 "w_down": ("w_down",)}
_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


def _fused_param(params: dict, key: str) -> np.ndarray:
    """"layers.{i}.{fused}" -> the loader's float32 params stacked like the torch weight
    [N, K]."""
    _, i, fused = key.split(".")
    lw = params["layers"][int(i)]
    return np.concatenate([np.asarray(lw[p], np.float32) for p in _FUSED_PARAMS[fused]],
                          axis=1).T


def _fused_shape(params: dict, key: str) -> tuple[int, int]:
    _, i, fused = key.split(".")
    parts = [np.shape(params["layers"][int(i)][p]) for p in _FUSED_PARAMS[fused]]  # [in, out]
    return sum(shape[1] for shape in parts), parts[0][0]


def params_keys(params: dict) -> set[str]:
    """Every fused projection's key: "layers.{i}.{fused}" (MoE layers have no dense MLP; their
    experts stay unquantized)."""
    return {f"layers.{i}.{fused}" for i, lw in enumerate(params["layers"])
            for fused, parts in _FUSED_PARAMS.items() if all(p in lw for p in parts)}


def _gguf_mismatch(matrices: dict[str, QuantizedMatrix], params: dict) -> str | None:
    """Why the file's blocks are not the runner's weights (None if they are): every shape, and
    the values of the first and last projection (decoding is bit-exact, see blocks.py)."""
    if not matrices:
        return "the file has no projections in a block format with an exact quantized form"
    keys, expected = sorted(matrices), params_keys(params)
    for key in keys:
        if key not in expected or matrices[key].q.shape != _fused_shape(params, key):
            return f"{key} does not have the loaded weights' shape"
    for key in (keys[0], keys[-1]):
        if not np.array_equal(matrices[key].dequantize(), _fused_param(params, key)):
            return f"{key} differs from the loaded weights"
    return None


def _head_matches(head: QuantizedMatrix, params: dict) -> bool:
    """Whether the file's head blocks dequantize to the loaded head [V, D] bit for bit."""
    dense = params["lm_head"].T if "lm_head" in params else params["embed"]
    if head.q.shape != np.shape(dense):
        return False
    return bool(np.array_equal(head.dequantize(), np.asarray(dense, np.float32)))


def quantized_matrices(method: str, params: dict, cfg: ModelConfig, model_path: str | None,
                       with_head: bool = False) -> dict[str, QuantizedMatrix] | None:
    """"layers.{i}.{fused}" -> quantized [N, K] matrix for every projection `method` covers.

    gguf / gguf-a8 / auto read the file at `model_path` (None: the default model) and check it
    against `params`; a mismatch is a ValueError for gguf(-a8), and None (dense) for auto. They
    add the file's vocabulary head under HEAD ([V, D]) when `with_head` (float32 activations:
    only the float32 kernels serve it), it is a block format and it equals the loaded head
    (else the head stays dense; the check dequantizes the whole head, so it runs only when
    asked)."""
    if method in ("gguf", "gguf-a8", "auto"):
        from sgl_tpu.loader import resolve_model_path
        from sgl_tpu.quantization.gguf_weights import read_gguf_quantized

        path = resolve_model_path(model_path)
        head = None
        try:
            matrices = read_gguf_quantized(path, cfg)
            head = matrices.pop(HEAD, None)
            problem = _gguf_mismatch(matrices, params)
        except ValueError as e:  # e.g. rows that do not split into cfg's heads
            matrices, problem = {}, str(e)
        if problem is None:
            if with_head and head is not None and _head_matches(head, params):
                matrices[HEAD] = head
            return matrices
        if method != "auto":
            raise ValueError(f"--quantization {method}: {path}: {problem}")
        logger.info("quantization auto -> none: %s: %s", path, problem)
        return None
    quantize = _QUANTIZERS[method]
    return {key: quantize(np.ascontiguousarray(_fused_param(params, key)))
            for key in sorted(params_keys(params))}


def auto_method(dtype: torch.dtype) -> str:
    """What `auto` serves a GGUF's blocks with: llama.cpp's math (int8 activations, gguf-a8)
    where the activations are float32 and the kernels have the int8-activation tiles
    (`quant_gemm_cpu.tile_dot()`: AVX512-VNNI, AVX-VNNI or AVX2), each measured faster than the
    exact float32 kernels at 1 and 8 rows on both model sizes (AVX512-VNNI 1.7-2.3x; AVX2 and
    AVX-VNNI builds 1.4-7x a decode step's GEMMs, docs/quantization.md); else the exact gguf."""
    a8 = dtype == torch.float32 and quant_gemm_cpu.tile_dot() != ""
    return "gguf-a8" if a8 else "gguf"


@dataclass(frozen=True)
class QuantizationReport:
    method: str
    quantized: int  # projections served by a kernel
    dense_only: int  # projections left dense (no exact form, or a shape the kernel refuses)
    kernel_bytes: int  # memory the kernels add beside the dense weights
    kernels: tuple[str, ...] = ()  # the projections' kernel kinds (quant_linear.py)
    head: str | None = None  # the vocabulary head's kernel kind; None: dense
    # what steps above the kernels' rows run: "activation dtype" (the dense weights),
    # "bfloat16" (a bf16 dense copy), "none" (no copy: the kernels take every step)
    dense: str = "activation dtype"

    def max_rows(self) -> dict[str, int | None]:
        return {k: max_kernel_rows(k, self.dense == "bfloat16") for k in self.kernels}

    def row_limit(self) -> int | None:
        """The most rows a step runs on the kernels alone (more switch some projection, or the
        head, to its dense copy: other bits); None: any."""
        rows = [*self.max_rows().values(),
                None if self.head is None else max_kernel_rows(self.head)]
        return min((r for r in rows if r is not None), default=None)

    def info(self) -> dict:
        """`/server_info` `compute.quantization`."""
        return {"method": self.method, "kernels": list(self.kernels), "head": self.head,
                "max_kernel_rows": self.max_rows(), "simd": quant_gemm_cpu.simd(),
                "vnni": quant_gemm_cpu.vnni(), "tile_dot": quant_gemm_cpu.tile_dot(),
                "dense": self.dense}

    def log_line(self) -> str:
        desc = QUANTIZATION_METHODS[self.method].description
        kinds = "/".join(self.kernels) or "no"
        rows = ", ".join(f"{k} <= {n}" if n else f"{k} every step"
                         for k, n in self.max_rows().items())
        head = f"vocabulary head on {self.head}" if self.head else "vocabulary head dense"
        dense = {"none": "no dense copy", "bfloat16": "bf16 dense copy above"}.get(
            self.dense, "dense copy above")
        where = "in place of" if self.dense == "none" else "beside"
        return (f"quantization {self.method} ({desc}): {self.quantized} projections on {kinds} "
                f"kernels ({rows or 'none'}; {dense}), {head} "
                f"({self.kernel_bytes / 2**20:.0f} MiB of blocks {where} the dense weights), "
                f"{self.dense_only} dense only")


def quantize_weights(weights, matrices: dict[str, QuantizedMatrix], method: str,
                     dtype: torch.dtype):
    """llama_torch.Weights -> (the same with QuantizedLinear projections, QuantizationReport).

    The vocabulary head (matrices[HEAD]) is swapped only for a float32 kernel: with bfloat16
    it has no exact kernel (quant_linear.py). gguf-a8 takes the int8-activation kernels, and
    a bf16 dense copy where oneDNN computes bf16 natively (it replaces the float32 one)."""
    int8_activations = method == "gguf-a8"
    dense_bf16 = int8_activations and bf16_dense_available()
    layers, done, dense_only, nbytes, kinds, copies = [], 0, 0, 0, [], 0
    for i, lw in enumerate(weights.layers):
        changes = {}
        for fused in _FUSED_PARAMS:
            m = matrices.get(f"layers.{i}.{fused}")
            kernel = None if m is None else make_kernel(m, dtype, int8_activations)
            if kernel is None:
                dense_only += 1
                continue
            rows = max_kernel_rows(kernel.kind, dense_bf16)
            dense = None if rows is None else getattr(lw, fused)
            if dense is not None and dense_bf16:
                dense = bf16_dense(dense)
            changes[fused] = QuantizedLinear(kernel, dense, rows,
                                             dense_bf16 and dense is not None)
            copies += dense is not None
            done += 1
            nbytes += kernel.nbytes
            if kernel.kind not in kinds:
                kinds.append(kernel.kind)
        layers.append(dataclasses.replace(lw, **changes))
    top: dict = {"layers": layers, "linear": dispatching_linear(weights.linear)}
    head = matrices.get(HEAD)
    head_kernel = None if head is None else make_kernel(head, dtype, int8_activations)
    if head_kernel is not None and head_kernel.kind in F32_KINDS:
        rows = max_kernel_rows(head_kernel.kind)
        top["lm_head"] = QuantizedLinear(head_kernel, None if rows is None else weights.lm_head,
                                         rows)
        nbytes += head_kernel.nbytes
    if dtype == torch.float32 and "int4" in kinds:
        logger.warning("quantization %s: float32 activations on torch's int4 op, measured ~8x "
                       "slower than dense float32 on AVX2 (the compiled block kernels: %s)",
                       method, quant_gemm_cpu.why_unavailable())
    dense_form = ("none" if done and not copies
                  else "bfloat16" if dense_bf16 and copies else "activation dtype")
    report = QuantizationReport(method, done, dense_only, nbytes, tuple(kinds),
                                head_kernel.kind if "lm_head" in top else None, dense_form)
    logger.info(report.log_line())
    return dataclasses.replace(weights, **top), report
