"""Programs (scheduler/programs.py): per-program service and states, the `program` policy's
order (and with priorities), admission control's hold queue, and the scheduler running them
(plain Python: a fake clock, the +1 runner of test_scheduler)."""

from __future__ import annotations

import json

import pytest
from test_scheduler import PAGE, PlusOneRunner, V, request, run_steps

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.mem_cache import PageAllocator, RadixCache
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler import policy
from sgl_tpu.scheduler.priority import Priorities
from sgl_tpu.scheduler.programs import (
    HOLD_BOUND_MIN_S,
    MIN_PAUSE_S,
    SHARE_AGING_S,
    UNSEEN_OUTPUT_TOKENS,
    Programs,
    program_ranks,
)
from sgl_tpu.scheduler.req import Req


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_req(rid: str, prompt_len: int = 8, max_new: int = 4, priority: int = 0) -> Req:
    return Req(rid=rid, origin_input_ids=list(range(1, prompt_len + 1)),
               sampling=SamplingParams(max_new_tokens=max_new), seed=0, priority=priority)


def test_service_states_and_ttl() -> None:
    clock = Clock()
    progs = Programs(ttl_s=60.0, capacity_tokens=1000, admission=False, clock=clock)
    first = make_req("a1", prompt_len=20, max_new=5)
    prog = progs.arrive(first, "agent-a")
    assert progs.arrive(make_req("x"), None) is None  # no program named: not tracked
    assert first.program is prog and progs.state(prog, clock.now) == "active"
    progs.count_extend(first, 12)  # 12 of its 20 prompt tokens computed (8 were cached)
    first.kv_len = 20
    first.output_ids = [1, 2, 3]
    clock.now += 2.0
    progs.finish(first)
    progs.finish(first)  # idempotent
    assert (prog.prefill_tokens, prog.decode_tokens, prog.server_s) == (12, 3, 2.0)
    assert prog.admitted and progs.state(prog, clock.now) == "paused"
    clock.now += 3.0  # a 3 s tool pause, then the next turn
    second = make_req("a2", prompt_len=40, max_new=5)
    assert progs.arrive(second, "agent-a") is prog
    assert prog.max_pause_s == 3.0 and prog.working_set_tokens == 45
    clock.now += 1.0
    progs.finish(second)
    assert progs.info()["num_paused"] == 1
    clock.now += 2 * 3.0 + 0.1  # silent for longer than twice its longest pause: taken as done
    assert progs.state(prog, clock.now) == "idle"
    info = progs.info()
    assert (info["num_programs"], info["num_idle"], info["num_active"]) == (1, 1, 0)
    assert progs.program_info("agent-a")["server_s"] == 3.0
    clock.now += 60.0  # past the TTL: forgotten
    assert progs.info()["num_programs"] == 0 and progs.num_seen == 1
    assert progs.pause_window_s(prog) >= MIN_PAUSE_S


def test_claims_before_sums_the_working_sets_of_programs_expected_back_sooner() -> None:
    clock = Clock()
    progs = Programs(ttl_s=60.0, capacity_tokens=10_000, admission=False, clock=clock)

    def pause(key: str, prompt_len: int, pause_mean_s: float):
        """One turn of program `key`, then a pause (as the prefetcher records it)."""
        req = make_req(key, prompt_len=prompt_len, max_new=4)
        prog = progs.arrive(req, key)
        progs.count_extend(req, prompt_len)
        progs.finish(req)
        prog.kv.paused_at, prog.kv.pause_mean_s, prog.kv.num_pauses = clock.now, pause_mean_s, 1
        progs.pausing(prog)
        return prog

    late = pause("late", 196, 0.8)  # back at 100.8, claims 200 tokens
    clock.now += 0.1
    soon = pause("soon", 96, 0.3)  # paused last, back first: at 100.4, claims 100
    assert progs.expected_back_at(soon, clock.now) == pytest.approx(100.4)
    assert progs.return_claim_tokens(late) == 200
    assert progs.claims_before(progs.expected_back_at(soon, clock.now)) == 0  # only sooner
    assert progs.claims_before(100.5) == 100
    assert progs.claims_before(101.0) == 300
    clock.now = 100.6
    progs.info()  # a sweep: paused for longer than half its expected pause, each is expected
    # to pause as long again as it has so far
    assert progs.expected_back_at(late, clock.now) == pytest.approx(101.2)
    assert progs.expected_back_at(soon, clock.now) == pytest.approx(101.1)
    assert progs.claims_before(101.15) == 100 and progs.claims_before(101.3) == 300
    clock.now += MIN_PAUSE_S  # their pause windows are over: found idle, they claim nothing
    progs.info()
    assert progs.claims_before(101.3) == 0


