"""Which evictable leaf of the radix tree goes next: LRU, with session retention on top.

An evictable leaf is an unlocked, childless, non-root node. It is in one of two classes, by its
``retain_until`` deadline (seconds on the tree's clock; 0.0 = never retained):

  unretained  ``retain_until <= now``  evicted first, least recently used first (plain LRU).
  retained    ``retain_until >  now``  the trajectory of an agent whose turn ended a moment ago
                                       and whose next turn will resend it (`RadixCache.retain`).
                                       Evicted only when no unretained leaf is left, and then
                                       the most recently retained first (largest deadline).

Why most-recently-retained first: agents in a tool loop come back in a cycle (turn, tool call,
turn, ...). When the pool cannot hold every mid-loop agent, evicting the context whose next
use is furthest away keeps the others whole, and for a cycle that is the context retained last
(LRU order would evict each agent's context just before it returns, so every agent misses).
With one server-wide retention period, the largest deadline is the latest turn end.

Three lazy min-heaps, entries invalidated by comparison instead of being removed::

    _lru       (last_access_time, node_id, node)   victims of the unretained class
    _retained  (-retain_until,    node_id, node)   victims of the retained class
    _expiry    (retain_until,     node_id, node)   when a retained leaf rejoins the LRU class

An entry is live while its node is still in the set and its key fields still equal the node's.
An LRU entry whose node is retained is dropped when it reaches the top; `_expire` gives the
node a fresh LRU entry once its deadline passes. So every leaf in the set always has a current
LRU entry or a current expiry entry, and a retained one also a current ``_retained`` entry
(`check()` verifies exactly this). Each push or pop is O(log n); the heaps are rebuilt from the
set, O(leaves), when stale entries outnumber live ones. The clock must never go backwards.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from sgl_tpu.mem_cache.tree_node import TreeNode


class LeafQueue:
    """The set of evictable leaves, ordered for eviction as the module docstring says."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.nodes: set[TreeNode] = set()
        self._lru: list[tuple[int, int, TreeNode]] = []
        self._retained: list[tuple[float, int, TreeNode]] = []
        self._expiry: list[tuple[float, int, TreeNode]] = []

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    # ---- changes reported by the tree --------------------------------------------------------

    def add(self, node: TreeNode) -> None:
        """``node`` became an evictable leaf."""
        self.nodes.add(node)
        self._push_lru(node)
        if node.retain_until > self.clock():
            self._push_retained(node)

    def discard(self, node: TreeNode) -> None:
        """``node`` is no longer an evictable leaf (locked, got a child, or deleted)."""
        self.nodes.discard(node)

    def touched(self, node: TreeNode) -> None:
        """``node.last_access_time`` changed."""
        if node in self.nodes:
            self._push_lru(node)

    def retention_raised(self, node: TreeNode) -> None:
        """``node.retain_until`` grew (it never shrinks)."""
        if node in self.nodes and node.retain_until > self.clock():
            self._push_retained(node)

    # ---- eviction ----------------------------------------------------------------------------

    def pop(self, now: float) -> TreeNode | None:
        """Remove and return the next victim, or None when the set is empty."""
        self._expire(now)
        while self._lru:
            access_time, _, node = heapq.heappop(self._lru)
            if (node in self.nodes and node.last_access_time == access_time
                    and node.retain_until <= now):
                self.nodes.discard(node)
                return node
        while self._retained:
            neg_deadline, _, node = heapq.heappop(self._retained)
            if node in self.nodes and node.retain_until == -neg_deadline:
                self.nodes.discard(node)
                return node
        return None

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            deadline, _, node = heapq.heappop(self._expiry)
            if node in self.nodes and node.retain_until == deadline:
                self._push_lru(node)

    # ---- heap upkeep -------------------------------------------------------------------------

    def _push_lru(self, node: TreeNode) -> None:
        heapq.heappush(self._lru, (node.last_access_time, node.id, node))
        self._maybe_rebuild()

    def _push_retained(self, node: TreeNode) -> None:
        heapq.heappush(self._retained, (-node.retain_until, node.id, node))
        heapq.heappush(self._expiry, (node.retain_until, node.id, node))
        self._maybe_rebuild()

    def _maybe_rebuild(self) -> None:
        # Expired entries sink to the bottom of `_retained` and are never popped from there,
        # so every heap's size is bounded here, not only the LRU heap's.
        longest = max(len(self._lru), len(self._retained), len(self._expiry))
        if longest <= 2 * len(self.nodes) + 64:
            return
        # Too many stale entries: rebuild all three from the live set (O(leaves), no tree scan).
        now = self.clock()
        retained = [n for n in self.nodes if n.retain_until > now]
        self._lru = [(n.last_access_time, n.id, n) for n in self.nodes]
        self._retained = [(-n.retain_until, n.id, n) for n in retained]
        self._expiry = [(n.retain_until, n.id, n) for n in retained]
        for h in (self._lru, self._retained, self._expiry):
            heapq.heapify(h)

    def check(self) -> str | None:
        """The first leaf without its current heap entries, as a message; None when exact."""
        now = self.clock()
        lru = {(n.id, t) for t, _, n in self._lru}
        retained = {(n.id, -d) for d, _, n in self._retained}
        expiry = {(n.id, d) for d, _, n in self._expiry}
        for node in self.nodes:
            due = (node.id, node.retain_until)
            if node.retain_until > now:
                if due not in retained or due not in expiry:
                    return f"retained {node!r} has no current retention/expiry heap entry"
            elif (node.id, node.last_access_time) not in lru and due not in expiry:
                return f"{node!r} has no current entry in the LRU or expiry heap"
        return None
