"""Registry of attention implementations (`--attention-backend`), per executor backend.

Import-light: names and loader names only, so the CLI and a torch process can read it without
loading JAX. Each name belongs to one executor backend and is reached through that backend's
attention module (sgl_tpu/backends/<b>/attention.py, import-light too), by module name: nothing
here imports a framework or a home (tests/test_layering.py).

    --attention-backend NAME ─resolve_attention_backend─► <b>/attention.py default_attention
                                                          (auto), check_attention (a given name)
    resolved NAME ───────────get_attention_backend──────► <b>/attention.py <loader>()
                                                          -> the AttentionBackend the runner calls

JAX implementations offer the same three functions with the reference's signatures:

    write_kv(k_pool, v_pool, k, v, slots)              -> (k_pool, v_pool)  in place if donated
    extend_attention(q, k_pool, v_pool, page_table, block_rows, block_seq, block_q_start,
                     seq_lens, item_block, item_tile, num_items, *, kv_tile, scale, ...)
    decode_attention(q, k_pool, v_pool, page_table, seq_lens, *, kv_tile, scale, ...)

`ref` is the pure-jax.numpy reference (any JAX backend); `gathered` gathers each sequence's pages
into one padded dense view and attends in a few large ops (for GPUs, where the reference's tile
loop is a long chain of small kernels); `pallas` is the Pallas TPU kernel (compiled by Mosaic,
TPU only); `pallas-interpret` is the same kernel run in TPU interpret mode (CPU; slow, for
tests). The torch backend's `torch-sdpa` gathers pages into `scaled_dot_product_attention` /
batched GEMMs; `torch-cpu-fused` is a compiled kernel walking the page table (CPU only; built
by `make install`), `torch-cpu-fused-bf16` the same kernel with bfloat16 products over a
bfloat16 KV cache where the CPU has AVX512-BF16. `ref-invariant` and
`torch-invariant` are the batch-invariant kernels of `--enable-deterministic-inference` (one
tiled path for EXTEND and DECODE; sgl_tpu/executor/batch_invariant.py). `auto` is each
backend's choice for the platform (`default_attention` of sgl_tpu/backends/{jax,torch}/
attention.py).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class AttentionSpec:
    framework: str  # "jax" or "torch": the executor backend that can run it
    loader: str  # the function of the framework's attention module that returns it


ATTENTION_BACKENDS: dict[str, AttentionSpec] = {
    "ref": AttentionSpec("jax", "ref"),
    "gathered": AttentionSpec("jax", "gathered"),
    "pallas": AttentionSpec("jax", "pallas"),
    "pallas-interpret": AttentionSpec("jax", "pallas_interpret"),
    "torch-sdpa": AttentionSpec("torch", "sdpa"),
    "torch-cpu-fused": AttentionSpec("torch", "cpu_fused"),
    "torch-cpu-fused-bf16": AttentionSpec("torch", "cpu_fused_bf16"),
    # --enable-deterministic-inference: one tiled path for EXTEND and DECODE, per query row
    "ref-invariant": AttentionSpec("jax", "ref_invariant"),
    "torch-invariant": AttentionSpec("torch", "invariant"),
}


def _home(framework: str) -> ModuleType:
    """The framework's attention module (sgl_tpu/backends/<framework>/attention.py)."""
    return importlib.import_module(f"sgl_tpu.backends.{framework}.attention")


def resolve_attention_backend(name: str, framework: str = "jax", platform: str | None = None
                              ) -> str:
    """`auto` -> the framework's default for `platform` (JAX's backend or the torch device
    type; None: JAX's default backend, a CPU for torch); a given name is checked against the
    framework and the platform."""
    if name == "auto":
        return _home(framework).default_attention(platform)
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown attention_backend {name!r}; "
                         f"choose from auto, {', '.join(ATTENTION_BACKENDS)}")
    if spec.framework != framework:
        usable = [n for n, s in ATTENTION_BACKENDS.items() if s.framework == framework]
        raise ValueError(f"attention_backend {name!r} runs on the {spec.framework} executor, "
                         f"not {framework}; choose from auto, {', '.join(usable)}")
    _home(framework).check_attention(name, platform)
    return name


@functools.cache
def get_attention_backend(name: str) -> Any:
    """The implementation of a resolved name (its home's `AttentionBackend`)."""
    spec = ATTENTION_BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown attention_backend {name!r}")
    return getattr(_home(spec.framework), spec.loader)()