def test_programs_found_done_after_a_pause_are_reported_once() -> None:
    """`on_done` (the scheduler releases the program's session-hint pins): a program silent
    past its pause window after at least one tool pause, once until it comes back; never one
    that has not paused yet (its tool may simply be slow)."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=1000, admission=False, clock=clock)
    done: list[str] = []
    progs.on_done = done.append

    def turn(rid: str, key: str, then_s: float) -> None:
        req = make_req(rid)
        progs.arrive(req, key)
        clock.now += 0.5
        progs.finish(req)
        clock.now += then_s

    turn("a1", "agent-a", 2.0)  # a 2 s tool pause, then its last turn
    turn("a2", "agent-a", 0.0)
    turn("b1", "agent-b", 0.0)  # one turn, no pause yet
    clock.now += 2 * 2.0 + 0.1  # agent-a silent for longer than twice its longest pause
    progs.info()
    assert done == ["agent-a"]
    clock.now += 60.0
    progs.info()
    assert done == ["agent-a"]  # agent-b never paused: it keeps its pins' full time
    turn("a3", "agent-a", 0.0)  # it came back (a long pause), then went silent again
    clock.now += progs.pause_window_s(progs.table["agent-a"]) + 0.1
    progs.info()
    assert done == ["agent-a", "agent-a"]


def test_program_policy_orders_by_share_then_program_then_priority() -> None:
    """Each program's first request in the server ranks before any program's second one,
    then by the program's first arrival; a request of no program ranks as a program that
    arrived with it; priorities order first."""
    tree = RadixCache(PageAllocator(num_pages=16, page_size=PAGE))
    progs = Programs(ttl_s=60.0, capacity_tokens=10_000, admission=False)
    old = make_req("old-1")
    progs.arrive(old, "old")
    single = make_req("single")  # no program: ranks by its own arrival
    progs.arrive(single, None)
    new = make_req("new-1")
    progs.arrive(new, "new")
    later_old = make_req("old-2")  # a parallel request of the first program
    progs.arrive(later_old, "old")
    order = policy.order_waiting("program", [new, later_old, single, old], tree)
    assert [r.rid for r in order] == ["old-1", "single", "new-1", "old-2"]
    # priority first, then the program order within one level
    urgent = make_req("urgent", priority=5)
    progs.arrive(urgent, "new")
    prios = Priorities(threshold=10, aging_rate=0.0, preemption=False,
                       retract_by_priority=False)
    ordered = prios.order(policy.order_waiting("program", [new, urgent, later_old, old], tree))
    assert [r.rid for r in ordered] == ["urgent", "old-1", "new-1", "old-2"]


def test_one_key_with_parallel_requests_gets_one_programs_share() -> None:
    """A constant key with many parallel requests (one running) does not rank ahead of a newer
    agent: its k-th request in the server ranks at level k, less one per SHARE_AGING_S
    waited, so it is not starved either."""
    tree = RadixCache(PageAllocator(num_pages=16, page_size=PAGE))
    progs = Programs(ttl_s=60.0, capacity_tokens=10_000, admission=False)
    bulk = [make_req(f"bulk-{i}") for i in range(6)]
    for req in bulk:
        progs.arrive(req, "constant-key")
    agent = make_req("agent")
    progs.arrive(agent, "agent")
    waiting = [agent, *bulk[1:]]  # bulk-0 runs
    order = policy.order_waiting("program", waiting, tree)
    assert [r.rid for r in order] == ["agent", *[r.rid for r in bulk[1:]]]
    now = bulk[1].arrival_s + 2.5 * SHARE_AGING_S
    ranks = program_ranks(waiting, now)
    assert [ranks[id(r)][0] for r in bulk[1:]] == [0, 0, 1, 2, 3]  # 1..5 less 2: aged
    assert ranks[id(agent)] == (0, agent.program.first_arrival)


def test_admission_holds_new_programs_and_lets_smaller_ones_pass() -> None:
    clock = Clock()
    progs = Programs(ttl_s=60.0, capacity_tokens=200, admission=True, clock=clock)
    a = make_req("a", prompt_len=56, max_new=4)  # first turn 60: expected to grow to 120
    progs.arrive(a, "a")
    assert progs.expected_working_set(a.program) == 120
    assert progs.admissible([a]) == [a]
    progs.count_extend(a, 56)
    b = make_req("b", prompt_len=50, max_new=10)  # expects 120 more: over the capacity
    c = make_req("c", prompt_len=20, max_new=10)  # expects 60: fits, passes the held b
    progs.arrive(b, "b")
    progs.arrive(c, "c")
    loose = make_req("loose")
    progs.arrive(loose, None)  # no program: never held
    assert progs.admissible([c, b, loose]) == [c, loose]
    progs.count_extend(c, 20)
    info = progs.info()
    assert info["num_held"] == 1 and info["num_active"] == 2  # a and c (loose is no program)
    a_next = make_req("a-next", prompt_len=70, max_new=4)  # a continuation: never held
    clock.now += 1.0
    progs.finish(a)
    assert progs.admissible([b]) == []  # a is paused (resident): b waits
    progs.arrive(a_next, "a")
    assert progs.admissible([b, a_next]) == [a_next]
    clock.now += 1.0
    progs.finish(a_next)
    progs.finish(c)
    assert progs.resident_tokens(clock.now) == 120 + 60  # a: twice its first turn
    clock.now += 10.0  # a and c are done (idle): their working sets no longer count
    assert progs.resident_tokens(clock.now) == 0
    assert progs.admissible([b]) == [b]
    progs.count_extend(b, 50)
    info = progs.info()
    assert info["num_held"] == 0 and info["num_programs_held"] == 1
    assert info["program_held_s"] == 12.0
    # one program larger than the capacity runs once no admitted program is resident,
    # even while requests of no program run
    big = make_req("big", prompt_len=300, max_new=4)
    progs.arrive(big, "big")
    assert progs.admissible([big, loose]) == [loose]  # b is resident
    progs.finish(b)
    clock.now += 3.0  # b goes idle (it never came back)
    assert progs.admissible([big, loose]) == [big, loose]


def test_a_held_program_starts_within_the_bound_beside_a_busy_agent() -> None:
    """One agent takes 1 s turns with 0.5 s tool pauses, so its working set stays resident; a
    newcomer a little larger than what is left is held, a smaller one behind it is not, and
    the newcomer is released after at most hold_bound_s() (10 s here), then ranks first."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=4096, admission=True, clock=clock)
    tree = RadixCache(PageAllocator(num_pages=16, page_size=PAGE))
    turn = 0
    agent = make_req("agent-0", prompt_len=900, max_new=100)  # expected 2,000
    progs.arrive(agent, "agent")
    assert progs.admissible([agent]) == [agent]
    progs.count_extend(agent, 900)
    turn_end, next_turn = clock.now + 1.0, None
    newcomer = make_req("newcomer", prompt_len=1000, max_new=100)  # expects 2,200 > 2,096
    progs.arrive(newcomer, "newcomer")
    small = make_req("small", prompt_len=400, max_new=100)  # expects 1,000: fits
    progs.arrive(small, "small")
    loose = make_req("loose")
    progs.arrive(loose, None)
    assert progs.admissible([newcomer, small, loose]) == [small, loose]
    progs.count_extend(small, 400)
    held_since = newcomer.program.held_since
    assert held_since == clock.now
    started = None
    while started is None and clock.now < held_since + 60.0:
        clock.now = round(clock.now + 0.1, 6)
        if agent is not None and clock.now >= turn_end:  # its turn ends: a 0.5 s tool pause
            agent.output_ids = [1] * 100
            progs.finish(agent)
            agent, next_turn = None, clock.now + 0.5
        if agent is None and clock.now >= next_turn:  # its next turn, its context grown
            turn += 1
            agent = make_req(f"agent-{turn}", prompt_len=900 + 150 * turn, max_new=100)
            progs.arrive(agent, "agent")
            turn_end = clock.now + 1.0
        ready = [newcomer] + ([agent] if agent is not None and not agent.kv_len else [])
        out = progs.admissible(ready)
        if agent in out:
            agent.kv_len = agent.prompt_len
            progs.count_extend(agent, agent.prompt_len)
        if newcomer in out:
            order = policy.order_waiting("program", ready, tree)
            assert order[0] is newcomer  # released by the bound: its first turn goes first
            progs.count_extend(newcomer, 1000)
            started = clock.now
    assert progs.hold_bound_s() == HOLD_BOUND_MIN_S  # the agent's turns are 1 s
    assert started is not None and HOLD_BOUND_MIN_S - 0.1 <= started - held_since
    assert started - held_since <= progs.hold_bound_s() + 0.1
    assert progs.info()["program_held_s"] == started - held_since


