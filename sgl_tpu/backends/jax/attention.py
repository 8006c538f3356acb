"""The JAX backend's attention (its names in sgl_tpu/executor/attention_registry.py): each loader
returns an `AttentionBackend` over one implementation.

    ref               kernels/paged_attention_ref.py: pure jax.numpy (any platform; the oracle)
    gathered          paged_attention_gathered.py (this home): a dense gathered view (GPUs)
    pallas            kernels/ragged_paged_attention.py: the Pallas TPU kernel (Mosaic, TPU only)
    pallas-interpret  the same kernel in TPU interpret mode (CPU; slow, for tests)
    ref-invariant     kernels/batch_invariant_ref.py: `--enable-deterministic-inference`

All share the reference's signatures and head-major pool:

    write_kv(k_pool, v_pool, k, v, slots)              -> (k_pool, v_pool)  in place if donated
    extend_attention(q, k_pool, v_pool, page_table, block_rows, block_seq, block_q_start,
                     seq_lens, item_block, item_tile, num_items, *, kv_tile, scale, ...)
    decode_attention(q, k_pool, v_pool, page_table, seq_lens, *, kv_tile, scale, ...)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    extend_attention: Callable
    decode_attention: Callable
    # True: the cost grows with the page-table width (not with the tokens in use), so the runner
    # cuts page tables to a width bucket per step (`RunnerConfig.page_buckets`).
    bucket_page_table: bool = False


def ref() -> AttentionBackend:
    from sgl_tpu.kernels import paged_attention_ref as ref

    return AttentionBackend("ref", ref.write_kv, ref.extend_attention, ref.decode_attention)


def gathered() -> AttentionBackend:
    from sgl_tpu.backends.jax import paged_attention_gathered as gathered

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


def pallas() -> AttentionBackend:
    return _pallas("pallas", None)


def pallas_interpret() -> AttentionBackend:
    return _pallas("pallas-interpret", "tpu")


def ref_invariant() -> AttentionBackend:
    from sgl_tpu.kernels import batch_invariant_ref as inv
    from sgl_tpu.kernels import paged_attention_ref as ref

    return AttentionBackend("ref-invariant", ref.write_kv, inv.extend_attention,
                            inv.decode_attention)


def default_attention(platform: str | None) -> str:
    """`auto`: `pallas` on a TPU, `gathered` on a GPU, `ref` elsewhere (`platform`: JAX's
    backend; None: JAX's default one)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return {"tpu": "pallas", "gpu": "gathered"}.get(platform, "ref")


def check_attention(name: str, platform: str | None) -> None:
    """Every JAX implementation runs wherever JAX does (Pallas compiles for TPUs only and says
    so itself)."""
