"""Agent-aware retention: a session's trajectory is evicted after everything unretained.

Unit tests drive `RadixCache` / `KVManager` with an injected clock (no sleeps); the end-to-end
test (slow) shows through a real server with a small KV pool that a returning agent's prefix
survives other traffic with `session_id` and is evicted without it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgl_tpu.mem_cache import PageAllocator, RadixCache, check_page_accounting
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.req import Req


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(page_size: int = 1, num_pages: int = 64, disable: bool = False):
    clock = Clock()
    allocator = PageAllocator(num_pages, page_size)
    return clock, allocator, RadixCache(allocator, disable=disable, clock=clock)


def finish(allocator: PageAllocator, cache: RadixCache, key: list[int],
           retain_s: float = 0.0) -> None:
    """A request over `key` finishes: its KV goes to the tree (retained for `retain_s`)."""
    match = cache.match_prefix(key)
    cache.inc_lock_ref(match.last_node)
    n = len(key) - match.prefix_len
    pages = allocator.alloc(-(-n // allocator.page_size))
    slots = np.concatenate([match.slots, allocator.pages_to_slots(pages, n)])
    prefix_len = cache.insert(key, slots, retain_s)
    aligned = len(key) - len(key) % allocator.page_size
    allocator.free(allocator.slots_to_pages(slots[match.prefix_len:prefix_len]))
    allocator.free(allocator.slots_to_pages(slots[aligned:]))
    cache.dec_lock_ref(match.last_node)


def cached(cache: RadixCache, key: list[int]) -> int:
    return cache.match_prefix(key).prefix_len


def evict_one_leaf(cache: RadixCache) -> None:
    assert cache.evict(1) > 0
    cache.check_integrity()


# ---- radix cache -----------------------------------------------------------------------------
def test_retained_paths_go_after_unretained_ones():
    _, allocator, cache = make()
    finish(allocator, cache, [1, 1, 1], retain_s=30)  # oldest, but an agent mid-loop
    finish(allocator, cache, [2, 2])
    finish(allocator, cache, [3, 3])
    cache.check_integrity()
    assert cache.retained_size() == 3
    evict_one_leaf(cache)
    assert cached(cache, [2, 2]) == 0 and cached(cache, [1, 1, 1]) == 3  # LRU among unretained
    evict_one_leaf(cache)
    assert cached(cache, [3, 3]) == 0 and cached(cache, [1, 1, 1]) == 3
    assert cache.num_evicted_retained_tokens == 0
    evict_one_leaf(cache)  # nothing unretained is left: retention never blocks eviction
    assert cache.total_size() == 0 and cache.num_evicted_retained_tokens == 3
    check_page_accounting(allocator, cache, held_by_requests=0)


def test_after_the_deadline_retained_paths_are_plain_lru():
    clock, allocator, cache = make()
    finish(allocator, cache, [1, 1], retain_s=10)
    finish(allocator, cache, [2, 2])
    evict_one_leaf(cache)  # [2, 2]; [1, 1]'s LRU entry is set aside while retained
    finish(allocator, cache, [3, 3])
    clock.now += 10  # deadline reached: [1, 1] rejoins the LRU order, as the oldest
    assert cache.retained_size() == 0
    cache.check_integrity()
    evict_one_leaf(cache)
    assert cached(cache, [1, 1]) == 0 and cached(cache, [3, 3]) == 2
    assert cache.num_evicted_retained_tokens == 0


def test_expired_then_touched_leaf_keeps_lru_order():
    clock, allocator, cache = make()
    finish(allocator, cache, [1, 1], retain_s=5)
    finish(allocator, cache, [2, 2])
    clock.now += 6
    assert cached(cache, [1, 1]) == 2  # touched after expiry: now the newest
    evict_one_leaf(cache)
    assert cached(cache, [2, 2]) == 0 and cached(cache, [1, 1]) == 2


def test_most_recently_retained_is_evicted_first_among_retained():
    """Agents come back in a cycle: evicting the context whose next use is furthest away (the
    one retained last) keeps the others whole, where LRU would make every agent miss."""
    clock, allocator, cache = make()
    for agent in (1, 2, 3):
        finish(allocator, cache, [agent] * 4, retain_s=30)
        clock.now += 1
    evict_one_leaf(cache)
    assert [cached(cache, [a] * 4) for a in (1, 2, 3)] == [4, 4, 0]


def test_retention_covers_the_path_and_shared_parents():
    _, allocator, cache = make(page_size=2)
    system = [7, 7, 7, 7]
    finish(allocator, cache, system + [1, 1], retain_s=30)  # agent: system prompt + its turn
    finish(allocator, cache, system + [2, 2])  # another request forked from the same prompt
    finish(allocator, cache, [9, 9])
    assert cache.retained_size() == 6
    evict_one_leaf(cache)  # [2, 2]: unretained leaf under a retained parent, older than [9, 9]
    assert cached(cache, system + [2, 2]) == 4 and cached(cache, system + [1, 1]) == 6
    evict_one_leaf(cache)
    assert cached(cache, [9, 9]) == 0
    assert cache.evict(2) == 2 and cached(cache, system + [1, 1]) == 4  # retained leaf, then
    assert cache.evict(2) == 4 and cache.total_size() == 0  # the bared retained parent
    cache.check_integrity()


def test_retain_on_match_and_deadlines_only_grow():
    clock, allocator, cache = make()
    finish(allocator, cache, [1, 1, 1, 1], retain_s=30)
    node = cache.match_prefix([1, 1, 9]).last_node  # splits [1, 1 | 1, 1]
    cache.retain(node, 5)  # shorter than the current deadline: no change
    assert node.retain_until == clock.now + 30
    clock.now += 29
    cache.retain(node, 60)  # a returning request of the session extends its matched prefix
    assert node.retain_until == clock.now + 60
    clock.now += 2  # the unmatched tail [1, 1] expires, the matched head does not
    assert cache.retained_size() == 2
    cache.check_integrity()
    cache.retain(cache.root, 10)  # the root: a no-op
    assert cache.root.retain_until == 0


def test_retention_survives_lock_and_unlock():
    _, allocator, cache = make()
    finish(allocator, cache, [1, 1], retain_s=30)
    finish(allocator, cache, [2, 2])
    node = cache.match_prefix([1, 1]).last_node
    cache.inc_lock_ref(node)  # the session's next turn runs on it
    cache.check_integrity()
    cache.dec_lock_ref(node)
    evict_one_leaf(cache)
    assert cached(cache, [2, 2]) == 0 and cached(cache, [1, 1]) == 2


def test_heaps_stay_bounded_under_repeated_retention():
    clock, allocator, cache = make()
    for k in range(4):
        finish(allocator, cache, [k, k])
    for _ in range(500):
        clock.now += 1
        cache.retain(cache.match_prefix([1, 1]).last_node, 3)
    q = cache._evictable_leaves
    assert max(len(q._unretained), len(q._retained), len(q._expiry)) <= 2 * len(q) + 65
    cache.check_integrity()


def test_check_integrity_catches_retention_corruption():
    _, allocator, cache = make()
    finish(allocator, cache, [1, 1])
    finish(allocator, cache, [1, 1, 2, 2], retain_s=30)
    cache.check_integrity()
    (parent,) = cache.root.children.values()
    (child,) = parent.children.values()
    parent.retain_until = 0.0
    with pytest.raises(RuntimeError, match="retained longer than its parent"):
        cache.check_integrity()
    late = child.retain_until + 1
    parent.retain_until = child.retain_until = late  # behind the queue's back: the leaf's
    with pytest.raises(RuntimeError, match="not its pins' maximum"):  # entry is stale, and
        cache.check_integrity()  # its pins disagree
    parent.pins[None] = child.pins[None] = late
    with pytest.raises(RuntimeError, match="heap entry"):
        cache.check_integrity()


def test_disabled_cache_ignores_retention():
    _, allocator, cache = make(disable=True)
    slots = allocator.pages_to_slots(allocator.alloc(2), 2)
    assert cache.insert([1, 2], slots, retain_s=30) == 0
    assert cache.total_size() == 0 and cache.retained_size() == 0
    cache.retain(cache.match_prefix([1, 2]).last_node, 30)


# ---- KVManager: which requests retain ------------------------------------------------------
def _req(ids: list[int], session_id: str | None) -> Req:
    return Req(rid=f"r{random.random()}", origin_input_ids=list(ids),
               sampling=SamplingParams.from_dict({}), seed=0, session_id=session_id)


def _run_and_release(kv: KVManager, req: Req, retain: bool) -> None:
    kv.admit_prefix(req)
    assert kv.alloc_pages(req, kv.pages_needed(req, len(req.fill_ids)))
    req.kv_len = len(req.fill_ids)
    kv.release_req(req, retain=retain)


@pytest.mark.parametrize("disable", [False, True])
def test_kv_manager_retains_finished_session_turns(disable):
    clock, allocator, tree = make(page_size=4, disable=disable)
    kv = KVManager(allocator, tree, session_retention_s=30)
    _run_and_release(kv, _req(list(range(10, 22)), "agent-1"), retain=True)
    _run_and_release(kv, _req(list(range(30, 42)), None), retain=True)  # no session
    _run_and_release(kv, _req(list(range(50, 62)), "agent-2"), retain=False)  # retraction
    assert tree.retained_size() == (0 if disable else 12)
    returning = _req(list(range(10, 22)) + [99, 98], "agent-1")
    clock.now += 29
    kv.retain_prefix(returning)  # arrival extends the deadline while the request waits
    clock.now += 29
    assert tree.retained_size() == (0 if disable else 12)
    kv.check([])
    no_retention = KVManager(allocator, tree, session_retention_s=0)
    _run_and_release(no_retention, _req(list(range(70, 82)), "agent-3"), retain=True)
    assert tree.retained_size() == (0 if disable else 12)
    if disable:  # the disabled cache never held anything: all pages are free again
        assert allocator.num_free_pages == allocator.num_usable_pages


def test_a_done_program_releases_its_session_hint_pins():
    """`release_hint` (a program found done): its hint pins end at once, another agent's stay,
    and a shared prefix keeps the pin of the agent still pausing."""
    clock, allocator, tree = make(page_size=4)
    kv = KVManager(allocator, tree, session_retention_s=30)
    shared = list(range(100, 108))  # 2 pages both agents' prompts start with
    _run_and_release(kv, _req(shared + list(range(10, 22)), "agent-1"), retain=True)
    _run_and_release(kv, _req(shared + list(range(30, 42)), "agent-2"), retain=True)
    assert tree.retained_size() == 8 + 12 + 12
    kv.retention.release_hint("agent-1")
    assert tree.retained_size() == 8 + 12  # agent-2's path, the shared pages included
    kv.retention.release_hint("agent-9")  # never seen: nothing to release
    kv.retention.release_hint("agent-2")
    assert tree.retained_size() == 0
    kv.check([])
    _run_and_release(kv, _req(shared + list(range(10, 22)), "agent-1"), retain=True)
    assert tree.retained_size() == 8 + 12  # it came back: pinned again


# ---- end to end: a real server with a KV pool too small for everyone ------------------------
POOL_FLAGS = ("--skip-warmup", "--page-size", "16", "--max-total-tokens", "512",
              "--session-retention-s", "600")  # long: first calls compile (no warm-up)


@pytest.fixture(scope="module")
def small_pool_server(tiny_model):
    from server_harness import launch_server

    with launch_server(*POOL_FLAGS, model_path=tiny_model) as server:
        yield server


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]  # tiny vocabulary: 400, 0-2 special


def _generate(server, **body) -> dict:
    return server.post_ok("/generate", body)


def _agent_returns_after_traffic(server, seed: int, session_id: str | None) -> int:
    """Turn 1 of an agent (160 prompt tokens), then other traffic that overflows the 32-page
    pool, then turn 2 (turn 1 + its output + a tool observation): turn 2's cached tokens."""
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    session = {} if session_id is None else {"session_id": session_id}
    prompt = _ids(160, seed)
    turn1 = _generate(server, input_ids=prompt, sampling_params=sp, **session)
    for k in range(3):  # 200 tokens each: 12 pages stay in the tree, 13 are needed to run
        _generate(server, input_ids=_ids(200, seed + 1 + k),
                  sampling_params={"temperature": 0.0, "max_new_tokens": 1})
    info = server.info()["memory"]
    assert info["evicted_tokens"] > 0, info  # the pool really overflowed
    if session_id is not None:
        assert info["evicted_retained_tokens"] == 0 and info["tree_retained_tokens"] >= 160
    turn2 = _generate(server, input_ids=prompt + turn1["output_ids"] + _ids(10, seed + 9),
                      sampling_params=sp, **session)
    return turn2["meta_info"]["cached_tokens"]


