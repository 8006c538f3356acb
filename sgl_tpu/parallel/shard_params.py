"""One tensor-parallel rank's slice of the loader's canonical params (numpy, backend-neutral).

Canonical matrices are [in, out] (loader/loaded.py). Column-parallel projections keep a slice
of their output columns, row-parallel ones a slice of their input rows, so that each rank's
partial o-/down-projection outputs sum (all-reduce) to the full ones:

    wq [D, H d]        ─cols─► heads [r H/tp, (r+1) H/tp)                  column-parallel
    wk, wv [D, kvh d]  ─cols─► kv heads of rank r (head_split: split, or one replicated copy)
    wo [H d, D]        ─rows─► the same query heads                         row-parallel
    w_gate, w_up [D, F]─cols─► F/tp columns (F zero-padded to a multiple of tp)
    w_down [F, D]      ─rows─► the same F/tp rows
    embed [V, D]       ─rows─► vocabulary rows [r V/tp, (r+1) V/tp) (V zero-padded)
    lm_head [D, V]     ─cols─► the same vocabulary slice (untied models)
    norms, q/k norm    replicated

The returned `ModelConfig` describes the rank's slice (its head counts, F/tp, V/tp), so the
single-device model code runs on it unchanged between the collectives.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sgl_tpu.models.config import ModelConfig
from sgl_tpu.parallel.head_split import HeadSplit


def kv_heads_of_rank(split: HeadSplit, rank: int) -> list[int]:
    """Checkpoint KV heads rank `rank` stores (one replicated head when kv heads < tp)."""
    n = split.kv_heads_per_shard
    if split.num_kv_heads >= split.tp:
        return list(range(rank * n, (rank + 1) * n))
    return [rank // split.kv_replication]


def _pad(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths)


def _head_cols(heads: list[int], head_dim: int) -> np.ndarray:
    return (np.asarray(heads)[:, None] * head_dim + np.arange(head_dim)).reshape(-1)


def shard_params(params: dict, cfg: ModelConfig, split: HeadSplit, rank: int
                 ) -> tuple[dict, ModelConfig]:
    """(rank `rank`'s params, the config of that slice); see the module docstring."""
    if not 0 <= rank < split.tp:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {split.tp}")
    d, tp = cfg.head_dim, split.tp
    q_heads = list(range(rank * split.heads_per_shard, (rank + 1) * split.heads_per_shard))
    q_cols = _head_cols(q_heads, d)
    kv_cols = _head_cols(kv_heads_of_rank(split, rank), d)
    f_local = split.intermediate_size_padded // tp
    f_cols = slice(rank * f_local, (rank + 1) * f_local)
    v_local = split.vocab_size_padded // tp
    v_rows = slice(rank * v_local, (rank + 1) * v_local)
    f_pad, v_pad = split.intermediate_size_padded, split.vocab_size_padded

    layers = []
    for lw in params["layers"]:
        out = {
            "attn_norm": lw["attn_norm"], "mlp_norm": lw["mlp_norm"],
            "wq": lw["wq"][:, q_cols], "wk": lw["wk"][:, kv_cols], "wv": lw["wv"][:, kv_cols],
            "wo": lw["wo"][q_cols, :],
            "w_gate": _pad(lw["w_gate"], 1, f_pad)[:, f_cols],
            "w_up": _pad(lw["w_up"], 1, f_pad)[:, f_cols],
            "w_down": _pad(lw["w_down"], 0, f_pad)[f_cols, :],
        }
        if cfg.attention_bias:
            out.update(bq=lw["bq"][q_cols], bk=lw["bk"][kv_cols], bv=lw["bv"][kv_cols])
        if cfg.qk_norm:
            out.update(q_norm=lw["q_norm"], k_norm=lw["k_norm"])
        layers.append(out)
    sharded = {"layers": layers, "final_norm": params["final_norm"],
               "embed": _pad(params["embed"], 0, v_pad)[v_rows]}
    if not cfg.tie_word_embeddings:
        sharded["lm_head"] = _pad(params["lm_head"], 1, v_pad)[:, v_rows]
    local = dataclasses.replace(cfg, num_heads=split.heads_per_shard,
                                num_kv_heads=split.kv_heads_per_shard,
                                intermediate_size=f_local, vocab_size=v_local)
    return sharded, local
