"""Which evictable leaf of the radix tree goes next: a policy's order, with retention on top.

An evictable leaf is an unlocked, childless, non-root node. It is in one of two classes, by its
``retain_until`` deadline (seconds on the tree's clock; 0.0 = never retained):

  unretained  ``retain_until <= now``  evicted first, in the policy's order (LRU: least
                                       recently used first).
  retained    ``retain_until >  now``  pinned KV: an agent's trajectory between turns, an open
                                       session's, a request's ``retention_seconds``, a turn
                                       paused for a tool call (`RadixCache.pin`). Evicted only
                                       when no unretained leaf is left, and then the largest
                                       deadline first.

Why the largest deadline first: agents in a tool loop come back in a cycle (turn, tool call,
turn, ...). When the pool cannot hold every mid-loop agent, evicting the context whose next
use is furthest away keeps the others whole, and for a cycle that is the context retained last
(LRU order would evict each agent's context just before it returns, so every agent misses).
With one retention period, the largest deadline is the latest turn end.

Policies (``EVICTION_POLICIES``, ``--radix-eviction-policy``) give each class its sort key,
smallest evicted first:

  lru       unretained (last_access_time)            retained (-retain_until)
  priority  unretained (priority, last_access_time)  retained (priority, -retain_until)

A node's priority is the highest ``priority`` of the requests that stored or reused it, so a
low-priority request's KV goes before a high-priority one's, LRU within one priority (SGLang's
``--radix-eviction-policy priority``). A parent's priority is at least each child's.

Three lazy min-heaps, entries invalidated by comparison instead of being removed::

    _unretained  (policy key, node_id, node)    victims of the unretained class
    _retained    (policy key, node_id, node)    victims of the retained class
    _expiry      (retain_until, node_id, node)  when a retained leaf rejoins the unretained class

An entry is live while its node is still in the set and its key still equals the one the policy
computes for the node now. An unretained entry whose node is retained is dropped when it
reaches the top; `_expire` gives the node a fresh entry once its deadline passes. So every
leaf in the set always has a current unretained entry or a current expiry entry, and a retained
one also a current ``_retained`` entry (`check()` verifies exactly this). The tree reports
every change of a leaf's keys (`touched`, `priority_changed`, `retention_changed`), a deadline
lowered when a session closes included. Each push or pop is O(log n); the heaps are rebuilt
from the set, O(leaves), when stale entries outnumber live ones. The clock must never go backwards.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from sgl_tpu.mem_cache.tree_node import TreeNode


@dataclass(frozen=True)
class EvictionPolicy:
    """The sort keys of an evictable leaf in each class; the smallest key is evicted first."""

    unretained: Callable[[TreeNode], tuple]
    retained: Callable[[TreeNode], tuple]


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": EvictionPolicy(unretained=lambda n: (n.last_access_time,),
                          retained=lambda n: (-n.retain_until,)),
    "priority": EvictionPolicy(unretained=lambda n: (n.priority, n.last_access_time),
                               retained=lambda n: (n.priority, -n.retain_until)),
}


class LeafQueue:
    """The set of evictable leaves, ordered for eviction as the module docstring says."""

    def __init__(self, clock: Callable[[], float], policy: str = "lru") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {sorted(EVICTION_POLICIES)}, "
                             f"got {policy!r}")
        self.clock = clock
        self.policy = EVICTION_POLICIES[policy]
        self.nodes: set[TreeNode] = set()
        self._unretained: list[tuple[tuple, int, TreeNode]] = []
        self._retained: list[tuple[tuple, int, TreeNode]] = []
        self._expiry: list[tuple[float, int, TreeNode]] = []

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    # ---- changes reported by the tree --------------------------------------------------------

    def add(self, node: TreeNode) -> None:
        """``node`` became an evictable leaf."""
        self.nodes.add(node)
        self._push_unretained(node)
        if node.retain_until > self.clock():
            self._push_retained(node)

    def discard(self, node: TreeNode) -> None:
        """``node`` is no longer an evictable leaf (locked, got a child, or deleted)."""
        self.nodes.discard(node)

    def touched(self, node: TreeNode) -> None:
        """``node.last_access_time`` changed."""
        if node in self.nodes:
            self._push_unretained(node)

    def priority_changed(self, node: TreeNode) -> None:
        """``node.priority`` changed (it grows; a new leaf takes its request's)."""
        if node in self.nodes:
            self._push_unretained(node)
            if node.retain_until > self.clock():
                self._push_retained(node)

    def retention_changed(self, node: TreeNode) -> None:
        """``node.retain_until`` changed (raised by a pin, lowered by a dropped one)."""
        if node in self.nodes:
            if node.retain_until > self.clock():
                self._push_retained(node)
            else:  # no longer retained: back in the unretained order now
                self._push_unretained(node)

    # ---- eviction ----------------------------------------------------------------------------

    def pop(self, now: float) -> TreeNode | None:
        """Remove and return the next victim, or None when the set is empty."""
        self._expire(now)
        key = self.policy.unretained
        while self._unretained:
            entry_key, _, node = heapq.heappop(self._unretained)
            if node in self.nodes and node.retain_until <= now and key(node) == entry_key:
                self.nodes.discard(node)
                return node
        key = self.policy.retained
        while self._retained:
            entry_key, _, node = heapq.heappop(self._retained)
            if node in self.nodes and node.retain_until > now and key(node) == entry_key:
                self.nodes.discard(node)
                return node
        return None

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            deadline, _, node = heapq.heappop(self._expiry)
            if node in self.nodes and node.retain_until == deadline:
                self._push_unretained(node)

    # ---- heap upkeep -------------------------------------------------------------------------

    def _push_unretained(self, node: TreeNode) -> None:
        heapq.heappush(self._unretained, (self.policy.unretained(node), node.id, node))
        self._maybe_rebuild()

    def _push_retained(self, node: TreeNode) -> None:
        heapq.heappush(self._retained, (self.policy.retained(node), node.id, node))
        heapq.heappush(self._expiry, (node.retain_until, node.id, node))
        self._maybe_rebuild()

    def _maybe_rebuild(self) -> None:
        # Expired entries sink to the bottom of `_retained` and are never popped from there,
        # so every heap's size is bounded here, not only the unretained heap's.
        longest = max(len(self._unretained), len(self._retained), len(self._expiry))
        if longest <= 2 * len(self.nodes) + 64:
            return
        # Too many stale entries: rebuild all three from the live set (O(leaves), no tree scan).
        now = self.clock()
        retained = [n for n in self.nodes if n.retain_until > now]
        self._unretained = [(self.policy.unretained(n), n.id, n) for n in self.nodes]
        self._retained = [(self.policy.retained(n), n.id, n) for n in retained]
        self._expiry = [(n.retain_until, n.id, n) for n in retained]
        for h in (self._unretained, self._retained, self._expiry):
            heapq.heapify(h)

    def check(self) -> str | None:
        """The first leaf without its current heap entries, as a message; None when exact."""
        now = self.clock()
        unretained = {(n.id, k) for k, _, n in self._unretained}
        retained = {(n.id, k) for k, _, n in self._retained}
        expiry = {(n.id, d) for d, _, n in self._expiry}
        for node in self.nodes:
            due = (node.id, node.retain_until)
            if node.retain_until > now:
                if (node.id, self.policy.retained(node)) not in retained or due not in expiry:
                    return f"retained {node!r} has no current retention/expiry heap entry"
            elif (node.id, self.policy.unretained(node)) not in unretained and due not in expiry:
                return f"{node!r} has no current entry in the unretained or expiry heap"
        return None
