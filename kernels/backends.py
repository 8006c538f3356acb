"""Registry of attention implementations (`--attention-backend`), per executor framework.

Import-light: names and lazy loaders only, so the CLI and a torch process can read it without
loading JAX. `get_attention_backend(name)` imports the implementation on first use.

JAX backends offer the same three functions with the reference's signatures:

    write_kv(k_pool, v_pool, k, v, slots)              -> (k_pool, v_pool)  in place if donated
    extend_attention(q, k_pool, v_pool, page_table, block_rows, block_seq, block_q_start,
                     seq_lens, item_block, item_tile, num_items, *, kv_tile, scale, ...)
    decode_attention(q, k_pool, v_pool, page_table, seq_lens, *, kv_tile, scale, ...)

`ref` is the pure-jax.numpy reference (any JAX backend); `gathered` gathers each sequence's pages
into one padded dense view and attends in a few large ops (for GPUs, where the reference's tile
loop is a long chain of small kernels); `pallas` is the Pallas TPU kernel
(compiled by Mosaic, TPU only); `pallas-interpret` is the same kernel run in TPU interpret mode
(CPU; slow, for tests). The torch backend's `torch-sdpa` is `paged_attention_torch` (gathered
pages into `scaled_dot_product_attention` / batched GEMMs); `torch-cpu-fused` is
`paged_attention_cpu` (a compiled kernel walking the page table, CPU only; built by
`make install`, see cpu_extension.py). `ref-invariant` and
`torch-invariant` are the batch-invariant kernels of `--enable-deterministic-inference` (one
tiled path for EXTEND and DECODE; sgl_tpu/executor/batch_invariant.py). `auto` picks
`pallas` for JAX on a TPU, `gathered` on a GPU, else `ref`; for torch `torch-cpu-fused` on a
CPU when its compiled module loads (else `torch-sdpa`, with one log line saying why),
`torch-sdpa` elsewhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    """A JAX attention implementation (what `get_attention_backend` returns for jax names)."""

    name: str
    write_kv: Callable
    extend_attention: Callable
    decode_attention: Callable
    # True: the cost grows with the page-table width (not with the tokens in use), so the runner
    # cuts page tables to a width bucket per step (`RunnerConfig.page_buckets`).
    bucket_page_table: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    framework: str  # "jax" or "torch": the executor backend that can run it
    load: Callable[[], Any]  # imports the implementation


def _ref() -> AttentionBackend:
    from sgl_tpu.kernels import paged_attention_ref as ref

    return AttentionBackend("ref", ref.write_kv, ref.extend_attention, ref.decode_attention)


def _gathered() -> AttentionBackend:
    from sgl_tpu.kernels import paged_attention_gathered as gathered

    return AttentionBackend("gathered", gathered.write_kv, gathered.extend_attention,
                            gathered.decode_attention, bucket_page_table=True)


def _pallas(name: str, interpret: str | None) -> AttentionBackend:
    from sgl_tpu.kernels import ragged_paged_attention as rpa

    return AttentionBackend(
        name=name,
        write_kv=functools.partial(rpa.write_kv, interpret=interpret),
        extend_attention=functools.partial(rpa.extend_attention, interpret=interpret),
        decode_attention=functools.partial(rpa.decode_attention, interpret=interpret),
    )


def _ref_invariant() -> AttentionBackend:
    from sgl_tpu.kernels import batch_invariant_ref as inv
    from sgl_tpu.kernels import paged_attention_ref as ref

    return AttentionBackend("ref-invariant", ref.write_kv, inv.extend_attention,
                            inv.decode_attention)


def _torch_invariant() -> Any:
    from sgl_tpu.kernels import batch_invariant_torch

    return batch_invariant_torch


def _torch_sdpa() -> Any:
    from sgl_tpu.kernels import paged_attention_torch

    return paged_attention_torch


def _torch_cpu_fused() -> Any:
    from sgl_tpu.kernels import cpu_extension, paged_attention_cpu

    if cpu_extension.load() is None:
        raise RuntimeError(f"attention_backend 'torch-cpu-fused': "
                           f"{cpu_extension.why_unavailable()}")
    return paged_attention_cpu


ATTENTION_BACKENDS: dict[str, AttentionSpec] = {
    "ref": AttentionSpec("jax", _ref),
    "gathered": AttentionSpec("jax", _gathered),
    "pallas": AttentionSpec("jax", functools.partial(_pallas, "pallas", None)),
    "pallas-interpret": AttentionSpec("jax", functools.partial(_pallas, "pallas-interpret",
                                                               "tpu")),
    "torch-sdpa": AttentionSpec("torch", _torch_sdpa),
    "torch-cpu-fused": AttentionSpec("torch", _torch_cpu_fused),
    # --enable-deterministic-inference: one tiled path for EXTEND and DECODE, per query row
    "ref-invariant": AttentionSpec("jax", _ref_invariant),
    "torch-invariant": AttentionSpec("torch", _torch_invariant),
}


def resolve_attention_backend(name: str, framework: str = "jax", platform: str | None = None
                              ) -> str:
    """`auto` -> the framework's default (`pallas` for JAX on a TPU, `gathered` on a GPU, `ref`
    elsewhere; `torch-cpu-fused` for torch on a CPU when built, else `torch-sdpa`); a given name
    is checked against the framework. `platform`: JAX's backend or the torch device type (None:
    JAX's default backend; a CPU for torch)."""
    if name == "auto":
        if framework == "torch":
            if platform not in (None, "cpu"):
                return "torch-sdpa"
            from sgl_tpu.kernels import cpu_extension

            if cpu_extension.load() is None:
                _log_fallback(cpu_extension.why_unavailable())
                return "torch-sdpa"
            return "torch-cpu-fused"
        if platform is None:
            import jax

            platform = jax.default_backend()
        return {"tpu": "pallas", "gpu": "gathered"}.get(platform, "ref")
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown attention_backend {name!r}; "
                         f"choose from auto, {', '.join(ATTENTION_BACKENDS)}")
    if spec.framework != framework:
        usable = [n for n, s in ATTENTION_BACKENDS.items() if s.framework == framework]
        raise ValueError(f"attention_backend {name!r} runs on the {spec.framework} executor, "
                         f"not {framework}; choose from auto, {', '.join(usable)}")
    if name == "torch-cpu-fused":
        if platform not in (None, "cpu"):
            raise ValueError(f"attention_backend 'torch-cpu-fused' runs on a CPU only, not "
                             f"{platform}; choose auto or torch-sdpa")
        from sgl_tpu.kernels import cpu_extension

        if cpu_extension.load() is None:
            raise ValueError(f"attention_backend 'torch-cpu-fused': "
                             f"{cpu_extension.why_unavailable()}")
    return name


def _log_fallback(why: str) -> None:
    logger.warning("attention_backend auto: torch-sdpa, not torch-cpu-fused (%s)", why)


@functools.cache
def get_attention_backend(name: str) -> Any:
    """The implementation of a resolved name (an AttentionBackend for JAX names, the module for
    torch ones)."""
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown attention_backend {name!r}")
    return spec.load()