@pytest.mark.slow
def test_returning_agent_prefix_survives_other_traffic_only_with_session(small_pool_server):
    server = small_pool_server
    assert _agent_returns_after_traffic(server, seed=1, session_id=None) == 0
    assert _agent_returns_after_traffic(server, seed=100, session_id="agent-7") >= 160
    info = server.info()
    assert info["session_retention_s"] == 600 and info["integrity"] == "ok", info


@pytest.mark.slow
def test_bad_session_id_is_a_400_and_the_server_keeps_serving(small_pool_server):
    server = small_pool_server
    prompt, sp = _ids(20, 5), {"max_new_tokens": 2}
    bad = [{"input_ids": prompt, "session_id": 5},
           {"input_ids": prompt, "session_id": "x" * 300},
           {"input_ids": prompt, "session_id": ""},
           {"input_ids": [prompt, prompt], "session_id": ["only-one"]}]
    for body in bad:
        r = server.post("/generate", {**body, "sampling_params": sp})
        assert r.status_code == 400 and "session_id" in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "session_id": 7})
    assert r.status_code == 400 and "session_id" in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                        "session_id": "agent-openai"})
    assert r.status_code == 200, r.text
    out = _generate(server, input_ids=[prompt, prompt], sampling_params=sp,
                    session_id=["agent-a", None])
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 2]


