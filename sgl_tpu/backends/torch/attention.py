"""The torch backend's attention (its names in sgl_tpu/executor/attention_registry.py): each
loader bundles one implementation of paged_attention.py into the `AttentionBackend` the runner
calls, over the token-major pool.

    torch-sdpa        gathered pages into `scaled_dot_product_attention` / batched GEMMs (any
                      device)
    torch-cpu-fused   a compiled kernel walking the page table (CPU; the C++ source in
                      kernels/csrc, built by `make install`)
    torch-cpu-fused-bf16  the same kernel, over a bfloat16 KV cache on a CPU with AVX512-BF16
                      multiplying bfloat16 pairs (`vdpbf16ps`) in its row-tiled items
    torch-invariant   `--enable-deterministic-inference`: one tiled path for EXTEND and DECODE

Import-light (no torch until a loader runs), so the registry can resolve names in any process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    """What the runner calls: the step description it builds (an `ExtendSeq` per sequence over
    `context_slots`, one `DecodeBatch`) and the KV write and the two attention functions."""

    name: str
    write_kv: Callable
    extend_attention: Callable
    decode_attention: Callable
    ExtendSeq: type
    DecodeBatch: type
    context_slots: Callable
    # decode_attention is the compiled kernel's (paged_attention_cpu.cpp `decode`), with these
    # bf16_dots: a decode layer loop may call the kernel itself (layer_ops_cpu.DecodeLayers)
    compiled_decode: bool = False
    bf16_dots: bool = False


def _backend(name: str, extend_attention: Callable, decode_attention: Callable,
             decode_batch: type, **compiled: bool) -> AttentionBackend:
    from sgl_tpu.backends.torch import paged_attention as pa

    return AttentionBackend(name, pa.write_kv, extend_attention, decode_attention, pa.ExtendSeq,
                            decode_batch, pa.context_slots, **compiled)


def sdpa() -> AttentionBackend:
    from sgl_tpu.backends.torch import paged_attention as pa

    return _backend("torch-sdpa", pa.extend_attention, pa.decode_attention, pa.DecodeBatch)


def cpu_fused(name: str = "torch-cpu-fused", bf16_dots: bool = False) -> AttentionBackend:
    from sgl_tpu.backends.torch import paged_attention as pa
    from sgl_tpu.backends.torch.kernels import cpu_extension

    if cpu_extension.load() is None:
        raise RuntimeError(f"attention_backend {name!r}: {cpu_extension.why_unavailable()}")
    return _backend(name, partial(pa.fused_extend_attention, bf16_dots=bf16_dots),
                    partial(pa.fused_decode_attention, bf16_dots=bf16_dots),
                    pa.FusedDecodeBatch, compiled_decode=True, bf16_dots=bf16_dots)


def cpu_fused_bf16() -> AttentionBackend:
    return cpu_fused("torch-cpu-fused-bf16", bf16_dots=True)


def products(name: str, kv_dtype: str) -> str:
    """The dtype attention `name` multiplies in over a KV cache of `kv_dtype` (/server_info):
    "bfloat16" where torch-cpu-fused-bf16 takes bfloat16 pairs, "int8" where the compiled
    kernel reads an int8 pool (int8 queries times the int8 keys; P @ V in float32), else
    "float32" (narrower pools are widened)."""
    fused = name in ("torch-cpu-fused", "torch-cpu-fused-bf16")
    if not (fused and kv_dtype == "int8") and not (name == "torch-cpu-fused-bf16"
                                                   and kv_dtype == "bfloat16"):
        return "float32"
    from sgl_tpu.backends.torch.kernels import cpu_extension

    ext = cpu_extension.load()
    if ext is None:
        return "float32"
    return "int8" if kv_dtype == "int8" else "bfloat16" if ext.bf16_dots else "float32"


def invariant() -> AttentionBackend:
    from sgl_tpu.backends.torch import paged_attention as pa

    return _backend("torch-invariant", pa.invariant_extend_attention,
                    pa.invariant_decode_attention, pa.DecodeBatch)


def default_attention(device_type: str | None) -> str:
    """`auto`: on a CPU (None: a CPU) the compiled kernel when its module loads,
    `torch-cpu-fused-bf16` where the build has AVX512-BF16 (bfloat16 products over a bfloat16
    KV cache, float32 ones over other pools), else `torch-cpu-fused`; `torch-sdpa` when the
    module is missing (with one log line saying why) and on other devices."""
    if device_type not in (None, "cpu"):
        return "torch-sdpa"
    from sgl_tpu.backends.torch.kernels import cpu_extension

    ext = cpu_extension.load()
    if ext is None:
        logger.warning("attention_backend auto: torch-sdpa, not torch-cpu-fused (%s)",
                       cpu_extension.why_unavailable())
        return "torch-sdpa"
    return "torch-cpu-fused-bf16" if ext.bf16_dots else "torch-cpu-fused"


def check_attention(name: str, device_type: str | None) -> None:
    """ValueError when `name` cannot run here: `torch-cpu-fused` (or -bf16) off a CPU, or not
    built."""
    if name not in ("torch-cpu-fused", "torch-cpu-fused-bf16"):
        return
    if device_type not in (None, "cpu"):
        raise ValueError(f"attention_backend {name!r} runs on a CPU only, not "
                         f"{device_type}; choose auto or torch-sdpa")
    from sgl_tpu.backends.torch.kernels import cpu_extension

    if cpu_extension.load() is None:
        raise ValueError(f"attention_backend {name!r}: {cpu_extension.why_unavailable()}")
