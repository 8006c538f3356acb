"""Device, dtype and thread choices of the PyTorch backend.

    --device auto ─► "tpu"  when TorchTPU is importable (`torch_tpu`; device "tpu")
                     "cuda" when a CUDA device is visible
                     "cpu"  otherwise
    --dtype auto  ─► bfloat16 on tpu/cuda, and on CPUs with bf16 matrix units (AMX: oneDNN
                     runs bf16 matmuls there several times faster than float32); float32 on
                     other CPUs, AVX512-BF16 ones included: there the float32 path (the GGUF's
                     4-bit blocks on the compiled float32 kernels, a bfloat16 KV cache)
                     served the agent loop 1.27-1.61x faster than bfloat16
                     (docs/backends.md)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from sgl_tpu.backends.torch.kernels.cpu_extension import cpu_flags

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


def memory_read_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` torch sums over a `gib` GiB float32 tensor on the threads a
    server would take (`set_cpu_threads`): the rate at which a decode step can stream weights
    at best (bench.host_class records it)."""
    set_cpu_threads()
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return round(x.numel() * 4 / best / 1e9, 1)


# CPU feature flags that decide which kernels run (oneDNN's and the compiled ones)
_ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
              "amx_bf16")


def _onednn_verbose(run: Callable[[], object]) -> str:
    """oneDNN's verbose lines while `run()` runs (it prints them on file descriptor 1)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read()


@functools.cache
def onednn_info() -> dict[str, Any]:
    """What oneDNN computes with in this process: its ISA (after `ONEDNN_MAX_CPU_ISA`) and the
    implementation of a prepacked float32 and bfloat16 linear (the bf16 one is None where
    oneDNN does not take bf16: torch's own kernels run it), read from its verbose lines.
    `amx`: the bf16 GEMMs run on AMX tiles."""
    x, w = torch.randn(32, 64), torch.randn(64, 64)

    def linear(dtype: torch.dtype) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
        torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "")

    lines = _onednn_verbose(lambda: linear(torch.float32)).splitlines()
    if cpu_prepacks_bf16():
        lines += _onednn_verbose(lambda: linear(torch.bfloat16)).splitlines()
    isa = next((ln.split("isa:", 1)[1] for ln in lines if ",isa:" in ln), "unknown")
    impls = {}
    for ln in lines:  # onednn_verbose,v1,primitive,exec,cpu,<kind>,<impl>,<prop>,<src:..>,...
        fields = ln.split(",")
        if len(fields) > 8 and fields[3] == "exec" and fields[5] in ("inner_product", "matmul"):
            impls["bf16" if "src:bf16" in fields[8] else "f32"] = fields[6]
    return {"isa": isa, "max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "f32_linear": impls.get("f32"), "bf16_linear": impls.get("bf16"),
            "amx": "amx" in (impls.get("bf16") or "")}


@functools.cache
def cpu_info() -> dict[str, Any]:
    """The host's vector features, oneDNN's choice, and the flavour and vector code of each
    compiled kernel (sgl_tpu/backends/torch/kernels/cpu_extension.py) this process loads; fixed
    for the process, so read once (every `/server_info` and `/metrics` scrape reports it)."""
    from sgl_tpu.backends.torch.kernels import cpu_extension

    def describe(ext: cpu_extension.CpuExtension) -> dict[str, Any]:
        if not ext.available():
            return {"unavailable": ext.why_unavailable()}
        tile_dot = getattr(ext.module(), "tile_dot", None)  # the quantized GEMM's tiles
        return {"flavour": ext.flavour(), "simd": ext.simd(),
                **({} if tile_dot is None else {"tile_dot": tile_dot})}

    kernels = {ext.prefix: describe(ext) for ext in cpu_extension.EXTENSIONS}
    flags = cpu_flags().split()
    return {"flags": [f for f in _ISA_FLAGS if f in flags], "onednn": onednn_info(),
            "compiled_kernels": kernels}
