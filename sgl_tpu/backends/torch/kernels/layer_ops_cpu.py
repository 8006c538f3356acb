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

`load()` returns the compiled module or None (not built: backends/torch/models/llama.py then runs
the torch ops); `why_unavailable()` says why. CPU only: other devices never call these.
"""

from __future__ import annotations

from types import ModuleType

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
