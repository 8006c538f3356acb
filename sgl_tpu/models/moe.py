"""Mixture-of-experts decoder (Qwen3-MoE, Mixtral) in JAX: the Llama-family decoder of
`models/llama.py` with each layer's MLP replaced by routed SwiGLU experts.

Per layer (T tokens, E experts, k experts per token, N = T * k assignments, D hidden,
F expert width):

    x [T, D] --router--> logits f32[T, E] --softmax, top-k (renormalised if norm_topk_prob)-->
      weights [T, k], experts i32[T, k]
    flatten to N assignments, stable-sort by expert:
      sorted_expert [N] (ascending), sorted_token [N] (the row of x each one reads)
    grouped SwiGLU over the sorted rows (row r uses expert sorted_expert[r]) -> y [N, D]
    out [T, D] = sum over each token's k rows of weight * y

Two implementations of the grouped SwiGLU, same result (tests compare them):

* `ragged_dot`: `jax.lax.ragged_dot` with per-expert group sizes. XLA lowers it natively on
  TPU and GPU; on CPU its fallback expands the rows to a dense [E, N, D] operand, so compute
  scales with all experts there.
* `tiled` (the default off TPU/GPU): the sorted rows are cut into tiles of `MOE_TILE` rows; a
  tile spans a run of experts, and each (tile, expert) pair is one work item: one expert's
  weights times the tile's rows, masked to the rows routed to that expert. Items are
  enumerated on the device and walked by one `fori_loop` that stops at the number in use:

        sorted rows   [0 0 0 | 0 2 2 | 2 5 7 | 7 . .]      (expert of each row, tiles of 3)
        items         (t0,e0) (t1,e0) (t1,e1) (t1,e2) (t2,e2) ... (t3,e7)

  At most N / MOE_TILE + E items, each reading one expert: prefill costs about the active
  FLOPs (plus one tile per expert), and a decode step of a few tokens reads only the experts
  its tokens picked. Experts between two picked ones inside a tile (e1 above) cost an empty
  item; a bound, not the common case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sgl_tpu.models import llama
from sgl_tpu.models.config import ModelConfig

MOE_TILE = 8  # sorted rows per work item of the tiled grouped SwiGLU

compute_logits = llama.compute_logits


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [D, E] -> (weights f32[T, k], experts i32[T, k]).

    Softmax over all experts, then the top k; their probabilities renormalised to sum 1 when
    `norm_topk_prob` (Mixtral: always, which equals a softmax over the top-k logits)."""
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = lax.top_k(probs, cfg.num_experts_per_tok)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _grouped_ragged_dot(xs: jax.Array, sorted_expert: jax.Array, layer: dict,
                        num_experts: int) -> jax.Array:
    """xs [N, D] sorted by expert -> SwiGLU of each row through its expert, [N, D]."""
    group_sizes = jnp.bincount(sorted_expert, length=num_experts).astype(jnp.int32)  # [E]
    gate = lax.ragged_dot(xs, layer["w_gate_exps"], group_sizes)  # [N, F]
    up = lax.ragged_dot(xs, layer["w_up_exps"], group_sizes)
    return lax.ragged_dot(jax.nn.silu(gate) * up, layer["w_down_exps"], group_sizes)


def _grouped_tiled(xs: jax.Array, sorted_expert: jax.Array, layer: dict,
                   num_experts: int) -> jax.Array:
    """Same contract as `_grouped_ragged_dot`, as (tile, expert) work items (module doc)."""
    n, d = xs.shape
    num_tiles = -(-n // MOE_TILE)
    pad = num_tiles * MOE_TILE - n
    xs = jnp.pad(xs, ((0, pad), (0, 0)))  # [NT * tile, D]
    # padding rows take expert -1: never equal to an item's expert, so masked out
    row_expert = jnp.pad(sorted_expert, (0, pad), constant_values=-1)
    tiles = row_expert.reshape(num_tiles, MOE_TILE)
    first = tiles[:, 0]  # [NT] experts ascend within a tile; its first row is never padding
    last = jnp.max(tiles, axis=1)
    counts = last - first + 1  # [NT] items per tile
    starts = jnp.cumsum(counts) - counts  # [NT] first item of each tile
    num_items = starts[-1] + counts[-1]
    max_items = num_tiles + num_experts - 1
    item = jnp.arange(max_items, dtype=jnp.int32)
    item_tile = jnp.clip(jnp.searchsorted(starts, item, side="right") - 1, 0, num_tiles - 1)
    item_expert = first[item_tile] + item - starts[item_tile]  # [max_items]

    def body(i, ys):
        t, e = item_tile[i], item_expert[i]
        rows = lax.dynamic_slice_in_dim(xs, t * MOE_TILE, MOE_TILE)  # [tile, D]
        gate = rows @ layer["w_gate_exps"][e]  # [tile, F]
        up = rows @ layer["w_up_exps"][e]
        y = (jax.nn.silu(gate) * up) @ layer["w_down_exps"][e]  # [tile, D]
        mine = lax.dynamic_slice_in_dim(row_expert, t * MOE_TILE, MOE_TILE) == e
        acc = lax.dynamic_slice_in_dim(ys, t * MOE_TILE, MOE_TILE)
        return lax.dynamic_update_slice_in_dim(ys, acc + jnp.where(mine[:, None], y, 0),
                                               t * MOE_TILE, 0)

    ys = lax.fori_loop(0, num_items, body, jnp.zeros((num_tiles * MOE_TILE, d), xs.dtype))
    return ys[:n]


GROUPED_IMPLS = {"ragged_dot": _grouped_ragged_dot, "tiled": _grouped_tiled}


def default_grouped_impl() -> str:
    """`ragged_dot` where XLA lowers it natively (TPU, GPU), else `tiled`."""
    return "ragged_dot" if jax.default_backend() in ("tpu", "gpu") else "tiled"


def moe_mlp(x: jax.Array, layer: dict, cfg: ModelConfig, impl: str | None = None) -> jax.Array:
    """Routed SwiGLU experts: x [T, D] -> [T, D] (the `mlp` hook of `llama.forward`)."""
    num_tokens, k = x.shape[0], cfg.num_experts_per_tok
    weights, experts = route(x, layer["router"], cfg)  # [T, k]
    flat_expert = experts.reshape(-1)  # [N]
    order = jnp.argsort(flat_expert, stable=True)  # [N] assignment of each sorted row
    sorted_expert = flat_expert[order]
    sorted_token = order // k
    grouped = GROUPED_IMPLS[impl or default_grouped_impl()]
    ys = grouped(x[sorted_token], sorted_expert, layer, cfg.num_experts)  # [N, D]
    ys = ys.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[sorted_token].add(ys)
    return out.astype(x.dtype)


def forward(params, kv_pools, fb, cfg: ModelConfig, mode, *, kv_tile: int,
            attention_backend: str = "ref"):
    """`llama.forward` with `moe_mlp` as every layer's MLP (the registry's JAX entry point)."""
    return llama.forward(params, kv_pools, fb, cfg, mode, kv_tile=kv_tile,
                         attention_backend=attention_backend, mlp=moe_mlp)
