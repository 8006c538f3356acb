"""Device, dtype and thread choices of the PyTorch backend.

    --device auto ─► "tpu"  when TorchTPU is importable (`torch_tpu`; device "tpu")
                     "cuda" when a CUDA device is visible
                     "cpu"  otherwise
    --dtype auto  ─► bfloat16 on tpu/cuda, and on CPUs with bf16 matrix units (AMX: oneDNN
                     runs bf16 matmuls there several times faster than float32); float32 on
                     other CPUs, AVX512-BF16 ones included: there the float32 path (the GGUF's
                     4-bit blocks on the compiled float32 kernels, a bfloat16 KV cache)
                     served the agent loop 1.27-1.61x faster than bfloat16 (README,
                     "Executor backends")
"""

from __future__ import annotations

import importlib.util
import os

import torch

from sgl_tpu.kernels.cpu_extension import cpu_flags

_CPU_BF16_FLAGS = ("amx_bf16",)


def resolve_device(device: str) -> torch.device:
    """`device` is "auto", a type ("cpu", "cuda", "tpu") or a type with an index ("cuda:1",
    one tensor-parallel rank's device)."""
    if device == "auto":
        if importlib.util.find_spec("torch_tpu") is not None:
            device = "tpu"
        elif torch.cuda.is_available():
            device = "cuda"
        else:
            device = "cpu"
    kind = device.partition(":")[0]
    if kind == "tpu":
        if importlib.util.find_spec("torch_tpu") is None:
            raise ValueError("--device tpu needs TorchTPU (the torch_tpu package)")
        import torch_tpu  # noqa: F401  (registers the "tpu" device)
    elif kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to PyTorch")
    return torch.device(device)


def cpu_has_bf16_units() -> bool:
    """Whether the CPU has bf16 matrix units (AMX), where `--dtype auto` is bfloat16."""
    flags = cpu_flags().split()
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def cpu_prepacks_bf16() -> bool:
    """Whether oneDNN can prepack bf16 linear weights on this CPU (it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; on AVX2-only CPUs bf16 weights stay plain tensors for `F.linear`)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def default_dtype(device: str) -> str:
    dev = resolve_device(device)
    if dev.type != "cpu" or cpu_has_bf16_units():
        return "bfloat16"
    return "float32"


def set_cpu_threads(num_threads: int = 0) -> int:
    """Intra-op threads = `num_threads`, or (0) the CPUs this process may run on; one inter-op
    thread. Set once, at start: the count is never switched between steps. Returns it."""
    n = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set once in this process
            pass
    return n
