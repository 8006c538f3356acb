"""Registry of attention implementations: the model calls whichever one the config names.

Every backend offers the same three functions with the reference's signatures:

    write_kv(k_pool, v_pool, k, v, slots)              -> (k_pool, v_pool)  in place if donated
    extend_attention(q, k_pool, v_pool, page_table, block_rows, block_seq, block_q_start,
                     seq_lens, item_block, item_tile, num_items, *, kv_tile, scale, ...)
    decode_attention(q, k_pool, v_pool, page_table, seq_lens, *, kv_tile, scale, ...)

`ref` is the pure-jax.numpy reference (any JAX backend); `pallas` is the Pallas TPU kernel
(compiled by Mosaic, TPU only); `pallas-interpret` is the same kernel run in TPU interpret mode
(CPU; slow, for tests). `auto` picks `pallas` when JAX's default backend is a TPU, else `ref`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from sgl_tpu.kernels import paged_attention_ref as ref
from sgl_tpu.kernels import ragged_paged_attention as rpa


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    extend_attention: Callable
    decode_attention: Callable


def _pallas(name: str, interpret: rpa.Interpret) -> AttentionBackend:
    return AttentionBackend(
        name=name,
        write_kv=functools.partial(rpa.write_kv, interpret=interpret),
        extend_attention=functools.partial(rpa.extend_attention, interpret=interpret),
        decode_attention=functools.partial(rpa.decode_attention, interpret=interpret),
    )


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "ref": AttentionBackend("ref", ref.write_kv, ref.extend_attention, ref.decode_attention),
    "pallas": _pallas("pallas", interpret=None),
    "pallas-interpret": _pallas("pallas-interpret", interpret="tpu"),
}


def resolve_attention_backend(name: str, platform: str | None = None) -> str:
    """`auto` -> `pallas` on TPU, `ref` elsewhere; other names are returned checked."""
    if name == "auto":
        if platform is None:
            import jax

            platform = jax.default_backend()
        return "pallas" if platform == "tpu" else "ref"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"choose from auto, {', '.join(ATTENTION_BACKENDS)}")
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    return ATTENTION_BACKENDS[resolve_attention_backend(name)]
