"""The three places where the tensor-parallel step leaves XLA's automatic (GSPMD) partitioning
and says per device what to do, with `jax.shard_map`:

    shard_attention(attn, mesh)   the KV write and attention of ANY backend (ref, gathered,
                                  pallas, pallas-interpret), run per device on its own heads:
                                    q [T, H, d] and new k/v [T, kvh, d]   split on heads
                                    pools [kvh, pages, page_size, d]     split on kvh
                                    page table, lengths, blocks, items   replicated
                                  Kernels see ordinary single-device shapes (H/tp, kvh/tp heads),
                                  so a Pallas kernel runs unchanged and no collective is needed.
    embed_lookup(embed, ids, mesh)  vocab-parallel embedding: each device looks up the ids in its
                                  vocabulary slice (zeros elsewhere), one all-reduce sums them.
    vocab_logits(compute, params, hidden, V, mesh)
                                  the LM head per device on its vocabulary slice, then one
                                  all-gather of the logits [N, Vp / tp] -> replicated [N, V]
                                  (padding columns cut) before the sampler. Left to GSPMD, the
                                  partitioner gathered the whole LM-head weight instead (one
                                  [V, D] all-gather per step; seen by backends/jax/lowering.py).

Everything else (the column/row-parallel matmuls and their all-reduces) is left to GSPMD from
the weights' shardings (backends/jax/mesh.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_tpu.backends.jax.attention import AttentionBackend
from sgl_tpu.backends.jax.mesh import HEADS_SPEC, KV_POOL_SPEC, TP_AXIS

_REPLICATED = P()


def _per_device(fn, mesh: Mesh, in_specs: tuple, out_specs):
    # check_vma=False: Pallas calls carry no varying-manual-axes annotations.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


@functools.cache
def shard_attention(attn: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """`attn` run per device on its heads (see the module docstring); same signatures."""

    def write_kv(k_pool, v_pool, k, v, slots):
        return _per_device(attn.write_kv, mesh,
                           (KV_POOL_SPEC, KV_POOL_SPEC, HEADS_SPEC, HEADS_SPEC, _REPLICATED),
                           (KV_POOL_SPEC, KV_POOL_SPEC))(k_pool, v_pool, k, v, slots)

    def extend_attention(q, k_pool, v_pool, *batch, **static):
        fn = functools.partial(attn.extend_attention, **static)
        specs = (HEADS_SPEC, KV_POOL_SPEC, KV_POOL_SPEC) + (_REPLICATED,) * len(batch)
        return _per_device(fn, mesh, specs, HEADS_SPEC)(q, k_pool, v_pool, *batch)

    def decode_attention(q, k_pool, v_pool, *batch, **static):
        fn = functools.partial(attn.decode_attention, **static)
        specs = (HEADS_SPEC, KV_POOL_SPEC, KV_POOL_SPEC) + (_REPLICATED,) * len(batch)
        return _per_device(fn, mesh, specs, HEADS_SPEC)(q, k_pool, v_pool, *batch)

    return AttentionBackend(f"{attn.name}@tp{mesh.size}", write_kv, extend_attention,
                            decode_attention, attn.bucket_page_table)


def embed_lookup(embed: jax.Array, ids: jax.Array, mesh: Mesh) -> jax.Array:
    """embed [Vp, D] split on rows, ids i32[T] -> replicated [T, D]."""

    def local(table, ids):  # table [Vp / tp, D]
        rows = table.shape[0]
        local_ids = ids - lax.axis_index(TP_AXIS) * rows
        mine = (local_ids >= 0) & (local_ids < rows)
        found = jnp.take(table, jnp.where(mine, local_ids, 0), axis=0)  # [T, D]
        return lax.psum(jnp.where(mine[:, None], found, jnp.zeros_like(found)), TP_AXIS)

    return _per_device(local, mesh, (P(TP_AXIS, None), _REPLICATED), _REPLICATED)(embed, ids)


def vocab_logits(compute, params: dict, hidden: jax.Array, vocab_size: int,
                 mesh: Mesh | None) -> jax.Array:
    """hidden [N, D] -> float32 logits [N, vocab_size], replicated. `compute(params, hidden)`
    is the model's LM head; under TP it runs per device on the vocabulary slice of the
    embedding (tied: [Vp, D] split on rows) or of the LM head ([D, Vp] split on columns)."""
    if mesh is None:
        return compute(params, hidden)
    name = "lm_head" if "lm_head" in params else "embed"
    spec = P(None, TP_AXIS) if name == "lm_head" else P(TP_AXIS, None)

    def local(weight, hidden):  # weight: this device's vocabulary slice
        logits = compute({name: weight}, hidden)  # [N, Vp / tp]
        return lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)  # [N, Vp]

    logits = _per_device(local, mesh, (spec, _REPLICATED), _REPLICATED)(params[name], hidden)
    return logits[:, :vocab_size]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, _REPLICATED)
