"""How attention heads, MLP columns and the vocabulary split over `tp` tensor-parallel shards.

Backend-neutral (no JAX, no torch): the JAX mesh runner and the torch.distributed runner apply
the same rule, and the launcher checks it before any weights load.

Query heads are split evenly, so `num_heads % tp == 0`. KV heads follow their query groups:

    kv heads >= tp:  each shard owns kv_heads / tp of them     (kv_heads % tp == 0)
    kv heads <  tp:  each KV head is replicated tp / kv_heads times, so that every shard owns
                     exactly one copy of the head its query heads read  (tp % kv_heads == 0)

    e.g. 9 query / 3 KV heads (SmolLM2-135M):
      tp 3: shard i holds q heads 3i..3i+2 and KV head i
      tp 9: shard i holds q head i and a copy of KV head i // 3   (each KV head stored 3x)

Replicated KV heads are laid out head by head ([h0 h0 h0 h1 h1 h1 ...]), which keeps the
grouped-query mapping `kv = q // (num_heads // num_kv_heads)` true shard by shard.

MLP columns (intermediate size) and vocabulary rows that do not divide by `tp` are padded with
zero columns/rows (exact: a zero gate/up column contributes silu(0) * 0 = 0; padded vocabulary
rows are cut from the logits before sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class HeadCounts(Protocol):
    """What the rule reads from a model config (sgl_tpu.models.config.ModelConfig fits)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


# Families whose layers the tensor-parallel runners split (dense Llama-shaped decoders, full
# attention). Others (Gemma's sliding/soft-capped layers, MoE experts, Mistral's window, Phi-3's
# LongRoPE) are refused at tp > 1 until their layers are split and tested.
TP_ARCHS = ("llama", "qwen2", "qwen3")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def allowed_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 1024) -> list[int]:
    """Every tp the head counts allow, ascending."""
    return [tp for tp in range(1, min(num_heads, limit) + 1)
            if num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)]


@dataclass(frozen=True)
class HeadSplit:
    """Per-shard sizes of a model split `tp` ways (see the module docstring)."""

    tp: int
    num_heads: int  # query heads of the whole model
    num_kv_heads: int  # KV heads of the checkpoint
    num_kv_heads_padded: int  # KV heads stored (>= tp: replicated when the checkpoint has fewer)
    intermediate_size_padded: int  # MLP columns stored, a multiple of tp
    vocab_size_padded: int  # embedding / LM-head rows stored, a multiple of tp

    @property
    def kv_replication(self) -> int:
        """Copies stored of each checkpoint KV head (1 when kv heads >= tp)."""
        return self.num_kv_heads_padded // self.num_kv_heads

    @property
    def heads_per_shard(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_shard(self) -> int:
        return self.num_kv_heads_padded // self.tp


def check_tp_size(model_config: HeadCounts, tp: int) -> HeadSplit:
    """The split of `model_config` over `tp` shards; ValueError naming the head counts (and the
    sizes that would work) when they do not allow it."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp!r}")
    arch = getattr(model_config, "arch", None)
    if tp > 1 and arch is not None and arch not in TP_ARCHS:
        raise ValueError(f"--tp-size {tp}: tensor parallelism splits {', '.join(TP_ARCHS)} "
                         f"models; this one is {arch!r} (use --tp-size 1, or --dp-size "
                         f"replicas to scale it out)")
    h, kvh = model_config.num_heads, model_config.num_kv_heads
    if h % tp or (kvh % tp and tp % kvh):
        why = (f"{h} query heads do not divide by {tp}" if h % tp else
               f"{kvh} KV heads neither divide by {tp} nor divide it")
        raise ValueError(
            f"--tp-size {tp} does not fit this model's heads ({h} query heads, {kvh} KV heads): "
            f"{why}; tensor-parallel sizes this model allows: "
            f"{', '.join(map(str, allowed_tp_sizes(h, kvh)))}")
    return HeadSplit(
        tp=tp, num_heads=h, num_kv_heads=kvh, num_kv_heads_padded=max(kvh, tp),
        intermediate_size_padded=_round_up(model_config.intermediate_size, tp),
        vocab_size_padded=_round_up(model_config.vocab_size, tp))