def test_held_programs_go_past_the_capacity_one_per_bound() -> None:
    """Four newcomers held beside an agent that never leaves: while the hold queue makes no
    progress, one goes per hold_bound_s(), in hold order (the k-th after k bounds), not all of
    them once each was held for a bound; a program admitted by the budget counts as progress
    and restarts the bound."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=1000, admission=True, clock=clock)
    agent = make_req("agent", prompt_len=390, max_new=10)  # expects 800, active throughout
    progs.arrive(agent, "agent")
    assert progs.admissible([agent]) == [agent]
    progs.count_extend(agent, 390)
    waiting = [make_req(f"new-{i}", prompt_len=190, max_new=10) for i in range(4)]  # 400 each
    admitted = [agent, *waiting]
    for req in waiting:
        progs.arrive(req, req.rid)
    held_at = clock.now
    started: dict[str, float] = {}
    while waiting and clock.now < held_at + 100.0:
        for req in progs.admissible(waiting):
            assert req.program.release_due  # past the capacity: released by the bound
            progs.count_extend(req, 190)
            started[req.rid] = clock.now - held_at
            waiting.remove(req)
        clock.now = round(clock.now + 0.5, 6)
    assert started == {f"new-{i}": HOLD_BOUND_MIN_S * (i + 1) for i in range(4)}
    small = make_req("small", prompt_len=190, max_new=10)  # expects 400
    large = make_req("large", prompt_len=390, max_new=10)  # expects 800
    progs.arrive(small, "small")
    progs.arrive(large, "large")
    assert progs.admissible([small, large]) == []
    clock.now += 5.0
    for req in admitted:
        progs.finish(req)
    clock.now += 2.0  # all idle: small fits, large does not beside it
    assert progs.admissible([small, large]) == [small]
    progs.count_extend(small, 190)
    progress_at, bound_s = clock.now, progs.hold_bound_s()  # the turns' mean: over 10 s
    clock.now += 3.5  # large held for 10.5 s, but the queue moved 3.5 s ago
    assert progs.admissible([large]) == []
    clock.now = progress_at + bound_s - 0.1
    assert progs.admissible([large]) == []
    clock.now = progress_at + bound_s + 1e-6  # (float rounding)
    assert progs.admissible([large]) == [large] and large.program.release_due


def test_chats_without_max_tokens_are_not_held() -> None:
    """A request whose max_new_tokens the server defaulted to the rest of the context counts
    its prompt plus the outputs seen (its program's, else the server's mean, else
    UNSEEN_OUTPUT_TOKENS), not the rest of the context: six such chats fit together."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=4096, admission=True, clock=clock)
    chats = [make_req(f"chat-{i}", prompt_len=60, max_new=4096 - 60) for i in range(6)]
    for i, req in enumerate(chats):
        progs.arrive(req, f"cache-key-{i}", max_new_tokens_defaulted=True)
        assert req.program.working_set_tokens == 60 + UNSEEN_OUTPUT_TOKENS
    assert progs.admissible(chats) == chats
    for req in chats:
        progs.count_extend(req, 60)
    clock.now += 1.0
    chats[0].output_ids = [1] * 40
    progs.finish(chats[0])
    again = make_req("chat-0-again", prompt_len=150, max_new=4096 - 150)
    progs.arrive(again, "cache-key-0", max_new_tokens_defaulted=True)
    assert again.program.in_flight["chat-0-again"] == 150 + 40  # its program's longest output
    other = make_req("other", prompt_len=50, max_new=4096 - 50)
    progs.arrive(other, "other", max_new_tokens_defaulted=True)
    assert other.program.in_flight["other"] == 50 + 40  # the server's mean output
    # the same chats naming max_new_tokens themselves: each expects twice the context
    strict = Programs(ttl_s=600.0, capacity_tokens=4096, admission=True, clock=clock)
    named = [make_req(f"named-{i}", prompt_len=60, max_new=4096 - 60) for i in range(6)]
    for i, req in enumerate(named):
        strict.arrive(req, f"cache-key-{i}")
    assert strict.admissible(named) == named[:1]  # alone, larger than the capacity