# ---- cache control: priority eviction, open sessions, retention_seconds, tool pauses ---------
def _kv(clock_tree, **kw) -> KVManager:
    from sgl_tpu.scheduler.sessions import SessionTable

    _, allocator, tree = clock_tree
    sessions = SessionTable(tree, default_ttl_s=60, max_ttl_s=100)
    return KVManager(allocator, tree, session_retention_s=0, sessions=sessions,
                     max_retention_s=100, **kw)


def test_priority_policy_evicts_low_priorities_first_lru_within_one():
    clock = Clock()
    allocator = PageAllocator(64, 1)
    cache = RadixCache(allocator, clock=clock, eviction_policy="priority")
    for key, priority in (([1, 1], 5), ([2, 2], 0), ([3, 3], 0), ([4, 4], -1)):
        match = cache.match_prefix(key)
        slots = allocator.pages_to_slots(allocator.alloc(2), 2)
        cache.insert(key, slots, priority=priority)
        assert match.prefix_len == 0
    cache.check_integrity()
    order = []
    while cache.total_size():
        before = {k: cached(cache, [k, k]) for k in (1, 2, 3, 4)}
        evict_one_leaf(cache)
        order += [k for k in (1, 2, 3, 4) if before[k] and not cached(cache, [k, k])]
    assert order == [4, 2, 3, 1]  # LRU among the 0s
    lru = RadixCache(PageAllocator(8, 1), clock=clock)
    with pytest.raises(ValueError, match="eviction policy"):
        RadixCache(PageAllocator(8, 1), clock=clock, eviction_policy="lfu")
    assert lru.eviction_policy == "lru"


