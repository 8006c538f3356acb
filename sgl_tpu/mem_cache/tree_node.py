"""One node of the radix tree (`radix_cache.py`): the edge from its parent, the KV slots of
that edge's tokens, its lock count, and the fields eviction orders by (`eviction.py`). Only
`RadixCache` creates and mutates nodes; others hold them as handles (a request's locked
`last_node`) or read the tree's shape (the dfs-weight policy)."""

from __future__ import annotations

import numpy as np


class TreeNode:
    """One edge of the tree: ``key`` tokens whose KV lives at ``value`` slots."""

    __slots__ = ("id", "parent", "children", "key", "value", "lock_ref", "last_access_time",
                 "retain_until")

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        key: np.ndarray,
        value: np.ndarray,
        lock_ref: int = 0,
        last_access_time: int = 0,
        retain_until: float = 0.0,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.key = key  # int32 [num_tokens]
        self.value = value  # int32 [num_tokens], KV slots
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time
        self.retain_until = retain_until  # seconds on the tree's clock; 0.0 = never retained

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"