def test_admission_counts_a_programs_concurrent_contexts() -> None:
    """One key with ten parallel 100-token requests holds ten contexts, not one."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=1500, admission=True, clock=clock)
    bulk = [make_req(f"bulk-{i}", prompt_len=90, max_new=10) for i in range(10)]
    for req in bulk:
        progs.arrive(req, "constant-key")
    assert bulk[0].program.working_set_tokens == 1000
    assert progs.admissible(bulk) == bulk  # alone: larger than what is left, not resident
    for req in bulk:
        progs.count_extend(req, 90)
    assert progs.resident_tokens(clock.now) == 1000
    agent = make_req("agent", prompt_len=290, max_new=10)  # expects 600 > 500
    progs.arrive(agent, "agent")
    assert progs.admissible([agent]) == []
    for req in bulk[:5]:
        progs.finish(req)
    assert bulk[0].program.in_flight_tokens == 500
    assert bulk[0].program.working_set_tokens == 1000  # its peak stays its working set


def test_admission_cost_does_not_grow_with_the_table() -> None:
    """Admission and reports walk the live programs only: the same work beside 10 or 20,000
    idle programs (counted in Programs.num_visits, not timed)."""
    def work(num_idle: int) -> int:
        clock = Clock()
        progs = Programs(ttl_s=600.0, capacity_tokens=10_000, admission=True, clock=clock)
        for i in range(num_idle):
            req = make_req(f"idle-{i}")
            progs.arrive(req, f"idle-{i}")
            progs.count_extend(req, 8)
            progs.finish(req)
        clock.now += 10.0  # all idle
        progs.info()  # found idle once: they leave the live set
        active = [make_req(f"active-{i}") for i in range(3)]
        for i, req in enumerate(active):
            progs.arrive(req, f"active-{i}")
        visits = progs.num_visits
        for _ in range(100):
            progs.admissible(active)
            clock.now += 0.01
        info = progs.info()
        assert info["num_programs"] == num_idle + 3 and info["num_idle"] == num_idle
        assert len(info["recent"]) == min(num_idle + 3, 16)
        return progs.num_visits - visits

    assert work(10) == work(20_000) <= 102 * 3  # 3 live programs, 102 sweeps


def test_held_seconds_never_decrease() -> None:
    """A program that leaves while held (its request aborted) ends its hold: the held seconds
    stay counted, and forgetting it changes nothing."""
    clock = Clock()
    progs = Programs(ttl_s=60.0, capacity_tokens=100, admission=True, clock=clock)
    a = make_req("a", prompt_len=40, max_new=10)
    progs.arrive(a, "a")
    progs.count_extend(a, 40)
    b = make_req("b", prompt_len=40, max_new=10)
    progs.arrive(b, "b")
    assert progs.admissible([b]) == []
    seen = []
    for _ in range(4):
        clock.now += 1.0
        seen.append(progs.info()["program_held_s"])
    progs.finish(b)  # aborted while held
    progs.finish(a)
    for _ in range(3):
        clock.now += 40.0  # past the TTL: forgotten
        seen.append(progs.info()["program_held_s"])
    assert seen == sorted(seen) and seen[-1] == 4.0
    assert progs.info()["num_held"] == 0 and progs.info()["num_programs"] == 0


def test_reports_name_programs_by_a_keyed_hash() -> None:
    """`info()` never holds a client's key; the public id is a keyed hash, per server."""
    clock = Clock()
    reports = []
    for _ in range(2):
        progs = Programs(ttl_s=60.0, capacity_tokens=1000, admission=True, clock=clock)
        for key in ("sess-secret-1", "resp_0123456789abcdef"):
            progs.arrive(make_req(key), key)
        info = progs.info()
        assert "secret" not in json.dumps(info) and "resp_" not in json.dumps(info)
        assert sorted(info["recent"]) == sorted(progs.public_id(k) for k in
                                                ("sess-secret-1", "resp_0123456789abcdef"))
        reports.append(info["recent"])
    assert set(reports[0]).isdisjoint(reports[1])  # another server, another secret


