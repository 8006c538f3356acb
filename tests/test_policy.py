"""The `lpm` waiting-queue policy: prefix lengths read with `RadixCache.peek_prefix` and kept on
each request between steps give the same order as matching every request afresh, and the
scheduler admits the same requests in the same steps as with fresh matching."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_radix_cache import insert_new
from test_scheduler import make_scheduler, request, run_steps

from sgl_tpu.mem_cache import PageAllocator, RadixCache
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler import policy
from sgl_tpu.scheduler.req import Req

PAGE = 4


def rematch_lpm(waiting: list[Req], tree: RadixCache) -> list[Req]:
    """The rule `lpm` implements, by a fresh match of every waiting request."""
    if tree.disable or len(waiting) > policy.LPM_MAX_QUEUE:
        return policy.fcfs(waiting, tree)
    prefix = {id(r): tree.match_prefix(r.fill_ids[: r.max_prefix_len]).prefix_len
              for r in waiting}
    return sorted(waiting, key=lambda r: (-prefix[id(r)], r.arrival))


def make_req(rid: str, prompt: list[int]) -> Req:
    return Req(rid=rid, origin_input_ids=prompt, sampling=SamplingParams(), seed=0)


def test_lpm_order_follows_the_tree_through_changes() -> None:
    allocator = PageAllocator(num_pages=64, page_size=PAGE)
    tree = RadixCache(allocator)
    rng = np.random.default_rng(0)
    bases = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    waiting = [make_req(f"r{i}", bases[i % 3][: 8 + 4 * i] + rng.integers(50, 99, 6).tolist())
               for i in range(9)]

    def check() -> list[str]:
        got = [r.rid for r in policy.lpm(waiting, tree)]
        assert got == [r.rid for r in rematch_lpm(waiting, tree)]
        return got

    check()  # empty tree: arrival order
    insert_new(allocator, tree, bases[1][:24])
    check()
    peeks = [r.prefix_peek[2] for r in waiting]
    check()  # nothing changed: every request keeps its peek, no walk
    assert all(r.prefix_peek[2] is p for r, p in zip(waiting, peeks, strict=True))
    insert_new(allocator, tree, bases[2][:36])  # deeper than some, a split for others
    insert_new(allocator, tree, bases[1][:12] + [7] * 8)  # splits r1's path
    order = check()
    assert order[0] in {"r5", "r8"}  # the longest cached prefixes now
    waiting[4].num_retractions += 1  # a retracted request comes back with its outputs
    waiting[4].output_ids += [1, 2, 3, 4, 5]
    check()
    tree.evict(12)
    check()
    tree.evict(1000)
    check()
    insert_new(allocator, tree, bases[0][:32])
    check()
    tree.reset()  # every node of the old tree is gone
    check()


@pytest.fixture
def rematching(monkeypatch):
    monkeypatch.setitem(policy.POLICIES, "lpm-rematch", rematch_lpm)


def test_scheduler_admits_the_same_requests_as_rematching(rematching) -> None:
    """Agents of 3 conversations arriving in waves while 2 run at a time: the same EXTEND
    batches (who, how many new tokens, how much reused) and outputs with either policy."""
    rng = np.random.default_rng(1)
    history = [rng.integers(0, 900, 48).tolist() for _ in range(3)]
    waves = [[(f"w{w}a{i}", history[i % 3][: 16 + 8 * ((w + i) % 4)]
               + rng.integers(0, 900, 1 + (i * 5) % 7).tolist(), 3 + i % 4)
              for i in range(6)] for w in range(3)]
    runs = {}
    for name in ("lpm", "lpm-rematch"):
        sched, runner = make_scheduler(max_running=2)
        sched.config = dataclasses.replace(sched.config, schedule_policy=name)
        out: dict[str, dict] = {}
        for wave in waves:
            for rid, prompt, max_new in wave:
                assert sched.add_request(request(rid, prompt, max_new)) is None
            run_steps(sched, out, max_steps=6)  # the queue is still long between waves
        run_steps(sched, out)
        runs[name] = (runner.calls, out)
    assert runs["lpm"] == runs["lpm-rematch"]
    calls, out = runs["lpm"]
    assert len(out) == 18 and all(r["reason"] is not None for r in out.values())
    assert sum(r["cached"] for r in out.values()) > 0  # the order mattered: prefixes reused
