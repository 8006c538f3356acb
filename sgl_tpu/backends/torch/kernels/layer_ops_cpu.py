"""Fused per-layer element-wise ops for the torch backend's eager CPU decoder
(csrc/layer_ops_cpu.cpp, built at install time by cpu_extension.py).

Eager PyTorch runs a decoder layer's small element-wise steps as separate ops, each with its
dispatch, its temporaries and its dtype conversions: an RMSNorm is ~7 ops, RoPE on q and k ~6,
the K/V write 2, SwiGLU 3 (~4 ms of a 35 ms batch-1 step of the default model on a 2-core
CPU). These ops do each group in one pass over the rows, in float32 or bfloat16 (float32
arithmetic, one rounding per stored value):

    rms_norm(x [T, n], w f32[n], eps)                  -> y [T, n]
    add_rms_norm(h [T, n], delta [T, n], w, eps)       -> y; h += delta in place (the residual)
    rope_write_kv(qkv [T, (H + 2 kvh) d], cos, sin f32[T, 1, d], k_pool, v_pool [S, kvh, d],
                  out_slots i64[T], H, kvh,            RoPE on qkv's q and k heads in place
                  q_norm, k_norm f32[d] | None, eps)   (each head RMSNormed first when the norms
                                                       are given: Qwen3), then k and v rows into
                                                       their pool slots
    silu_mul(gate_up [T, 2F])                          -> [T, F] = silu(gate) * up

A decode step's whole layer loop also runs as one call where every projection is a block
kernel of quant_gemm_cpu.py of one family (the int8-activation tiles of AVX512-VNNI builds, the
int8-activation blocks or the float32 ones; the blocks up to their row limit) and attention is
the compiled `torch-cpu-fused` kernel (`decode_layers`, used by LlamaTorch.forward_fused): the
same kernels in the same order, no Python between them, the GIL released while they run.

`load()` returns the compiled module or None (not built: backends/torch/models/llama.py then runs
the torch ops); `why_unavailable()` says why. CPU only: other devices never call these.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from sgl_tpu.backends.torch.kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)


def load() -> ModuleType | None:
    return cpu_extension.load_extension(cpu_extension.LAYER_OPS)[0]


def why_unavailable() -> str:
    return cpu_extension.load_extension(cpu_extension.LAYER_OPS)[1]


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` can run these ops (CPU, float32/bf16, built)."""
    return device.type == "cpu" and dtype in DTYPES and load() is not None


_EMPTY = torch.empty(0)


# DecodeLayers' kernel families: the quant_gemm_cpu capsules of their Q4 and Q8 kernels
_FAMILIES = {"tiles": ("q4_gemm_a8_tiles_fn", "q8_gemm_a8_tiles_fn"),
             "a8": ("q4_gemm_a8_fn", "q8_gemm_a8_fn"), "f32": ("q4_gemm_fn", "q8_gemm_fn")}


def _projection(w: Any) -> tuple[str, list[torch.Tensor], int | None] | None:
    """A projection as DecodeLayers takes it: its kernel family (`_FAMILIES`), its three
    tensors (codes, scales, and mins or zeros; an empty third for Q8) and the most rows its
    kernel takes (None: any); None unless it runs on one of those kernels."""
    from sgl_tpu.backends.torch import quant_linear as ql

    if not isinstance(w, ql.QuantizedLinear):
        return None
    kind, blocks = w.kernel.kind, getattr(w.kernel, "blocks", None)
    if kind in ql.TILE_KINDS and w.dense is None:
        return "tiles", [blocks.qt, blocks.st, getattr(blocks, "mt", _EMPTY)], None
    for family, kinds in (("a8", ql.A8_BLOCK_KINDS), ("f32", ql.F32_BLOCK_KINDS)):
        if kind in kinds:
            return family, [blocks.qs, blocks.scale, getattr(blocks, "zero", _EMPTY)], w.max_rows
    return None


def decode_layers(layers: list[Any], kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                  final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                  scale: float, bf16_dots: bool) -> tuple[Any, int | None] | None:
    """The compiled layer loop (`DecodeLayers`, csrc/layer_ops_cpu.cpp) over llama.LayerWeights
    and the most rows a step may give it (None: any; above, the block kernels' projections take
    their dense copies, which the loop does not), or None where it cannot run them: a module
    not built, a projection on none of the families' kernels, kernels of two families, a
    bias."""
    from sgl_tpu.backends.torch.kernels import cpu_extension, quant_gemm_cpu

    ops, attention = load(), cpu_extension.load()
    if ops is None or attention is None or not quant_gemm_cpu.available():
        return None
    tensors, families, limits = [], set(), []
    for w in layers:
        if w.bqkv is not None:
            return None
        projections = [_projection(p) for p in (w.wqkv, w.wo, w.w_gate_up, w.w_down)]
        if any(p is None for p in projections):
            return None
        families.update(family for family, _, _ in projections)
        limits += [rows for _, _, rows in projections if rows is not None]
        norms = [_EMPTY, _EMPTY] if w.q_norm is None else [w.q_norm, w.k_norm]
        tensors.append([w.attn_norm, w.mlp_norm, *norms,
                        *(t for _, ts, _ in projections for t in ts)])
    if len(families) != 1:
        return None
    gemm = quant_gemm_cpu.kernel_module()
    kernels = (*(getattr(gemm, name, None) for name in _FAMILIES[families.pop()]),
               getattr(attention, "decode_fn", None))
    if any(k is None for k in kernels):
        return None
    loop = ops.DecodeLayers(tensors, [k for k, _ in kv_pools], [v for _, v in kv_pools],
                            final_norm, kernels, num_heads, num_kv_heads, eps, scale, bf16_dots)
    return loop, min(limits, default=None)