def test_priority_keeps_the_highest_on_a_shared_path():
    _, allocator, _ = make()
    cache = RadixCache(allocator, eviction_policy="priority")
    finish_key = [7, 7, 1, 1]
    cache.insert(finish_key, allocator.pages_to_slots(allocator.alloc(4), 4), priority=3)
    cache.insert([7, 7, 2, 2], np.concatenate([cache.match_prefix([7, 7]).slots,
                 allocator.pages_to_slots(allocator.alloc(2), 2)]), priority=1)
    cache.check_integrity()  # the shared head [7, 7] keeps 3; the [2, 2] leaf has 1
    evict_one_leaf(cache)
    assert cached(cache, [7, 7, 2, 2]) == 2 and cached(cache, finish_key) == 4


def test_open_session_pins_until_closed_then_plain_lru():
    clock_tree = make(page_size=4)
    clock, _, tree = clock_tree
    kv = _kv(clock_tree)
    sid = kv.sessions.open("agent-1", None)
    _run_and_release(kv, _req(list(range(10, 22)), sid), retain=True)
    _run_and_release(kv, _req(list(range(30, 42)), None), retain=True)  # newer, unpinned
    assert tree.pinned_size(sid) == 12 and tree.retained_size() == 12
    kv.check([])
    tree.evict(4)  # the unpinned request goes first although it is newer
    assert cached(tree, list(range(30, 42))) == 0 and cached(tree, list(range(10, 22))) == 12
    _run_and_release(kv, _req(list(range(50, 62)), None), retain=True)
    kv.sessions.close(sid)  # evictable again: the oldest now, so LRU takes it first
    assert tree.pinned_size(sid) == 0 and tree.retained_size() == 0
    kv.check([])
    tree.evict(4)
    assert cached(tree, list(range(10, 22))) == 0 and cached(tree, list(range(50, 62))) == 12
    from sgl_tpu.scheduler.sessions import SessionError

    with pytest.raises(SessionError, match="not open") as e:
        kv.sessions.close(sid)
    assert e.value.status_code == 404


