"""Radix prefix cache over pages (host side: Python ints and numpy, no JAX).

A tree whose edges are token-id sequences and whose values are the KV slots holding those
tokens (``slot = page_id * page_size + offset``). Only whole pages are stored: every edge key
and value is a multiple of ``page_size`` long, and a value is a run of whole pages. Children are
indexed by their first page of tokens (a tuple of ``page_size`` ids; the bare token id when
``page_size == 1``), so two children of one node never share a first page.

Node split (inside ``match_prefix``/``insert``), page_size = 2, the match ends 2 pages in::

    before:  parent --[a b|c d|e f]--> child               value [8 9|4 5|12 13]
                            ^ split_len = 4 (a page boundary)
    after:   parent --[a b|c d]--> new_node --[e f]--> child
                       value [8 9|4 5]       value [12 13]

``new_node`` takes the head of the edge plus ``child``'s lock_ref and access time; ``child``
keeps its own identity (callers may hold it as a locked ``last_node``), its children and its
leaf status. Sizes do not change, so the evictable/protected counters need no update.

Ownership and mutation:
  * The tree owns the pages of every value in it; ``insert`` takes ownership of the newly
    stored pages, ``evict``/``reset`` give pages back to the allocator.
  * ``match_prefix`` mutates: it may split a node and it refreshes access times (LRU).
    ``peek_prefix`` is its read-only twin for ordering decisions: no split, no refresh, and
    it resumes from an earlier result (``version`` counts the changes of the tree's content).
  * ``inc_lock_ref(node)`` pins the path node..root. A node with ``lock_ref > 0`` is protected
    and never evicted; its tokens count in ``protected_size()``, the rest in
    ``evictable_size()``. Because a lock covers the whole path, a parent's lock_ref is at least
    the sum of its children's.
  * Evictable leaves (unlocked, childless, non-root) are kept in a `LeafQueue` (a set plus lazy
    heaps, see ``eviction.py``), updated as nodes change, so eviction never scans the tree.
  * Retention pins: ``pin(node, owner, deadline)`` stamps every node of the path node..root
    with ``pins[owner] = deadline`` (an owner's pin only grows); a node's ``retain_until`` is
    the largest of its pins. Until it passes, the node is evicted only after every unretained
    leaf (``eviction.py``). It never blocks anything: retained tokens still count in
    ``evictable_size()``. Owners are an open session's id, dropped all at once by
    ``unpin(owner)`` (a closed session) or moved by ``repin`` (a session's TTL renewed), or
    None for time-only pins (``retain(node, retain_s)``, ``insert(..., retain_s=...)``), which
    only expire. Since a pin stamps the whole path and a split copies the pins to the new head,
    a parent holds each of its children's pins with an equal or later deadline; so an evicted
    leaf takes nothing from its ancestors, and a parent's ``retain_until`` is at least each
    child's. Each owner's stamped nodes are indexed, so ``unpin`` walks only those.
  * Priority (``insert(..., priority=...)``): each node of the stored path keeps the highest
    priority of the requests that stored it, a parent's at least each child's; the
    ``priority`` eviction policy evicts low priorities first.

Namespaces: ``match_prefix``, ``peek_prefix`` and ``insert`` take a ``namespace`` (None: the
base model's tree under ``root``; a string, e.g. a LoRA adapter's digest: a root of its own).
No prefix is shared across namespaces, and a namespace root's chain hash is a seed derived from
its name (``namespace_seed``), so the lower tiers and KV events key its pages apart too::

    root (base)            --[a b|c d]--> ...
    roots["<adapter 1>"]   --[a b|c d]--> ...     same tokens, other KV, other hashes

Namespace roots are kept until ``reset`` (which empties them); they are never evicted.

``check_integrity()`` verifies all of the above by a full walk (for tests and idle checks).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.eviction import LeafQueue
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, chain_hashes, namespace_seed
from sgl_tpu.mem_cache.tree_node import TreeListener, TreeNode

_EMPTY_SLOTS = np.zeros(0, dtype=np.int32)
_EMPTY_KEY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class MatchResult:
    slots: np.ndarray  # int32 [prefix_len], prefix_len a multiple of page_size
    last_node: TreeNode  # deepest node of the match; ends exactly at prefix_len

    @property
    def prefix_len(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class PrefixPeek:
    """What `peek_prefix` found for a key; hand it back to `peek_prefix` with the same key.

    `node` is the deepest node whose whole edge matched (it ends `node_len` tokens in); the
    match may go `prefix_len - node_len` tokens further into one of its children."""

    prefix_len: int
    node: TreeNode
    node_len: int
    version: int  # the tree's `version` when found


class RadixCache:
    def __init__(self, allocator: PageAllocator, disable: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 listeners: Sequence[TreeListener] = (), eviction_policy: str = "lru") -> None:
        """``clock`` (seconds, never decreasing) times retention deadlines; tests inject one.
        ``eviction_policy``: a name in ``eviction.EVICTION_POLICIES``.

        ``listeners`` hear every leaf stored and removed (lower tiers, KV events); with any,
        the tree keeps each page's chain hash (``TreeNode.hashes``)."""
        self.allocator = allocator
        self.listeners: list[TreeListener] = []
        self.track_hashes = False
        self.page_size = allocator.page_size
        self.disable = disable
        self.clock = clock
        self.eviction_policy = eviction_policy
        self._node_ids = itertools.count()
        self._access_clock = itertools.count(1)  # logical LRU time, one tick per match/insert
        self.num_evicted_tokens = 0
        self.num_evicted_retained_tokens = 0  # evicted while still under retention
        self.version = 0
        # namespace -> its root (kept across resets, emptied: requests may hold them)
        self.roots: dict[str, TreeNode] = {}
        self._init_state()
        for listener in listeners:
            self.add_listener(listener)

    def _init_state(self) -> None:
        self.root = TreeNode(next(self._node_ids), None, _EMPTY_KEY, _EMPTY_SLOTS)
        for ns_root in self.roots.values():
            ns_root.children.clear()
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves = LeafQueue(self.clock, self.eviction_policy)
        # owner -> the nodes stamped with its pin (some may have been evicted since)
        self._pinned: dict[str, set[TreeNode]] = {}
        # Bumped whenever the stored content changes (a leaf added or deleted, a reset); a node
        # split keeps the content. Read by `peek_prefix` hints.
        self.version += 1
        # page -> held by the tree; catches a caller inserting pages the tree already owns.
        self._page_in_tree = np.zeros(self.allocator.num_pages, dtype=bool)

    def add_listener(self, listener: TreeListener) -> None:
        """Add a listener; only before anything is stored (hashes are kept from then on)."""
        if self.total_size():
            raise RuntimeError("listeners are added to an empty tree")
        self.listeners.append(listener)
        self.track_hashes = True

    def root_of(self, namespace: str | None) -> TreeNode:
        """The root of `namespace`'s tree (None: the base model's), made on first use."""
        if namespace is None:
            return self.root
        node = self.roots.get(namespace)
        if node is None:
            seed = np.frombuffer(namespace_seed(namespace), dtype=np.uint8)[None, :]
            node = self.roots[namespace] = TreeNode(
                next(self._node_ids), None, _EMPTY_KEY, _EMPTY_SLOTS, hashes=seed,
                namespace=namespace)
        return node

    @staticmethod
    def namespace_of(node: TreeNode) -> str | None:
        """The namespace of the tree `node` is in."""
        while node.parent is not None:
            node = node.parent
        return node.namespace

    # ---- sizes -------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def num_pages_held(self) -> int:
        return self.total_size() // self.page_size

    def retained_size(self) -> int:
        """Tokens under retention now (locked or not). A full walk: for stats, not hot paths."""
        now = self.clock()
        return sum(len(n.key) for n in self._walk() if n.retain_until > now)

    # ---- match / insert ----------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int] | np.ndarray, namespace: str | None = None
                     ) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``: its slots and the node ending there.

        Splits a node when the match ends inside its edge, and refreshes access times along the
        matched path. Does not lock: call ``inc_lock_ref(result.last_node)`` to pin the prefix.
        """
        if self.disable:
            return MatchResult(_EMPTY_SLOTS, self.root)
        key = self._page_aligned(np.asarray(key, dtype=np.int32))
        now = next(self._access_clock)
        node = self.root_of(namespace)
        values: list[np.ndarray] = []
        while len(key) and (child := node.children.get(self._page_key(key))) is not None:
            match_len = self._match_len(child.key, key)
            if match_len < len(child.key):
                child = self._split_node(child, match_len)
            self._touch(child, now)
            values.append(child.value)
            node = child
            key = key[match_len:]  # after a split the next page differs: the loop ends
        slots = np.concatenate(values) if values else _EMPTY_SLOTS
        return MatchResult(slots, node)

    def peek_prefix(self, key: Callable[[], Sequence[int] | np.ndarray],
                    hint: PrefixPeek | None = None, namespace: str | None = None
                    ) -> PrefixPeek:
        """The prefix length `match_prefix(key())` would give, without changing the tree.

        `key` is called only when the tree must be walked, and only its part past the hint's
        node is converted (cheap for a long list resumed near its end). `hint`: this method's
        earlier result for a key that has not changed since. Unchanged content: the hint is
        returned as is. Otherwise the walk resumes at the hint's node while that node is still
        in the tree (it then still ends where it did: only leaves are deleted, and a split keeps
        the lower node), else it starts at the root.
        """
        if self.disable:
            return PrefixPeek(0, self.root, 0, self.version)
        if hint is not None and hint.version == self.version:
            return hint
        node, node_len = self.root_of(namespace), 0
        if hint is not None and (hint.node.parent is not None or hint.node is node):
            node, node_len = hint.node, hint.node_len
        rest = self._page_aligned(np.asarray(key()[node_len:], dtype=np.int32))
        while len(rest) and (child := node.children.get(self._page_key(rest))) is not None:
            match_len = self._match_len(child.key, rest)
            if match_len < len(child.key):
                return PrefixPeek(node_len + match_len, node, node_len, self.version)
            node, node_len = child, node_len + match_len
            rest = rest[match_len:]
        return PrefixPeek(node_len, node, node_len, self.version)

    def insert(self, key: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
               retain_s: float = 0.0, priority: int = 0, namespace: str | None = None) -> int:
        """Store the page-aligned part of ``key`` -> ``slots``; return the cached prefix length.

        ``retain_s > 0`` then retains the whole stored path (see ``retain``); every node of the
        path keeps at least ``priority``.

        ``len(slots)`` must equal ``len(key)``; both are cut to ``aligned_len`` (the largest
        multiple of page_size <= len(key)). The return value ``prefix_len`` is the length of
        the prefix that was ALREADY in the tree (page aligned, <= aligned_len).

        Ownership contract (the caller held every page of ``slots`` before the call):
          * ``slots[prefix_len:aligned_len]``: now owned by the tree; the caller must not free
            them (it should pin them with ``inc_lock_ref`` if it keeps using them).
          * ``slots[cached_len:prefix_len]``, where ``cached_len`` is the prefix the caller got
            from ``match_prefix`` and kept locked: duplicates of pages the tree already has;
            the caller frees them (``allocator.slots_to_pages``) and, if it keeps running, reads
            the tree's slots with a new ``match_prefix``.
          * ``slots[aligned_len:]`` (the partial last page): still the caller's.
          * ``slots[:cached_len]`` were the tree's all along.
        With ``disable=True`` nothing is stored and 0 is returned: the tree takes no pages, so
        the caller keeps (and must eventually free) all of its own pages.
        """
        key = np.asarray(key, dtype=np.int32)
        slots = np.asarray(slots, dtype=np.int32)
        if key.shape != slots.shape or key.ndim != 1:
            raise ValueError(f"key and slots differ in shape: {key.shape} vs {slots.shape}")
        if self.disable:
            return 0
        key = self._page_aligned(key)
        slots = slots[: len(key)]
        now = next(self._access_clock)
        node = self.root_of(namespace)
        prefix_len = 0
        while len(key) and (child := node.children.get(self._page_key(key))) is not None:
            match_len = self._match_len(child.key, key)
            if match_len < len(child.key):
                child = self._split_node(child, match_len)
            if child.priority < priority:
                child.priority = priority
                self._evictable_leaves.priority_changed(child)
            self._touch(child, now)
            node = child
            prefix_len += match_len
            key = key[match_len:]
            slots = slots[match_len:]
        if len(key):
            node = self._add_leaf(node, key.copy(), slots.copy(), now)
            if node.priority != priority:  # a new leaf: its own priority, even a negative one
                node.priority = priority
                self._evictable_leaves.priority_changed(node)
        if retain_s > 0:
            self.retain(node, retain_s)
        return prefix_len

    def retain(self, node: TreeNode, retain_s: float) -> None:
        """Evict the path node..root only after every unretained leaf, for ``retain_s`` seconds
        (a time-only pin: ``pin(node, None, clock() + retain_s)``).

        For an agent's trajectory between turns: its next request resends it."""
        self.pin(node, None, self.clock() + retain_s)

    def pin(self, node: TreeNode, owner: str | None, deadline: float) -> None:
        """Pin the path node..root for ``owner`` until ``deadline`` (seconds on the clock).

        An owner's pin on a node only grows; the walk stops at the first node whose pin is
        already as late (its ancestors' are too). A no-op on the root (a disabled cache matches
        nothing else)."""
        self._check_attached(node)
        stamped = None if owner is None else self._pinned.setdefault(owner, set())
        while not node.is_root and node.pins.get(owner, 0.0) < deadline:
            node.pins[owner] = deadline
            if stamped is not None:
                stamped.add(node)
            if node.retain_until < deadline:
                node.retain_until = deadline
                self._evictable_leaves.retention_changed(node)
            node = node.parent

    def repin(self, owner: str, deadline: float) -> None:
        """Move every pin of ``owner`` to ``deadline`` (later or earlier: a renewed TTL)."""
        for node in self._stamped(owner):
            node.pins[owner] = deadline
            self._update_retention(node)

    def unpin(self, owner: str) -> None:
        """Drop every pin of ``owner`` (a closed or expired session): its nodes keep only
        their other pins, and those no other pin covers are plain evictable KV again."""
        for node in self._stamped(owner):
            del node.pins[owner]
            self._update_retention(node)
        self._pinned.pop(owner, None)

    def pinned_size(self, owner: str) -> int:
        """Tokens ``owner`` pins now (locked or not)."""
        now = self.clock()
        return sum(len(n.key) for n in self._stamped(owner) if n.pins[owner] > now)

    def _stamped(self, owner: str) -> list[TreeNode]:
        """The nodes still in the tree that carry ``owner``'s pin (evicted ones are dropped
        from the index here)."""
        stamped = self._pinned.get(owner, set())
        stamped.difference_update([n for n in stamped if n.parent is None])
        return list(stamped)

    def _update_retention(self, node: TreeNode) -> None:
        deadline = max(node.pins.values(), default=0.0)
        if deadline != node.retain_until:
            node.retain_until = deadline
            self._evictable_leaves.retention_changed(node)

    # ---- locking -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin the path node..root so none of it can be evicted."""
        self._check_attached(node)
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; RuntimeError if ``node`` is not locked."""
        self._check_attached(node)
        if not node.is_root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref below zero on {node!r}")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable_leaf(node)
            node = node.parent

    # ---- eviction / reset --------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` tokens are freed or
        nothing evictable is left; return the number of tokens freed (a multiple of page_size,
        possibly more than asked since leaves go whole)."""
        num_freed = 0
        now = self.clock()
        while num_freed < num_tokens:
            node = self._evictable_leaves.pop(now)
            if node is None:
                break
            num_freed += len(node.key)
            if node.retain_until > now:
                self.num_evicted_retained_tokens += len(node.key)
            self._delete_leaf(node)
        self.num_evicted_tokens += num_freed
        return num_freed

    def reset(self) -> None:
        """Give every page of the tree back to the allocator and empty the tree.

        RuntimeError if any node is locked (a running request still uses the tree)."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens in the tree")
        if self.listeners:
            nodes = [n for n in self._walk() if not n.is_root]
            for listener in self.listeners:
                listener.clearing(nodes)
        values = []
        for node in self._walk():
            if not node.is_root:
                values.append(node.value)
                node.parent = None  # stale handles now fail _check_attached
        if values:
            self.allocator.free(self.allocator.slots_to_pages(np.concatenate(values)))
        self._init_state()

    # ---- internals ---------------------------------------------------------------------------

    def _page_aligned(self, key: np.ndarray) -> np.ndarray:
        return key[: len(key) - len(key) % self.page_size]

    def _page_key(self, key: np.ndarray) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return int(key[0])
        return tuple(key[: self.page_size].tolist())

    def _match_len(self, edge: np.ndarray, key: np.ndarray) -> int:
        """Length of the common prefix of two page-aligned keys, rounded down to a page."""
        n = min(len(edge), len(key))
        mismatch = np.flatnonzero(edge[:n] != key[:n])
        common = int(mismatch[0]) if mismatch.size else n
        return common - common % self.page_size

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child``'s edge at ``split_len`` (a page boundary); return the new head node."""
        parent = child.parent
        new_node = TreeNode(
            next(self._node_ids),
            parent,
            child.key[:split_len],
            child.value[:split_len],
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
            retain_until=child.retain_until,
            hashes=None if child.hashes is None else child.hashes[: split_len // self.page_size],
            pins=dict(child.pins),  # the head is on every path the child's pins stamped
            priority=child.priority,
        )
        for owner in child.pins:
            if owner is not None:
                self._pinned[owner].add(new_node)
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        if child.hashes is not None:
            child.hashes = child.hashes[split_len // self.page_size:]
        child.parent = new_node
        new_node.children[self._page_key(child.key)] = child
        parent.children[self._page_key(new_node.key)] = new_node
        return new_node

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: np.ndarray, now: int
                  ) -> TreeNode:
        pages = self.allocator.slots_to_pages(value)
        # [num_pages, page_size]: each row must be one whole page, offsets 0..page_size-1.
        rows = value.reshape(-1, self.page_size)
        if np.any(rows - rows[:, :1] != np.arange(self.page_size, dtype=np.int32)):
            raise ValueError("insert: slots are not runs of whole pages")
        if np.any(self._page_in_tree[pages]) or np.any(self.allocator.is_page_free(pages)):
            raise ValueError("insert: new slots use pages that are free or already in the tree")
        if np.unique(pages).size != pages.size:
            raise ValueError("insert: a page appears twice in the new slots")
        self._page_in_tree[pages] = True
        hashes = None
        if self.track_hashes:
            hashes = chain_hashes(parent.last_hash() or ROOT_HASH, key, self.page_size)
        leaf = TreeNode(next(self._node_ids), parent, key, value, last_access_time=now,
                        hashes=hashes)
        self.version += 1
        parent.children[self._page_key(key)] = leaf
        self._evictable_leaves.discard(parent)  # no longer a leaf
        self._evictable_size += len(key)
        self._add_evictable_leaf(leaf)
        for listener in self.listeners:
            listener.stored(leaf)
        return leaf

    def _delete_leaf(self, node: TreeNode) -> None:
        for listener in self.listeners:
            listener.removing(node)
        self.version += 1
        parent = node.parent
        del parent.children[self._page_key(node.key)]
        node.parent = None
        self._evictable_leaves.discard(node)
        self._evictable_size -= len(node.key)
        pages = self.allocator.slots_to_pages(node.value)
        self._page_in_tree[pages] = False
        self.allocator.free(pages)
        if not parent.is_root and parent.lock_ref == 0 and not parent.children:
            self._add_evictable_leaf(parent)

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access_time = now
        self._evictable_leaves.touched(node)

    def _add_evictable_leaf(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node)

    def _check_attached(self, node: TreeNode) -> None:
        if not node.is_root and node.parent is None:
            raise RuntimeError(f"{node!r} is no longer in the tree (evicted or reset)")

    def nodes(self) -> list[TreeNode]:
        """Every node of the tree but the roots (a snapshot)."""
        return [node for node in self._walk() if not node.is_root]

    def _walk(self) -> list[TreeNode]:
        nodes, stack = [], [self.root, *self.roots.values()]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    # ---- debugging ---------------------------------------------------------------------------

    def pretty_print(self) -> str:
        lines, stack = [], [(root, 0) for root in (self.root, *self.roots.values())]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}{node.key.tolist()} -> {node.value.tolist()} "
                f"lock={node.lock_ref} t={node.last_access_time} retain={node.retain_until}"
            )
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Full walk; RuntimeError naming the first broken invariant."""

        def fail(msg: str) -> None:
            raise RuntimeError(f"radix cache integrity: {msg}")

        ps = self.page_size
        evictable = protected = 0
        pages_seen: list[np.ndarray] = []
        leaves: set[TreeNode] = set()
        for node in self._walk():
            child_locks = 0
            for page_key, child in node.children.items():
                if child.parent is not node:
                    fail(f"{child!r} has a wrong parent pointer")
                if len(child.key) == 0 or self._page_key(child.key) != page_key:
                    fail(f"{child!r} is indexed under {page_key}, its key starts differently")
                if child.last_access_time > node.last_access_time and not node.is_root:
                    fail(f"{child!r} was accessed after its parent {node!r}")
                if child.retain_until > node.retain_until and not node.is_root:
                    fail(f"{child!r} is retained longer than its parent {node!r}")
                if not node.is_root and any(node.pins.get(owner, -1.0) < deadline
                                                 for owner, deadline in child.pins.items()):
                    fail(f"{child!r} has a pin its parent {node!r} lacks or ends sooner")
                if child.priority > node.priority and not node.is_root:
                    fail(f"{child!r} has a higher priority than its parent {node!r}")
                child_locks += child.lock_ref
            if node.is_root:
                if len(node.key) or node.lock_ref or node.retain_until or node.pins:
                    fail("root has a key, a lock_ref or a retention deadline")
                continue
            if node.retain_until != max(node.pins.values(), default=0.0):
                fail(f"{node!r} retain_until {node.retain_until} is not its pins' maximum")
            for owner in node.pins:
                if owner is not None and node not in self._pinned.get(owner, ()):
                    fail(f"{node!r} carries a pin of {owner!r} that is not indexed")
            if node.lock_ref < 0:
                fail(f"{node!r} has a negative lock_ref")
            if node.lock_ref < child_locks:
                fail(f"{node!r} lock_ref {node.lock_ref} < children's total {child_locks}")
            n = len(node.key)
            if n == 0 or n % ps or len(node.value) != n:
                fail(f"{node!r}: key length {n}, value length {len(node.value)}, page {ps}")
            rows = node.value.reshape(-1, ps)
            if np.any(rows[:, 0] % ps) or np.any(rows - rows[:, :1] != np.arange(ps)):
                fail(f"{node!r} value is not runs of whole pages: {node.value.tolist()}")
            pages_seen.append(rows[:, 0] // ps)
            if self.track_hashes:
                expected = chain_hashes(node.parent.last_hash() or ROOT_HASH, node.key, ps)
                if node.hashes is None or not np.array_equal(node.hashes, expected):
                    fail(f"{node!r} page hashes do not chain from its parent's")
            if node.lock_ref:
                protected += n
            else:
                evictable += n
                if not node.children:
                    leaves.add(node)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            fail(
                f"sizes evictable/protected {self._evictable_size}/{self._protected_size}, "
                f"tree holds {evictable}/{protected}"
            )
        pages = np.concatenate(pages_seen) if pages_seen else np.zeros(0, dtype=np.int32)
        if np.unique(pages).size != pages.size:
            fail("a page appears twice in the tree")
        if pages.size and (pages.min() < 1 or pages.max() >= self.allocator.num_pages):
            fail("a tree page id is out of range")
        if np.any(self.allocator.is_page_free(pages)):
            fail("a tree page is also on the allocator's free list")
        in_tree = np.zeros_like(self._page_in_tree)
        in_tree[pages] = True
        if not np.array_equal(in_tree, self._page_in_tree):
            fail("page ownership map disagrees with the tree")
        if leaves != self._evictable_leaves.nodes:
            fail(f"evictable leaves tracked {len(self._evictable_leaves)}, tree has {len(leaves)}")
        if (problem := self._evictable_leaves.check()) is not None:
            fail(problem)


def check_page_accounting(
    allocator: PageAllocator, cache: RadixCache, held_by_requests: int
) -> None:
    """RuntimeError unless free + tree + request-held pages == usable pages (leak/double use)."""
    free, tree = allocator.num_free_pages, cache.num_pages_held()
    if free + tree + held_by_requests != allocator.num_usable_pages:
        raise RuntimeError(
            f"page accounting: free {free} + tree {tree} + requests {held_by_requests} "
            f"!= usable {allocator.num_usable_pages}"
        )
