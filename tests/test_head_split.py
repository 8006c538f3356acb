"""The tensor-parallel head-count rule (sgl_tpu/parallel/head_split.py), no JAX needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_tpu.parallel.head_split import allowed_tp_sizes, check_tp_size

SMOLLM2 = SimpleNamespace(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
TINY = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=64, vocab_size=300)


def test_smollm2_sizes() -> None:
    assert allowed_tp_sizes(9, 3) == [1, 3, 9]
    split = check_tp_size(SMOLLM2, 3)
    assert (split.heads_per_shard, split.kv_heads_per_shard, split.kv_replication) == (3, 1, 1)
    split = check_tp_size(SMOLLM2, 9)
    assert (split.heads_per_shard, split.kv_heads_per_shard, split.kv_replication) == (1, 1, 3)
    assert split.intermediate_size_padded == 1539 and split.vocab_size_padded == 49158


@pytest.mark.parametrize("tp", [2, 4, 6])
def test_refused_sizes_name_the_heads(tp: int) -> None:
    with pytest.raises(ValueError, match=r"9 query heads, 3 KV heads.*allows: 1, 3, 9"):
        check_tp_size(SMOLLM2, tp)


def test_tiny_replicates_kv_at_tp4() -> None:
    split = check_tp_size(TINY, 4)
    assert split.num_kv_heads_padded == 4 and split.kv_replication == 2
    assert split.vocab_size_padded == 300 and check_tp_size(TINY, 2).kv_replication == 1
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        check_tp_size(TINY, 0)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "mixtral", "mistral", "phi3"])
def test_families_not_split_are_refused_above_tp1(arch: str) -> None:
    cfg = SimpleNamespace(**vars(TINY), arch=arch)
    pattern = rf"splits llama, qwen2, qwen3 models; this one is '{arch}'"
    with pytest.raises(ValueError, match=pattern):
        check_tp_size(cfg, 2)
    assert check_tp_size(cfg, 1).tp == 1
    assert check_tp_size(SimpleNamespace(**vars(TINY), arch="qwen2"), 2).tp == 2
