"""Priority scheduling (`--enable-priority-scheduling`, scheduler/priority.py): admission in
priority order, a high-priority request retracting low-priority running ones (whose outputs stay
exact), aging that bounds a low priority's wait, and nothing changed without the flag. The
scheduler runs the hand-computable runner of tests/test_scheduler.py and a clock the test moves;
one test runs the default model."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from test_scheduler import PAGE, PlusOneRunner, V, expected, request, run_steps

from sgl_tpu.config import SchedulerConfig, ServerArgs
from sgl_tpu.executor.step import ForwardMode
from sgl_tpu.scheduler.priority import req_priority


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_pages: int = 64, max_running: int = 1, **priority):
    """A scheduler over the +1 runner whose priority rules read `clock`; `priority`: the
    SchedulerConfig's priority fields (the flag on unless given)."""
    from sgl_tpu.scheduler.scheduler import Scheduler

    priority.setdefault("enable_priority_scheduling", True)
    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=max_running, max_extend_seqs=8,
                          chunked_prefill_size=64, context_len=512, schedule_policy="fcfs",
                          **priority)
    runner = PlusOneRunner()
    sched = Scheduler(cfg, runner, num_pages=num_pages, decode=lambda ids, skip: "",
                      eos_token_ids=(), vocab_size=V)
    clock = Clock()
    if sched.extend_planner.priorities is not None:
        assert sched.memory.priorities is sched.extend_planner.priorities
        sched.extend_planner.priorities.clock = clock
    return sched, runner, clock


def add(sched, clock: Clock, rid: str, prompt: list[int], max_new: int,
        priority: int | None = None) -> None:
    msg = msgspec.structs.replace(request(rid, prompt, max_new), priority=priority)
    assert sched.add_request(msg) is None
    sched.waiting[-1].arrival_s = clock.t  # arrived now, on the test's clock


def finish_order(sched, clock: Clock | None = None, max_steps: int = 500) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.has_work:
            return order
        order += [o.rid for o in sched.step() if o.finished]
        sched.check_integrity()
        if clock is not None:
            clock.t += 1.0
    raise AssertionError("scheduler did not go idle")


def prompt(k: int, n: int = 8) -> list[int]:
    return list(range(100 + 20 * k, 100 + 20 * k + n))


PRIORITIES = {"low": 0, "mid-a": 5, "mid-b": 5, "high": 10, "none": None}


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_requests_are_admitted_in_priority_order(low_first):
    sched, _, clock = make(schedule_low_priority_values_first=low_first,
                           priority_aging_rate=0.0, disable_priority_preemption=True)
    for k, (rid, p) in enumerate(PRIORITIES.items()):
        add(sched, clock, rid, prompt(k), 3, priority=p)
    # one row: requests run one at a time, in priority order, arrival order within one
    high_first = ["high", "mid-a", "mid-b", "low", "none"]  # no priority: 0, after "low"
    want = ["low", "none", "mid-a", "mid-b", "high"] if low_first else high_first
    assert finish_order(sched) == want


def test_without_the_flag_priorities_change_nothing():
    runs = []
    for with_priorities in (False, True):
        sched, runner, clock = make(num_pages=24, max_running=4,
                                    enable_priority_scheduling=False)
        for k, (rid, p) in enumerate(PRIORITIES.items()):
            add(sched, clock, rid, prompt(k, 30), 12, priority=p if with_priorities else None)
        runs.append((finish_order(sched), runner.calls, sched.stats.num_retractions))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0  # the pool was short: retraction as without priorities


def test_default_priority_value_and_its_direction():
    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=1, max_extend_seqs=1,
                          chunked_prefill_size=8, context_len=64)
    on = dataclasses.replace(cfg, enable_priority_scheduling=True, default_priority_value=7)
    assert [req_priority(p, cfg) for p in (None, 3)] == [0, 3]
    assert [req_priority(p, on) for p in (None, 3)] == [7, 3]
    low = dataclasses.replace(on, schedule_low_priority_values_first=True)
    assert [req_priority(p, low) for p in (None, 3)] == [-7, -3]  # stored: higher = urgent


def _long_low_then_high(**priority):
    """A low-priority request that fills most of the pool decodes; then a high-priority one
    arrives that does not fit beside it (23 usable pages of 4 tokens; the low one grows to 20
    pages, the high one needs 9 with the reserve)."""
    sched, runner, clock = make(num_pages=24, max_running=4, **priority)
    low_prompt, high_prompt = prompt(0, 40), prompt(3, 32)
    add(sched, clock, "low", low_prompt, 40, priority=0)
    out = run_steps(sched, {}, max_steps=25)  # its prefill, then 24 decode steps: 16 pages
    assert len(sched.running[0].pages) >= 16 and "low" not in {r for r in out
                                                                 if out[r]["reason"]}
    add(sched, clock, "high", high_prompt, 4, priority=20)
    order = []
    for _ in range(200):
        if not sched.has_work:
            break
        for o in sched.step():
            r = out.setdefault(o.rid, {"ids": [], "reason": None, "cached": 0})
            r["ids"] += o.new_token_ids
            if o.finished:
                order.append(o.rid)
        sched.check_integrity()
    assert not sched.has_work
    assert out["low"]["ids"] == expected(low_prompt, 40)
    assert out["high"]["ids"] == expected(high_prompt, 4)
    return sched, runner, order


