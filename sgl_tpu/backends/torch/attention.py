"""The torch backend's attention implementations (the names of `sgl_tpu.kernels.backends`):
each loader returns the module that implements `write_kv`, `extend_attention` and
`decode_attention` over the token-major pool.

    torch-sdpa        kernels/paged_attention_torch.py: gathered pages into
                      `scaled_dot_product_attention` / batched GEMMs (any device)
    torch-cpu-fused   backends/torch/kernels/paged_attention_cpu.py: a compiled kernel walking
                      the page table (CPU; built by `make install`)
    torch-invariant   kernels/batch_invariant_torch.py: `--enable-deterministic-inference`
"""

from __future__ import annotations

import logging
from types import ModuleType

logger = logging.getLogger(__name__)


def sdpa() -> ModuleType:
    from sgl_tpu.kernels import paged_attention_torch

    return paged_attention_torch


def cpu_fused() -> ModuleType:
    from sgl_tpu.backends.torch.kernels import cpu_extension, paged_attention_cpu

    if cpu_extension.load() is None:
        raise RuntimeError(f"attention_backend 'torch-cpu-fused': "
                           f"{cpu_extension.why_unavailable()}")
    return paged_attention_cpu


def invariant() -> ModuleType:
    from sgl_tpu.kernels import batch_invariant_torch

    return batch_invariant_torch


def default_attention(device_type: str | None) -> str:
    """`auto`: `torch-cpu-fused` on a CPU (None: a CPU) when its compiled module loads, else
    `torch-sdpa` (with one log line saying why); `torch-sdpa` on other devices."""
    if device_type not in (None, "cpu"):
        return "torch-sdpa"
    from sgl_tpu.backends.torch.kernels import cpu_extension

    if cpu_extension.load() is None:
        logger.warning("attention_backend auto: torch-sdpa, not torch-cpu-fused (%s)",
                       cpu_extension.why_unavailable())
        return "torch-sdpa"
    return "torch-cpu-fused"


def check_attention(name: str, device_type: str | None) -> None:
    """ValueError when `name` cannot run here: `torch-cpu-fused` off a CPU, or not built."""
    if name != "torch-cpu-fused":
        return
    if device_type not in (None, "cpu"):
        raise ValueError(f"attention_backend 'torch-cpu-fused' runs on a CPU only, not "
                         f"{device_type}; choose auto or torch-sdpa")
    from sgl_tpu.backends.torch.kernels import cpu_extension

    if cpu_extension.load() is None:
        raise ValueError(f"attention_backend 'torch-cpu-fused': "
                         f"{cpu_extension.why_unavailable()}")