def test_a_program_past_the_usual_turn_count_stops_holding_a_slot() -> None:
    """Once 4 programs were found done after 3 requests each, a paused program that has made
    3 requests is expected done: its working set no longer counts and its pins are released
    (`on_done`), one that made 2 still counts; it stays paused, and its next turn is admitted
    as a continuation."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=10_000, admission=True, clock=clock)
    reported: list[str] = []
    progs.on_done = reported.append

    def turn(key: str, i: int) -> None:  # request i of program `key`, then a 1 s tool pause
        req = make_req(f"{key}-{i}", prompt_len=40 + 20 * i, max_new=4)
        progs.arrive(req, key)
        progs.count_extend(req, 20)
        clock.now += 0.5
        progs.finish(req)
        clock.now += 1.0

    for k in range(4):
        assert progs.expected_turns() is None
        for i in range(3):
            turn(f"done-{k}", i)
        clock.now += 10.0  # silent past its pause window: found done
        progs.resident_tokens(clock.now)
    assert progs.expected_turns() == 3 and progs.info()["expected_turns"] == 3
    reported.clear()
    for i in range(3):
        turn("long", i)
        if i < 2:
            turn("short", i)
    short, long = progs.table["short"], progs.table["long"]
    assert progs.state(short, clock.now) == progs.state(long, clock.now) == "paused"
    assert progs.resident_tokens(clock.now) == progs.expected_working_set(short)
    assert reported == ["long"]  # both paused: only the expected done one reported
    clock.now += 0.2
    progs.expire(clock.now + 1.0)
    assert reported == ["long"]  # once
    # a program that looked done (a long tool pause) and came back withdraws its count
    turn("slow", 0)
    turn("slow", 1)
    clock.now += 10.0
    progs.resident_tokens(clock.now)
    assert progs.done_turns["slow"] == 2 and progs.expected_turns() == 3
    turn("slow", 2)
    assert "slow" not in progs.done_turns
    more = make_req("long-3", prompt_len=200)
    progs.arrive(more, "long")  # it was not done: its turn runs, and it counts again
    assert progs.admissible([more]) == [more]
    # short is idle by now (past its pause window), slow paused after its third request
    assert progs.resident_tokens(clock.now) == progs.expected_working_set(long)


def test_one_shot_programs_teach_nothing_about_agents() -> None:
    """4 agents of 4 turns found done, then 200 one-shot programs (a key each, one request,
    never back): the agents' turn count and peak stay what admission expects of agents, so an
    agent paused after its second turn still counts its working set and keeps its pins (no
    `on_done`); one paused after its first turn counts it times `return_rate`, which the
    one-shots lowered and returning agents raise again; a small newcomer is not expected at
    the agents' peak, nor held for paused one-shots."""
    clock = Clock()
    progs = Programs(ttl_s=600.0, capacity_tokens=2000, admission=True, clock=clock)
    reported: list[str] = []
    progs.on_done = reported.append

    def request_of(key: str, i: int, prompt_len: int = 40, admitted: bool = True) -> Req:
        req = make_req(f"{key}-{i}", prompt_len=prompt_len, max_new=10)
        progs.arrive(req, key)
        assert progs.admissible([req]) == [req] or not admitted
        progs.count_extend(req, prompt_len)
        clock.now += 0.01
        progs.finish(req)
        return req

    for k in range(4):
        for i in range(4):
            request_of(f"agent-{k}", i, prompt_len=200 + 100 * i)
            clock.now += 0.5
        clock.now += 10.0
        progs.resident_tokens(clock.now)
    assert progs.expected_turns() == 4 and progs.return_rate == 1.0
    agents_peak = progs.expected_tokens
    assert agents_peak > 300
    reported.clear()
    for k in range(200):  # a flood: 20 are paused at any time
        # the first ones may be held: until one-shots are found idle, each may be an agent
        request_of(f"flood-{k}", 0, prompt_len=2, admitted=k >= 40)
        clock.now += 0.05
    clock.now += 10.0
    assert progs.resident_tokens(clock.now) == 0 and reported == []
    assert progs.expected_turns() == 4 and progs.expected_tokens == agents_peak
    assert progs.return_rate < 0.01 and progs.info()["return_rate"] < 0.01
    small = make_req("small", prompt_len=20, max_new=10)
    progs.arrive(small, "small")
    assert progs.expected_working_set(small.program) == 60  # not the agents' peak
    progs.finish(small)
    request_of("agent", 0, prompt_len=400)
    first = progs.table["agent"]
    assert progs.resident_tokens(clock.now) == int(progs.return_rate
                                                   * progs.expected_working_set(first, 1.0))
    clock.now += 0.5
    request_of("agent", 1, prompt_len=500)
    assert progs.return_rate > 0.09  # it came back
    assert progs.resident_tokens(clock.now) == progs.expected_working_set(first) == 820
    assert reported == []  # not expected done: its pins stay
    newcomer = make_req("newcomer", prompt_len=400, max_new=10)  # expects 820 < 2000 - 820
    progs.arrive(newcomer, "newcomer")
    assert progs.admissible([newcomer]) == [newcomer]
    big = make_req("big", prompt_len=600, max_new=10)  # expects 1220 > 1180: held
    progs.arrive(big, "big")
    assert progs.admissible([big]) == []


