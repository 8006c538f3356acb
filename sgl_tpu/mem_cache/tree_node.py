"""One node of the radix tree (`radix_cache.py`): the edge from its parent, the KV slots of
that edge's tokens, its lock count, and the fields eviction orders by (`eviction.py`). Only
`RadixCache` creates and mutates nodes; others hold them as handles (a request's locked
`last_node`) or read the tree's shape (the dfs-weight policy)."""

from __future__ import annotations

import numpy as np


class TreeNode:
    """One edge of the tree: ``key`` tokens whose KV lives at ``value`` slots."""

    __slots__ = ("id", "parent", "children", "key", "value", "lock_ref", "last_access_time",
                 "retain_until", "pins", "priority", "hashes", "namespace")

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        key: np.ndarray,
        value: np.ndarray,
        lock_ref: int = 0,
        last_access_time: int = 0,
        retain_until: float = 0.0,
        hashes: np.ndarray | None = None,
        pins: dict[str | None, float] | None = None,
        priority: int = 0,
        namespace: str | None = None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.key = key  # int32 [num_tokens]
        self.value = value  # int32 [num_tokens], KV slots
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time
        self.retain_until = retain_until  # seconds on the tree's clock; 0.0 = never retained
        # The retention pins covering this node, by owner (an open session's id; None for
        # time-only pins), each its deadline; retain_until is their maximum (radix_cache.py).
        self.pins: dict[str | None, float] = {} if pins is None else pins
        # The highest request priority that stored or reused this node (priority eviction).
        self.priority = priority
        # uint8 [num_pages, 16]: the chain hash of each page (page_hash.py), when the tree
        # tracks them (a lower tier or KV events listen); else None
        self.hashes = hashes
        # a root's namespace (radix_cache.py: one root per LoRA adapter); None elsewhere
        self.namespace = namespace

    @property
    def is_root(self) -> bool:
        """A root of the tree (the base model's or a namespace's): the only nodes whose edge
        is empty."""
        return self.key.size == 0

    def last_hash(self) -> bytes | None:
        """The chain hash of this edge's last page (None when hashes are not tracked)."""
        return None if self.hashes is None else self.hashes[-1].tobytes()

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class TreeListener:
    """What a lower cache tier or a KV-event publisher hears from the tree (no-op defaults).

    Called synchronously by `RadixCache`; a listener must not change the tree."""

    def stored(self, node: TreeNode) -> None:
        """`node` was just added as a leaf: its key, pages and hashes are new to the tree."""

    def removing(self, node: TreeNode) -> None:
        """`node` (a leaf) is about to leave the tree: its pages still hold its KV."""

    def clearing(self, nodes: list[TreeNode]) -> None:
        """The whole tree is about to be emptied (`reset`); `nodes` are all but the root."""