def test_a_high_priority_request_retracts_a_low_priority_one_that_still_finishes_exactly():
    sched, runner, order = _long_low_then_high()
    assert order == ["high", "low"]
    assert sched.stats.num_priority_preemptions == 1 and sched.stats.num_retractions == 1
    # the high one's prefill ran alone, right after the low one was retracted, and the low
    # one resumed from its KV in the radix cache: its prompt was not computed again
    extends = [c for m, c in runner.calls if m == ForwardMode.EXTEND]
    assert extends[1] == [(32, 0)]
    assert extends[2][0][1] >= 40


@pytest.mark.parametrize("priority", [
    {"disable_priority_preemption": True},
    {"priority_scheduling_preemption_threshold": 20},  # a gap of 20 is not more than 20
    {"enable_priority_scheduling": False},
])
def test_no_preemption_without_it_or_below_the_threshold(priority):
    sched, _, order = _long_low_then_high(**priority)
    assert order == ["low", "high"]
    assert sched.stats.num_priority_preemptions == 0 and sched.stats.num_retractions == 0


@pytest.mark.parametrize("aging_rate, bound", [(1.0, 40), (0.0, None)])
def test_aging_admits_a_low_priority_request_behind_a_stream_of_high_ones(aging_rate, bound):
    """A high-priority request (10 levels up) arrives every step, one second apart; each needs
    two steps, so they pile up. At a level per second the low one, older than all of them,
    overtakes those that arrived 10 s after it and finishes within `bound` steps; without
    aging it waits as long as the stream lasts."""
    sched, _, clock = make(max_running=1, priority_aging_rate=aging_rate,
                           disable_priority_preemption=True)
    add(sched, clock, "low", prompt(0), 1, priority=0)
    finished_at = None
    for step in range(80):
        add(sched, clock, f"high{step}", prompt(1 + step % 5), 2, priority=10)
        if any(o.rid == "low" and o.finished for o in sched.step()):
            finished_at = step
            break
        clock.t += 1.0
    if bound is None:
        assert finished_at is None
    else:
        assert finished_at is not None and 10 <= finished_at <= bound


def test_retraction_policy_priority_retracts_the_lowest_priority_first():
    """Decode runs out of pages: `length` retracts the least progress (the high-priority
    request, admitted last), `priority` the lowest priority."""
    retracted = {}
    for policy in ("length", "priority"):
        sched, _, clock = make(num_pages=13, max_running=3, retraction_policy=policy,
                               priority_aging_rate=0.0)
        out = {}
        # admitted one by one, each decoding a while: the later, the less progress
        for k, (rid, p, steps) in enumerate((("low", 0, 3), ("mid", 5, 2), ("high", 9, 1))):
            add(sched, clock, rid, prompt(k), 12, priority=p)
            run_steps(sched, out, max_steps=steps)
        seen, retract = [], sched.memory.retract

        def recording_retract(req, retract=retract, seen=seen):
            seen.append(req.rid)
            retract(req)

        sched.memory.retract = recording_retract
        run_steps(sched, out)
        assert not sched.has_work
        for k, rid in enumerate(("low", "mid", "high")):
            assert out[rid]["ids"] == expected(prompt(k), 12)
        retracted[policy] = seen[0]
    assert retracted == {"length": "high", "priority": "low"}


def test_priority_flags_are_validated():
    for bad in ({"priority_scheduling_preemption_threshold": -1},
                {"priority_aging_rate": float("inf")}, {"priority_aging_rate": -0.5},
                {"default_priority_value": 2**31}, {"retraction_policy": "lifo"},
                {"retraction_policy": "priority"}):  # needs --enable-priority-scheduling
        with pytest.raises(ValueError):
            ServerArgs(**bad)
        with pytest.raises(ValueError):
            SchedulerConfig(page_size=PAGE, max_running_requests=1, max_extend_seqs=1,
                            chunked_prefill_size=8, context_len=64, **bad)
    args = ServerArgs(enable_priority_scheduling=True, retraction_policy="priority",
                      priority_aging_rate=0.5, default_priority_value=-3)
    from sgl_tpu.cli import parse_args, to_argv

    assert parse_args(to_argv(args)) == args


@pytest.mark.slow
def test_default_model_output_survives_a_priority_retraction():
    """The default model (float32): a low-priority request retracted mid-decode for a
    high-priority one that does not fit beside it resumes from its KV in the radix cache and
    gives the greedy output it gives alone."""
    import random

    from sgl_tpu.engine import build_scheduler
    from sgl_tpu.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # 16 pages of 16 tokens: the low request grows to 9 pages, the high one needs 11
    args = ServerArgs(skip_warmup=True, dtype="float32", max_total_tokens=256,
                      max_running_requests=4, speculative_algorithm="none",
                      enable_priority_scheduling=True)
    sched, _ = build_scheduler(args)
    clock = Clock()
    sched.extend_planner.priorities.clock = clock
    rng = random.Random(0)
    low = [rng.randrange(100, 40000) for _ in range(100)]
    high = [rng.randrange(100, 40000) for _ in range(160)]

    add(sched, clock, "alone", low, 40, priority=0)
    alone = run_steps(sched, {})["alone"]["ids"]
    assert len(alone) == 40 and sched.flush_cache()
    add(sched, clock, "low", low, 40, priority=0)
    out = run_steps(sched, {}, max_steps=17)
    assert sched.running and len(out["low"]["ids"]) == 17
    add(sched, clock, "high", high, 4, priority=20)
    run_steps(sched, out)
    assert not sched.has_work
    assert sched.stats.num_priority_preemptions == 1
    assert out["high"]["reason"]["type"] == "length" and len(out["high"]["ids"]) == 4
    assert out["low"]["ids"] == alone
    assert out["low"]["reason"]["type"] == "length"