def make_program_scheduler(num_pages: int, admission: bool):
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=8, max_extend_seqs=8,
                          chunked_prefill_size=64, context_len=512, schedule_policy="program",
                          program_admission=admission)
    return Scheduler(cfg, PlusOneRunner(), num_pages=num_pages, decode=lambda ids, skip: "",
                     eos_token_ids=(), vocab_size=V)


def test_scheduler_holds_second_program_until_the_first_is_done() -> None:
    """Two agents whose working sets do not fit the pool together: the second one's first
    turn waits while the first one runs and while it is paused on a tool, then runs."""
    sched = make_program_scheduler(num_pages=12, admission=True)  # 48 tokens
    clock = sched.programs.clock = Clock()
    first = request("a1", list(range(1, 25)), 8)
    first.session_id = "agent-a"
    second = request("b1", list(range(100, 124)), 8)
    second.program_id = "agent-b"  # Anthropic's metadata.user_id arrives here
    assert sched.add_request(first) is None and sched.add_request(second) is None
    sched.step()  # the first EXTEND: only agent-a's turn (larger than the pool, alone)
    assert [r.rid for r in sched.waiting] == ["b1"]
    assert sched.programs.info()["num_held"] == 1
    out = run_steps(sched, {}, max_steps=100)
    assert out["a1"]["reason"]["type"] == "length" and "b1" not in out
    assert sched.programs.info()["num_paused"] == 1  # agent-a on a tool: b1 still held
    clock.now += 10.0  # agent-a never came back: done
    run_steps(sched, out)
    assert out["b1"]["reason"]["type"] == "length"
    info = sched.programs.info()
    # agent-a was held too (twice its first turn is over the pool) and ran at once, alone
    assert info["num_programs_held"] == 2 and info["num_held"] == 0
    assert info["program_held_s"] == 10.0
    a = sched.programs.program_info("agent-a")
    assert (a["prefill_tokens"], a["decode_tokens"], a["num_requests"]) == (24, 8, 1)
    assert sched.programs.program_info("agent-b")["admitted"]
    assert sched.flush_cache()  # the cache is gone, and with it what the programs held
    assert sched.programs.info()["num_programs"] == 0
    assert sched.programs.info()["num_programs_held"] == 2