def test_session_ttl_is_renewed_by_requests_and_expires():
    clock_tree = make(page_size=4)
    clock, _, tree = clock_tree
    kv = _kv(clock_tree)
    from sgl_tpu.scheduler.sessions import SessionError

    for bad in (0, -1, 101, float("nan"), "10", True):
        with pytest.raises(SessionError, match="timeout"):
            kv.sessions.open(None, bad)
    sid = kv.sessions.open(None, 10)
    assert len(sid) == 32 and len(kv.sessions) == 1
    with pytest.raises(SessionError, match="already open"):
        kv.sessions.open(sid, 10)
    _run_and_release(kv, _req(list(range(10, 22)), sid), retain=True)
    clock.now += 8
    kv.retain_prefix(_req(list(range(10, 22)) + [5], sid))  # a new turn arrives: renewed
    clock.now += 8  # 16 s after the first turn, 8 after the renewal
    assert tree.pinned_size(sid) == 12
    clock.now += 3  # the TTL ran out: plain evictable KV, and the session is forgotten
    assert tree.retained_size() == 0
    info = kv.sessions.info()
    assert info["num_open"] == 0 and sid not in tree._pinned
    kv.check([])


def test_retention_seconds_is_bounded_by_the_server_max():
    from sgl_tpu.validation import check_cache_control

    assert check_cache_control(None, 3, 100, 100) is None
    assert "retention_seconds" in check_cache_control(None, None, 100.5, 100)
    assert "retention_seconds" in check_cache_control(None, None, -1, 100)
    assert "priority" in check_cache_control(None, 2**31, 0, 100)
    assert "priority" in check_cache_control(None, True, 0, 100)
    clock_tree = make(page_size=4)
    clock, _, tree = clock_tree
    kv = _kv(clock_tree)
    req = _req(list(range(10, 22)), None)
    req.retention_seconds = 1000  # past the max (the Engine path): clamped, never longer
    _run_and_release(kv, req, retain=True)
    clock.now += 99
    assert tree.retained_size() == 12
    clock.now += 1
    assert tree.retained_size() == 0


def test_tool_pause_pins_for_the_grace_then_normal_eviction():
    clock_tree = make(page_size=4)
    clock, _, tree = clock_tree
    kv = _kv(clock_tree, tool_pause_grace_s=5)
    hinted = _req(list(range(10, 22)), None)
    hinted.tool_pause = True  # the client's hint: pinned at its finish
    _run_and_release(kv, hinted, retain=True)
    offered = _req(list(range(30, 42)), None)
    offered.may_call_tools = True  # tools offered: pinned once the HTTP side reports a call
    _run_and_release(kv, offered, retain=True)
    plain = _req(list(range(50, 62)), None)
    plain.may_call_tools = True
    _run_and_release(kv, plain, retain=True)
    assert tree.retained_size() == 12
    assert kv.retention.tool_pause(offered.rid) and not kv.retention.tool_pause("unknown")
    assert tree.retained_size() == 24
    tree.evict(4)  # the turn without tool calls goes first
    assert cached(tree, list(range(50, 62))) == 0
    kv.check([])
    clock.now += 5  # the grace is over: the paused turns are plain LRU again
    assert tree.retained_size() == 0 and kv.retention.num_tool_pauses == 1
