"""Mixture-of-experts decoder (Qwen3-MoE, Mixtral, Qwen2-MoE) in JAX: the Llama-family decoder of
`backends/jax/models/llama.py` with each layer's MLP replaced by routed SwiGLU experts.

Per layer (T tokens, E experts, k experts per token, N = T * k assignments, D hidden,
F expert width):

    x [T, D] --router--> logits f32[T, E] --softmax, top-k (renormalised if norm_topk_prob)-->
      weights [T, k], experts i32[T, k]
    flatten to N assignments, stable-sort by expert:
      sorted_expert [N] (ascending), sorted_token [N] (the row of x each one reads)
    grouped SwiGLU over the sorted rows (row r uses expert sorted_expert[r]) -> y [N, D]
    out [T, D] = sum over each token's k rows of weight * y
      (+ sigmoid(x @ shexp_gate) * SwiGLU_shared(x) with Qwen2-MoE's shared expert)

Two implementations of the grouped SwiGLU, same result (tests compare them):

* `ragged_dot`: `jax.lax.ragged_dot` with per-expert group sizes. XLA lowers it natively on
  TPU and GPU; on CPU its fallback expands the rows to a dense [E, N, D] operand, so compute
  scales with all experts there.
* `tiled` (the default off TPU/GPU): the sorted rows are cut into tiles (`tile_rows`); a
  tile spans a run of experts, and each (tile, expert) pair is one work item: one expert's
  weights times the tile's rows, masked to the rows routed to that expert. Items are
  enumerated on the device and walked by one `fori_loop` that stops at the number in use:

        sorted rows   [0 0 0 | 0 2 2 | 2 5 7 | 7 . .]      (expert of each row, tiles of 3)
        items         (t0,e0) (t1,e0) (t1,e2) (t2,e2) (t2,e5) (t2,e7) (t3,e7)

  An item starts at each sorted row that begins a tile or changes expert, so only experts
  with rows get items: at most min(N, N / tile + E - 1), each reading one expert. Prefill
  costs about the active FLOPs (plus at most one partial tile per expert), and a decode step of
  a few tokens reads only the experts its tokens picked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sgl_tpu.backends.jax.models import llama
from sgl_tpu.models.config import ModelConfig

MOE_TILE = 8  # fewest sorted rows per work item of the tiled grouped SwiGLU


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile: MOE_TILE for decode-sized steps; for N rows over E experts the largest
    power of two <= N / (2E), so the partial tiles (at most one per expert) add at most half
    the active rows while the item count stays near 3E (fewer, larger GEMMs for prefill)."""
    target = num_rows // (2 * num_experts)
    return max(MOE_TILE, 1 << max(target.bit_length() - 1, 0))


compute_logits = llama.compute_logits


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [D, E] -> (weights f32[T, k], experts i32[T, k]).

    Softmax over all experts, then the top k; their probabilities renormalised to sum 1 when
    `norm_topk_prob` (Mixtral: always, which equals a softmax over the top-k logits)."""
    # float32 router: in bf16 near-tied experts swap, and a swapped expert moves the logits
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
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
    tile = tile_rows(n, num_experts)
    num_tiles = -(-n // tile)
    pad = num_tiles * tile - n
    xs = jnp.pad(xs, ((0, pad), (0, 0)))  # [NT * tile, D]
    # padding rows take expert -1: never equal to an item's expert, so masked out
    row_expert = jnp.pad(sorted_expert, (0, pad), constant_values=-1)
    # an item starts at every real row that begins a tile or follows another expert's row
    row = jnp.arange(num_tiles * tile)
    prev = jnp.concatenate([jnp.full((1,), -1, row_expert.dtype), row_expert[:-1]])
    starts = (row_expert >= 0) & ((row % tile == 0) | (row_expert != prev))
    num_items = starts.sum()
    max_items = min(n, num_tiles + num_experts - 1)
    (first_row,) = jnp.nonzero(starts, size=max_items, fill_value=0)  # [max_items]
    item_tile = first_row // tile
    item_expert = row_expert[first_row]

    def body(i, ys):
        t, e = item_tile[i], item_expert[i]
        rows = lax.dynamic_slice_in_dim(xs, t * tile, tile)  # [tile, D]
        gate = rows @ layer["w_gate_exps"][e]  # [tile, F]
        up = rows @ layer["w_up_exps"][e]
        y = (jax.nn.silu(gate) * up) @ layer["w_down_exps"][e]  # [tile, D]
        mine = lax.dynamic_slice_in_dim(row_expert, t * tile, tile) == e
        acc = lax.dynamic_slice_in_dim(ys, t * tile, tile)
        return lax.dynamic_update_slice_in_dim(ys, acc + jnp.where(mine[:, None], y, 0),
                                               t * tile, 0)

    ys = lax.fori_loop(0, num_items, body, jnp.zeros((num_tiles * tile, d), xs.dtype))
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
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: every token also takes the shared one
        gate = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), layer["shexp_gate"].astype(
            jnp.float32)))  # [T, 1]
        shared = {"w_gate": layer["w_gate_shexp"], "w_up": layer["w_up_shexp"],
                  "w_down": layer["w_down_shexp"]}
        out = out + gate * llama.dense_mlp(x, shared, cfg).astype(jnp.float32)
    return out.astype(x.dtype)


def forward(params, kv_pools, fb, cfg: ModelConfig, mode, *, kv_tile: int,
            attention_backend: str = "ref"):
    """`llama.forward` with `moe_mlp` as every layer's MLP (the registry's JAX entry point)."""
    return llama.forward(params, kv_pools, fb, cfg, mode, kv_tile=kv_tile,
                         attention_backend=attention_backend, mlp=moe_mlp)
