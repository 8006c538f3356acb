"""Page allocator and radix cache: unit tests plus a stateful test against a naive model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sgl_tpu.mem_cache import (
    PageAllocator,
    RadixCache,
    check_page_accounting,
    pages_to_slots,
    slots_to_pages,
)


def make_cache(page_size: int, num_pages: int = 64, disable: bool = False):
    allocator = PageAllocator(num_pages, page_size)
    return allocator, RadixCache(allocator, disable=disable)


def insert_new(allocator: PageAllocator, cache: RadixCache, key: list[int]) -> np.ndarray:
    """Scheduler-style insert of a finished request; returns the slots the tree now holds."""
    match = cache.match_prefix(key)
    cache.inc_lock_ref(match.last_node)
    cached_len = match.prefix_len
    ps = allocator.page_size
    pages = allocator.alloc(-(-(len(key) - cached_len) // ps))
    assert pages is not None
    slots = np.concatenate([match.slots, allocator.pages_to_slots(pages, len(key) - cached_len)])
    prefix_len = cache.insert(key, slots)
    aligned_len = len(key) - len(key) % ps
    allocator.free(allocator.slots_to_pages(slots[cached_len:prefix_len]))
    allocator.free(allocator.slots_to_pages(slots[aligned_len:]))
    cache.dec_lock_ref(match.last_node)
    return slots[:aligned_len]


# ---- allocator -------------------------------------------------------------------------------


def test_allocator_alloc_free():
    allocator = PageAllocator(num_pages=8, page_size=4)
    assert allocator.num_usable_pages == 7 and allocator.num_free_pages == 7
    pages = allocator.alloc(3)
    assert pages.dtype == np.int32 and pages.tolist() == [1, 2, 3]
    assert allocator.alloc(5) is None and allocator.num_free_pages == 4
    allocator.free(pages[:2])
    assert allocator.num_free_pages == 6
    with pytest.raises(ValueError, match="double free"):
        allocator.free([1])
    with pytest.raises(ValueError):
        allocator.free([0])
    with pytest.raises(ValueError):
        allocator.free([8])
    with pytest.raises(ValueError, match="double free"):
        allocator.free([3, 3])
    assert allocator.num_free_pages == 6  # failed frees free nothing
    assert allocator.alloc(0).size == 0
    allocator.reset()
    assert allocator.num_free_pages == 7 and allocator.alloc(1).tolist() == [1]


def test_pages_slots_roundtrip():
    slots = pages_to_slots([7, 2], 6, page_size=4)
    assert slots.dtype == np.int32 and slots.tolist() == [28, 29, 30, 31, 8, 9]
    assert slots_to_pages(slots, page_size=4).tolist() == [7, 2]
    with pytest.raises(ValueError):
        slots_to_pages([29, 30], page_size=4)
    with pytest.raises(ValueError):
        pages_to_slots([7], 5, page_size=4)


# ---- radix cache units -----------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_on_empty_tree(page_size):
    _, cache = make_cache(page_size)
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert match.slots.size == 0 and match.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_then_match(page_size):
    allocator, cache = make_cache(page_size)
    key = list(range(100, 110))
    stored = insert_new(allocator, cache, key)
    aligned = 10 - 10 % page_size
    assert cache.total_size() == aligned == len(stored)
    match = cache.match_prefix(key + [1, 2])
    assert match.slots.dtype == np.int32 and match.slots.tolist() == stored.tolist()
    other = key[:5] + [0] + key[6:]
    assert cache.match_prefix(other).prefix_len == 5 - 5 % page_size
    cache.check_integrity()
    check_page_accounting(allocator, cache, held_by_requests=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_split_in_middle_of_edge(page_size):
    allocator, cache = make_cache(page_size)
    key = list(range(3 * page_size))
    stored = insert_new(allocator, cache, key)
    (edge,) = cache.root.children.values()
    # Diverge inside the second page: the match stops at the first page boundary.
    query = key[: page_size + page_size // 2] + [999] * page_size
    match = cache.match_prefix(query)
    assert match.prefix_len == page_size and match.slots.tolist() == stored[:page_size].tolist()
    head = match.last_node
    assert head is not edge and len(head.key) == page_size and head.parent is cache.root
    assert list(head.children.values()) == [edge] and len(edge.key) == 2 * page_size
    cache.check_integrity()
    # A diverging insert hangs off the split node.
    assert cache.insert(query[: 2 * page_size], _fresh_slots(allocator, 2 * page_size)) == (
        page_size
    )
    assert len(head.children) == 2
    cache.check_integrity()


def _fresh_slots(allocator: PageAllocator, num_tokens: int) -> np.ndarray:
    pages = allocator.alloc(-(-num_tokens // allocator.page_size))
    return allocator.pages_to_slots(pages, num_tokens)


def test_insert_returns_existing_prefix_len():
    allocator, cache = make_cache(page_size=2)
    assert cache.insert([1, 2, 3, 4], _fresh_slots(allocator, 4)) == 0
    dup = _fresh_slots(allocator, 6)
    assert cache.insert([1, 2, 3, 4, 5, 6], dup) == 4
    allocator.free(allocator.slots_to_pages(dup[:4]))  # caller frees its duplicates
    cache.check_integrity()  # the old leaf [1..4] gained a child: no longer evictable alone
    assert cache.insert([1, 2, 3, 4, 5, 6], _fresh_slots(allocator, 6)) == 6
    assert cache.total_size() == 6
    with pytest.raises(ValueError):
        cache.insert([1, 2], [4, 5, 6])
    # Pages already in the tree cannot be inserted again under another key.
    with pytest.raises(ValueError):
        cache.insert([9, 9], dup[4:6])


def test_lock_unlock_size_accounting():
    allocator, cache = make_cache(page_size=2)
    insert_new(allocator, cache, [1, 2, 3, 4, 5, 6])
    insert_new(allocator, cache, [1, 2, 7, 8])
    assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 6)
    cache.inc_lock_ref(node)
    other = cache.match_prefix([1, 2, 7, 8]).last_node
    cache.inc_lock_ref(other)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 8)
    cache.check_integrity()
    cache.dec_lock_ref(node)
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (4, 4)
    cache.dec_lock_ref(other)
    assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    with pytest.raises(RuntimeError, match="below zero"):
        cache.dec_lock_ref(other)
    cache.check_integrity()


def test_evict_respects_locks_and_lru_order():
    allocator, cache = make_cache(page_size=1)
    insert_new(allocator, cache, [1, 1])  # oldest
    insert_new(allocator, cache, [2, 2])
    insert_new(allocator, cache, [3, 3])
    locked = cache.match_prefix([1, 1]).last_node  # refreshes [1, 1]: now newest
    cache.inc_lock_ref(locked)
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).prefix_len == 0  # LRU unlocked leaf went first
    assert cache.evict(100) == 2  # [3, 3]; the locked path survives
    assert cache.match_prefix([1, 1]).prefix_len == 2 and cache.evictable_size() == 0
    cache.dec_lock_ref(locked)
    assert cache.evict(1) == 2
    assert cache.total_size() == 0
    cache.check_integrity()
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(locked)  # evicted handle


def test_evict_parent_becomes_candidate_and_pages_return():
    allocator, cache = make_cache(page_size=4, num_pages=16)
    insert_new(allocator, cache, list(range(8)))
    insert_new(allocator, cache, list(range(4)) + [9] * 8)  # splits: [0..3] -> {[4..7], [9..]}
    assert allocator.num_free_pages == 15 - 4
    assert cache.evict(1000) == 16
    assert allocator.num_free_pages == 15 and cache.root.children == {}
    check_page_accounting(allocator, cache, held_by_requests=0)


def test_disable_never_matches():
    allocator, cache = make_cache(page_size=2, disable=True)
    slots = _fresh_slots(allocator, 4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.prefix_len == 0 and match.last_node is cache.root
    cache.inc_lock_ref(match.last_node)  # the root: a no-op, same code path
    cache.dec_lock_ref(match.last_node)
    assert cache.total_size() == 0 and cache.evict(10) == 0
    check_page_accounting(allocator, cache, held_by_requests=2)  # caller still owns them


def test_unaligned_keys_are_truncated():
    allocator, cache = make_cache(page_size=4)
    slots = _fresh_slots(allocator, 7)
    assert cache.insert(list(range(7)), slots) == 0
    assert cache.total_size() == 4
    assert cache.match_prefix(list(range(7))).slots.tolist() == slots[:4].tolist()
    assert cache.match_prefix(list(range(3))).prefix_len == 0


def test_reset():
    allocator, cache = make_cache(page_size=2)
    insert_new(allocator, cache, [1, 2, 3, 4])
    insert_new(allocator, cache, [5, 6])
    node = cache.match_prefix([5, 6]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and allocator.num_free_pages == allocator.num_usable_pages
    assert cache.match_prefix([1, 2]).prefix_len == 0
    cache.check_integrity()


def test_check_integrity_catches_corruption():
    allocator, cache = make_cache(page_size=2)
    insert_new(allocator, cache, [1, 2, 3, 4])
    (node,) = cache.root.children.values()
    node.lock_ref = 1
    with pytest.raises(RuntimeError, match="sizes"):
        cache.check_integrity()
    node.lock_ref = 0
    allocator.free(allocator.slots_to_pages(node.value[:2]))  # a page both free and in the tree
    with pytest.raises(RuntimeError, match="free list"):
        cache.check_integrity()
    with pytest.raises(RuntimeError, match="page accounting"):
        check_page_accounting(allocator, cache, held_by_requests=0)


# ---- stateful property test ------------------------------------------------------------------

# Page patterns per page size; patterns 0 and 1 share all but their last token, so matches
# that stop inside a page (and must round down) are common.
PATTERNS = {
    1: [(0,), (1,), (2,)],
    3: [(0, 0, 0), (0, 0, 1), (1, 2, 0)],
    4: [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 1, 0)],
}
# (source key, cut length in tokens, extra page patterns, tail): a key is a cut of an earlier
# key (so prefixes are shared and often end mid-page) plus new pages plus a partial page.
abstract_keys = st.tuples(
    st.integers(0, 7),
    st.integers(0, 28),
    st.lists(st.integers(0, 2), max_size=3),
    st.lists(st.integers(0, 2), max_size=3),
)
MAX_KEY_PAGES = 8


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives the cache as a scheduler would and compares it with a dict of page prefixes.

    Model: ``stored`` maps every stored page-aligned prefix (a tuple) to the page id of its last
    page; ``stamp`` holds each prefix's last access (our own clock, only the order matters);
    ``pins`` each prefix's retention pins by owner (None: time-only; "s0"/"s1": open sessions,
    whose deadlines are in ``sessions``) on the cache's injected clock ``now``; ``prio`` each
    prefix's priority. A request = (key, slots, cached_len, last_node, pages it holds itself).
    """

    @initialize(page_size=st.sampled_from([1, 3, 4]), disable=st.sampled_from([False] * 4 + [True]),
                policy=st.sampled_from(["lru", "priority"]))
    def setup(self, page_size, disable, policy):
        self.ps = page_size
        self.allocator = PageAllocator(num_pages=24, page_size=page_size)
        self.now = 1.0
        self.cache = RadixCache(self.allocator, disable=disable, clock=lambda: self.now,
                                eviction_policy=policy)
        self.policy = policy
        self.disable = disable
        self.stored: dict[tuple[int, ...], int] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.pins: dict[tuple[int, ...], dict[str | None, float]] = {}
        self.prio: dict[tuple[int, ...], int] = {}
        self.sessions: dict[str, float] = {}  # open session -> its pins' deadline
        self.clock = 0
        self.requests: list[tuple[list[int], np.ndarray, int, object, int]] = []
        self.seen_keys: list[list[int]] = []
        self.peeks: dict[tuple[int, ...], object] = {}  # watched key -> its last PrefixPeek

    # -- model helpers --

    def key(self, abstract) -> list[int]:
        source, cut, pages, tail = abstract
        base = self.seen_keys[source % len(self.seen_keys)][:cut] if self.seen_keys else []
        key = base + [t for c in pages for t in PATTERNS[self.ps][c]] + tail[: self.ps - 1]
        key = key[: MAX_KEY_PAGES * self.ps]
        self.seen_keys = (self.seen_keys + [key])[-8:]
        return key

    def longest(self, key) -> int:
        p = 0
        while p + self.ps <= len(key) and tuple(key[: p + self.ps]) in self.stored:
            p += self.ps
        return p

    def touch(self, key, length) -> None:
        self.clock += 1
        for q in range(self.ps, length + 1, self.ps):
            self.stamp[tuple(key[:q])] = self.clock

    def pin(self, key, length, owner, deadline) -> None:
        for q in range(self.ps, length + 1, self.ps):
            pins = self.pins.setdefault(tuple(key[:q]), {})
            pins[owner] = max(pins.get(owner, 0.0), deadline)

    def deadline(self, prefix) -> float:
        return max(self.pins.get(prefix, {}).values(), default=0.0)

    def evict_key(self, prefix) -> tuple:
        """Eviction order: unretained by last access, then retained, latest deadline first;
        the priority policy puts the lower priority first within each class."""
        deadline = self.deadline(prefix)
        prio = (self.prio.get(prefix, 0),) if self.policy == "priority" else ()
        if deadline > self.now:
            return (1, *prio, -deadline)
        return (0, *prio, self.stamp[prefix])

    def tree_contents(self) -> dict[tuple[int, ...], int]:
        out, stack = {}, [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            key, value = node.key.tolist(), node.value.tolist()
            for q in range(self.ps, len(key) + 1, self.ps):
                out[prefix + tuple(key[:q])] = value[q - self.ps] // self.ps
            stack.extend((c, prefix + tuple(key)) for c in node.children.values())
        return out

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {
            tuple(key[:q])
            for key, _, cached_len, _, _ in self.requests
            for q in range(self.ps, cached_len + 1, self.ps)
        }

    def check_match(self, key):
        match = self.cache.match_prefix(key)
        expected = 0 if self.disable else self.longest(key)
        assert match.prefix_len == expected
        pages = [self.stored[tuple(key[:q])] for q in range(self.ps, expected + 1, self.ps)]
        assert match.slots.tolist() == pages_to_slots(pages, expected, self.ps).tolist()
        self.touch(key, expected)
        return match

    def evict_and_check(self, num_tokens: int, matching: tuple[list[int], int] = ([], 0)
                        ) -> None:
        """`matching`: (key, matched length) of a request being admitted: its match is locked
        in the cache before the eviction, but not yet in `self.requests`."""
        before, evictable = dict(self.stored), self.cache.evictable_size()
        free_before = self.allocator.num_free_pages
        freed = self.cache.evict(num_tokens)
        after = self.tree_contents()
        assert after.items() <= before.items()
        removed = before.keys() - after.keys()
        assert freed == len(removed) * self.ps
        assert self.allocator.num_free_pages - free_before == len(removed)
        assert min(num_tokens, evictable) <= freed <= evictable
        key, matched = matching
        locked = self.locked_prefixes() | {tuple(key[:q])
                                           for q in range(self.ps, matched + 1, self.ps)}
        assert locked <= after.keys()
        if removed:
            # Each victim was the first in eviction order among the leaves of its moment, so
            # no unlocked leaf that was there all along comes before any victim. (A parent
            # bared by the eviction may come earlier: a retained parent's deadline is later.)
            last_removed = max(self.evict_key(p) for p in removed)
            leaves_before = before.keys() - {p[: -self.ps] for p in before}
            for p in (after.keys() & leaves_before) - locked:
                assert self.evict_key(p) >= last_removed, (p, self.evict_key(p), last_removed)
        self.stored = after
        for p in removed:  # a page stored again later starts unretained
            self.pins.pop(p, None)
            self.prio.pop(p, None)

    # -- rules --

    @precondition(lambda self: len(self.requests) < 4)
    @rule(abstract=abstract_keys)
    def start_request(self, abstract):
        key = self.key(abstract)
        match = self.check_match(key)
        self.cache.inc_lock_ref(match.last_node)
        cached_len = match.prefix_len
        num_pages = -(-(len(key) - cached_len) // self.ps)
        if num_pages > self.allocator.num_free_pages:
            self.evict_and_check((num_pages - self.allocator.num_free_pages) * self.ps,
                                 matching=(key, cached_len))
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            self.cache.dec_lock_ref(match.last_node)
            return
        own = pages_to_slots(pages, len(key) - cached_len, self.ps)
        slots = np.concatenate([match.slots, own])
        self.requests.append((key, slots, cached_len, match.last_node, num_pages))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        key, slots, cached_len, node, _ = self.requests.pop(i)
        retain_s = data.draw(st.sampled_from([0.0, 4.0, 10.0]))
        priority = data.draw(st.sampled_from([0, 0, 1, 5, -2]))
        aligned = len(key) - len(key) % self.ps
        expected_prefix = self.longest(key[:aligned])
        prefix_len = self.cache.insert(key, slots, retain_s, priority)
        if self.disable:
            assert prefix_len == 0
            self.allocator.free(slots_to_pages(slots[cached_len:], self.ps))
        else:
            assert prefix_len == expected_prefix and prefix_len >= cached_len
            self.allocator.free(slots_to_pages(slots[cached_len:prefix_len], self.ps))
            self.allocator.free(slots_to_pages(slots[aligned:], self.ps))
            for q in range(prefix_len + self.ps, aligned + 1, self.ps):
                self.stored[tuple(key[:q])] = int(slots[q - self.ps]) // self.ps
            self.touch(key, aligned)
            for q in range(self.ps, aligned + 1, self.ps):  # a new page takes the priority,
                p = tuple(key[:q])  # a cached one keeps the highest
                self.prio[p] = priority if q > prefix_len else max(self.prio[p], priority)
            if retain_s:
                self.pin(key, aligned, None, self.now + retain_s)
        owner = data.draw(st.sampled_from([None, *sorted(self.sessions)]))
        if owner is not None:  # a turn of an open session: its whole path is pinned
            match = self.check_match(key[:aligned])
            self.cache.pin(match.last_node, owner, self.sessions[owner])
            if not self.disable:
                self.pin(key, aligned, owner, self.sessions[owner])
        self.cache.dec_lock_ref(node)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        _, slots, cached_len, node, _ = self.requests.pop(i)
        self.allocator.free(slots_to_pages(slots[cached_len:], self.ps))
        self.cache.dec_lock_ref(node)

    @rule(abstract=abstract_keys)
    def match(self, abstract):
        self.check_match(self.key(abstract))

    @rule(abstract=abstract_keys, retain_s=st.sampled_from([3.0, 10.0]))
    def retain_match(self, abstract, retain_s):
        """A request of a session arrives: its cached prefix is retained (KVManager)."""
        key = self.key(abstract)
        match = self.check_match(key)
        self.cache.retain(match.last_node, retain_s)
        if not self.disable:
            self.pin(key, match.prefix_len, None, self.now + retain_s)

    @rule(owner=st.sampled_from(["s0", "s1"]), ttl=st.sampled_from([2.0, 6.0, 20.0]))
    def renew_session(self, owner, ttl):
        """A session opens, or a request of it renews its TTL: every pin of it moves."""
        self.sessions[owner] = self.now + ttl
        self.cache.repin(owner, self.now + ttl)
        for pins in self.pins.values():
            if owner in pins:
                pins[owner] = self.now + ttl

    @precondition(lambda self: self.sessions)
    @rule(abstract=abstract_keys, data=st.data())
    def pin_session(self, abstract, data):
        """A request of an open session: its cached prefix is pinned until the session's
        deadline."""
        owner = data.draw(st.sampled_from(sorted(self.sessions)))
        key = self.key(abstract)
        match = self.check_match(key)
        self.cache.pin(match.last_node, owner, self.sessions[owner])
        if not self.disable:
            self.pin(key, match.prefix_len, owner, self.sessions[owner])

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close_session(self, data):
        """/close_session: the session's pins are dropped, its KV is plain evictable KV."""
        owner = data.draw(st.sampled_from(sorted(self.sessions)))
        del self.sessions[owner]
        self.cache.unpin(owner)
        for pins in self.pins.values():
            pins.pop(owner, None)

    @rule(abstract=abstract_keys)
    def watch(self, abstract):
        """A waiting request whose cached prefix the lpm policy follows with peek hints."""
        self.peeks.setdefault(tuple(self.key(abstract)), None)

    @rule(dt=st.sampled_from([1.0, 3.0, 8.0]))
    def advance_clock(self, dt):
        self.now += dt

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        self.stored, self.stamp, self.pins, self.prio = {}, {}, {}, {}
        assert self.allocator.num_free_pages == self.allocator.num_usable_pages

    @invariant()
    def peeks_follow_the_tree(self):
        """peek_prefix, resumed from its last result through every change, equals the
        longest stored prefix; it changes nothing (the LRU and content checks would see it)."""
        for key, hint in self.peeks.items():
            tokens = list(key)
            peek = self.cache.peek_prefix(lambda tokens=tokens: tokens, hint)
            assert peek.prefix_len == (0 if self.disable else self.longest(tokens))
            fresh = self.cache.peek_prefix(lambda tokens=tokens: tokens, None)
            assert fresh.prefix_len == peek.prefix_len
            self.peeks[key] = peek

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        held = sum(r[4] for r in self.requests)
        check_page_accounting(self.allocator, self.cache, held_by_requests=held)
        assert self.tree_contents() == self.stored
        assert self.cache.total_size() == len(self.stored) * self.ps
        assert self.cache.protected_size() == len(self.locked_prefixes()) * self.ps
        retained = [p for p in self.stored if self.deadline(p) > self.now]
        assert self.cache.retained_size() == len(retained) * self.ps
        for owner in self.sessions:
            pinned = [p for p in self.stored if self.pins.get(p, {}).get(owner, 0.0) > self.now]
            assert self.cache.pinned_size(owner) == len(pinned) * self.ps

    def teardown(self):
        for _, _, _, node, _ in self.requests:
            self.cache.dec_lock_ref(node)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # "explain" is slow here
)
test_radix_cache_state_machine = RadixCacheMachine.TestCase
