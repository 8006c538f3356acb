"""Programs (scheduler/programs.py): per-program service and states, the `program` policy's
order (and with priorities), admission control's hold queue, and the scheduler running them
(plain Python: a fake clock, the +1 runner of test_scheduler)."""

from __future__ import annotations

from test_scheduler import PAGE, PlusOneRunner, V, request, run_steps

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.mem_cache import PageAllocator, RadixCache
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler import policy
from sgl_tpu.scheduler.priority import Priorities
from sgl_tpu.scheduler.programs import MIN_PAUSE_S, Programs
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


def test_program_policy_orders_by_program_then_priority() -> None:
    tree = RadixCache(PageAllocator(num_pages=16, page_size=PAGE))
    progs = Programs(ttl_s=60.0, capacity_tokens=10_000, admission=False)
    old = make_req("old-1")
    progs.arrive(old, "old")
    single = make_req("single")  # no program: ranks by its own arrival
    progs.arrive(single, None)
    new = make_req("new-1")
    progs.arrive(new, "new")
    later_old = make_req("old-2")  # a later turn of the first program
    progs.arrive(later_old, "old")
    order = policy.order_waiting("program", [new, later_old, single, old], tree)
    assert [r.rid for r in order] == ["old-1", "old-2", "single", "new-1"]
    # priority first, then the program order within one level
    urgent = make_req("urgent", priority=5)
    progs.arrive(urgent, "new")
    prios = Priorities(threshold=10, aging_rate=0.0, preemption=False,
                       retract_by_priority=False)
    ordered = prios.order(policy.order_waiting("program", [new, urgent, later_old, old], tree))
    assert [r.rid for r in ordered] == ["urgent", "old-1", "old-2", "new-1"]


def test_admission_holds_new_programs_in_arrival_order() -> None:
    clock = Clock()
    progs = Programs(ttl_s=60.0, capacity_tokens=200, admission=True, clock=clock)
    a = make_req("a", prompt_len=56, max_new=4)  # first turn 60: expected to grow to 120
    progs.arrive(a, "a")
    assert progs.expected_working_set(a.program) == 120
    assert progs.admissible([a], nothing_else_runs=False) == [a]
    progs.count_extend(a, 56)
    b = make_req("b", prompt_len=50, max_new=10)  # expects 120 more: over the capacity
    c = make_req("c", prompt_len=20, max_new=10)  # expects 60: would fit, may not overtake b
    progs.arrive(b, "b")
    progs.arrive(c, "c")
    loose = make_req("loose")
    progs.arrive(loose, None)  # no program: never held
    assert progs.admissible([c, b, loose], nothing_else_runs=False) == [loose]
    info = progs.info()
    assert info["num_held"] == 2 and info["num_active"] == 1  # a (loose is no program)
    a_next = make_req("a-next", prompt_len=70, max_new=4)  # a continuation: never held
    clock.now += 1.0
    progs.finish(a)
    # a is paused (resident): even with nothing running, the held programs wait
    assert progs.admissible([c, b], nothing_else_runs=True) == []
    progs.arrive(a_next, "a")
    assert progs.admissible([b, a_next], nothing_else_runs=False) == [a_next]
    clock.now += 1.0
    progs.finish(a_next)
    assert progs.resident_tokens(clock.now) == 120  # a: twice its first turn (74 held now)
    clock.now += 10.0  # program a is done (idle): its working set no longer counts
    assert progs.resident_tokens(clock.now) == 0
    assert progs.expected_tokens == 0.2 * 74  # a's peak, the first done
    assert progs.admissible([c, b], nothing_else_runs=False) == [b, c]  # 120 + 60 fit
    progs.count_extend(b, 50)
    progs.count_extend(c, 20)
    info = progs.info()
    assert info["num_held"] == 0 and info["num_programs_held"] == 2
    assert info["program_held_s"] == 2 * 12.0  # b and c, each held 12 s
    # one program larger than the capacity runs once nothing else runs or is resident
    big = make_req("big", prompt_len=300, max_new=4)
    progs.arrive(big, "big")
    assert progs.admissible([big], nothing_else_runs=True) == []  # b and c are resident
    progs.finish(b)
    progs.finish(c)
    clock.now += 10.0  # b and c go idle (they never came back)
    assert progs.admissible([big], nothing_else_runs=False) == []
    assert progs.admissible([big], nothing_else_runs=True) == [big]


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
    for i in range(3):
        turn("long", i)
        if i < 2:
            turn("short", i)
    short, long = progs.table["short"], progs.table["long"]
    assert progs.state(short, clock.now) == progs.state(long, clock.now) == "paused"
    assert progs.resident_tokens(clock.now) == progs.expected_working_set(short)
    reported.clear()
    clock.now += 0.2  # a moment later, both still paused: only the expected done one reported
    progs.expire(clock.now + 1.0)
    assert reported == ["long"]
    # a program that looked done (a long tool pause) and came back withdraws its count
    turn("slow", 0)
    clock.now += 10.0
    progs.resident_tokens(clock.now)
    assert progs.done_turns["slow"] == 1 and progs.expected_turns() == 3
    turn("slow", 1)
    assert "slow" not in progs.done_turns
    more = make_req("long-3", prompt_len=200)
    progs.arrive(more, "long")  # it was not done: its turn runs, and it counts again
    assert progs.admissible([more], nothing_else_runs=False) == [more]
    assert progs.resident_tokens(clock.now) == (progs.expected_working_set(short)
                                                + progs.expected_working_set(long))


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