def test_scheduler_starts_a_held_program_within_the_bound_beside_a_busy_agent() -> None:
    """Through the scheduler: an agent whose turns and 0.5 s tool pauses keep its working set
    resident, a newcomer that does not fit beside it; the newcomer's first EXTEND runs within
    hold_bound_s() of its hold (a step of 0.1 s on the fake clock)."""
    sched = make_program_scheduler(num_pages=40, admission=True)  # 160 tokens
    clock = sched.programs.clock = Clock()
    turn, current, resume_at = 0, "a0", None

    def agent_turn() -> None:
        req = request(f"a{turn}", list(range(1, 41 + 4 * turn)), 8)  # expects 2 x 48 at first
        req.session_id = "agent-a"
        assert sched.add_request(req) is None

    agent_turn()
    sched.step()
    newcomer = request("n0", list(range(200, 260)), 8)  # expects 2 x 68: over what is left
    newcomer.session_id = "newcomer"
    assert sched.add_request(newcomer) is None
    out: dict[str, dict] = {}
    started = None
    while started is None and clock.now < 200.0:
        clock.now = round(clock.now + 0.1, 6)
        run_steps(sched, out, max_steps=1)
        if current is not None and out.get(current, {}).get("reason") is not None:
            current, resume_at = None, clock.now + 0.5  # a tool pause
        if current is None and clock.now >= resume_at:
            turn += 1
            current = f"a{turn}"
            agent_turn()
        prog = sched.programs.table["newcomer"]
        if prog.held_since is not None:
            held_since = prog.held_since
        if prog.admitted:
            started = clock.now
    assert turn >= 5  # the agent kept working meanwhile
    assert started is not None
    assert HOLD_BOUND_MIN_S <= started - held_since <= sched.programs.hold_bound_s() + 0.2


