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

A decode step's whole layer loop also runs as one call where every projection is a tile kernel
of quant_gemm_cpu.py and attention is the compiled `torch-cpu-fused` kernel (`decode_layers`,
used by LlamaTorch.forward_fused): the same kernels in the same order, no Python between them,
the GIL released while they run.

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


def _tiles(w: Any) -> list[torch.Tensor] | None:
    """A projection's tiles as DecodeLayers takes them, (qt, st, mt) with an empty mt for Q8
    tiles; None unless it is a tile kernel at every row count."""
    from sgl_tpu.backends.torch.quant_linear import TILE_KINDS, QuantizedLinear

    if not isinstance(w, QuantizedLinear) or w.dense is not None or w.kernel.kind not in TILE_KINDS:
        return None
    tiles = w.kernel.blocks
    return [tiles.qt, tiles.st, getattr(tiles, "mt", _EMPTY)]


def decode_layers(layers: list[Any], kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
                  final_norm: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                  scale: float, bf16_dots: bool) -> Any | None:
    """The compiled layer loop (`DecodeLayers`, csrc/layer_ops_cpu.cpp) over llama.LayerWeights,
    or None where it cannot run them: a module not built, a projection not a tile kernel or
    with a bias."""
    from sgl_tpu.backends.torch.kernels import cpu_extension, quant_gemm_cpu

    ops, attention = load(), cpu_extension.load()
    if ops is None or attention is None or not quant_gemm_cpu.available():
        return None
    gemm = quant_gemm_cpu.kernel_module()
    kernels = (getattr(gemm, "q4_gemm_a8_tiles_fn", None),
               getattr(gemm, "q8_gemm_a8_tiles_fn", None), getattr(attention, "decode_fn", None))
    if any(k is None for k in kernels):
        return None
    tensors = []
    for w in layers:
        if w.bqkv is not None:
            return None
        tiles = [_tiles(p) for p in (w.wqkv, w.wo, w.w_gate_up, w.w_down)]
        if any(t is None for t in tiles):
            return None
        norms = [_EMPTY, _EMPTY] if w.q_norm is None else [w.q_norm, w.k_norm]
        tensors.append([w.attn_norm, w.mlp_norm, *norms, *(t for ts in tiles for t in ts)])
    return ops.DecodeLayers(tensors, [k for k, _ in kv_pools], [v for _, v in kv_pools],
                            final_norm, kernels, num_heads, num_kv_heads, eps, scale, bf16_dots)