def test_one_key_is_admitted_to_its_share_of_the_rows() -> None:
    """One key's 10 parallel requests beside 3 agents (4 programs, 8 rows): the key holds at
    most 8 // 4 = 2 rows while the agents' turns run, so every step carries the agents and at
    most 2 of its requests; alone, it fills the batch."""
    sched = make_program_scheduler(num_pages=200, admission=False)
    for i in range(10):
        req = request(f"k{i}", list(range(1, 9)) + [100 + i], 12)
        req.session_id = "one-key"
        assert sched.add_request(req) is None
    for a in range(3):
        req = request(f"agent{a}", list(range(300 + 20 * a, 316 + 20 * a)), 12)
        req.session_id = f"agent-{a}"
        assert sched.add_request(req) is None
    out: dict[str, dict] = {}
    key_rows = []  # the key's rows after each step while all 3 agents run
    while all(out.get(f"agent{a}", {}).get("reason") is None for a in range(3)):
        run_steps(sched, out, max_steps=1)
        key_rows.append(sum(r.rid.startswith("k") for r in sched.queues.running))
    assert max(key_rows) == 2 and len(key_rows) > 5
    run_steps(sched, out)
    assert all(out[f"k{i}"]["reason"] is not None for i in range(10))
    for i in range(8):  # the key alone: the whole batch
        req = request(f"solo{i}", list(range(1, 9)) + [200 + i], 12)
        req.session_id = "one-key"
        assert sched.add_request(req) is None
    sched.step()
    assert len(sched.queues.running) == 8


def test_agents_on_a_tool_keep_their_rows_from_one_key() -> None:
    """With admission control: 3 agents took a turn and are paused on their tools when one key
    sends 10 parallel requests. The key gets 8 // (1 + 3 expected back) = 2 rows, so the agents'
    next turns find rows free; once the agents are found idle, the key fills the batch."""
    sched = make_program_scheduler(num_pages=200, admission=True)
    clock = sched.programs.clock = Clock()
    out: dict[str, dict] = {}
    for a in range(3):
        req = request(f"agent{a}", list(range(300 + 20 * a, 316 + 20 * a)), 4)
        req.session_id = f"agent-{a}"
        assert sched.add_request(req) is None
    run_steps(sched, out)
    assert sched.programs.info()["num_paused"] == 3
    for i in range(10):
        req = request(f"k{i}", list(range(1, 9)) + [100 + i], 12)
        req.session_id = "one-key"
        assert sched.add_request(req) is None
    sched.step()
    assert sum(r.rid.startswith("k") for r in sched.queues.running) == 2
    assert sched.programs.expected_back == 3
    clock.now += 100.0  # the agents never came back: found idle, their rows go to the key
    run_steps(sched, out, max_steps=2)
    assert sum(r.rid.startswith("k") for r in sched.queues.running) == 8
