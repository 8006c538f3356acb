"""Programs: the agents behind the requests, and admission control over them (host side).

A program is what a request names as its session (`session_id`, `session_params.id`, OpenAI's
`prompt_cache_key`, the `X-SMG-Routing-Key` header, a Responses `previous_response_id` chain's
conversation) or else its `program_id` (Anthropic's `metadata.user_id`). A request naming
none is a program of its own and is not tracked.

    first request ──► (held) ──► active (a request in the server) ──last one ends──► paused
                                   ▲                                                   │
                                   └───────────── its next request ◄───────────────────┤
                                                                                       ▼ pause
                                                             idle ◄────────── window over
                                                               │
                                                               └──ttl_s──► forgotten

Per program the table keeps the service it attained (prompt tokens computed, not the cached
ones; tokens decoded; seconds with a request in the server) and its KV working set: the
longest context of its requests (prompt + max_new_tokens), what keeps it resident. The pause
window of a program is twice the longest tool pause it took (before its first pause, twice
the mean pause of all programs), at least MIN_PAUSE_S: silent longer, it is taken as done.
A program found done, or expected done (below), after at least one tool pause is reported to
`on_done` (the scheduler releases its session-hint KV pins then, retention.py); one that never
came back after a pause keeps its pins for `--session-retention-s`, since nothing tells how
long its tool takes.

Admission control (`Programs.admissible`, with `--schedule-policy program`): a new program's
first turn is held while the expected working sets of the admitted active and paused programs
plus its own (the mean peak of the programs done before, at least twice its first turn and
what it holds) exceed the capacity (the KV pool plus the host tier),
instead of evicting the KV of programs that will come back for it. The hold is a queue: held
programs are released in arrival order as working sets end (admitted programs go idle after
their pause window), and the oldest one runs whenever nothing else is running, resident or
admissible, so a held program is delayed, never starved. Continuations
of admitted programs and requests without a program are never held.

A paused program stops counting as soon as it has run as many turns (requests) as most
programs before it did: once TURN_SAMPLES_MIN programs were found done, one paused after
`expected_turns` requests (the TURN_QUANTILE of the done programs' request counts; a program
found done that comes back withdraws its count) is expected done: its pause window no longer
keeps a slot empty, and its session-hint pins are released. Expected done is not done: it
stays paused, and its next request, if one comes, is never held (it computes what was evicted
meanwhile).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.scheduler.req import Req

MIN_PAUSE_S = 1.0
MAX_PROGRAMS = 65_536  # beyond this many, the least recently seen idle programs are forgotten
EXPIRE_EVERY_S = 1.0
RECENT_PROGRAMS = 16  # programs listed one by one in /server_info
PAUSE_EWMA = 0.1  # weight of the newest pause in the mean over all programs
PEAK_EWMA = 0.2  # weight of the newest done program's peak working set
FIRST_TURN_GROWTH = 2  # a program's expected peak over its first turn, at least
TURN_SAMPLES = 64  # request counts of the programs found done last, kept for expected_turns
TURN_SAMPLES_MIN = 4  # done programs before a turn count is expected
TURN_QUANTILE = 0.9  # of the done programs' request counts: a paused program past it is done


@dataclass(eq=False)
class Program:
    key: str
    first_arrival: int  # `Req.arrival` of its first request: the `program` policy's order
    first_seen_s: float
    last_seen_s: float  # its last request's arrival or end
    in_flight: set[str] = field(default_factory=set)  # rids of its requests in the server
    num_requests: int = 0
    prefill_tokens: int = 0  # prompt tokens computed for it (cache hits excluded)
    decode_tokens: int = 0
    server_s: float = 0.0  # seconds with at least one request in the server (closed spans)
    busy_since: float | None = None
    working_set_tokens: int = 0
    first_turn_tokens: int = 0  # its first request's prompt + max_new_tokens
    admitted: bool = False  # a turn of it has run (admission control no longer holds it)
    held_since: float | None = None  # its first turn is held by admission control
    max_pause_s: float = 0.0  # longest gap between one request's end and the next's arrival
    peak_recorded: bool = False  # its working set, once done, fed `Programs.expected_tokens`
    done_reported: bool = False  # found done and reported to `Programs.on_done`

    @property
    def attained_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class Programs:
    """The program table of one scheduler: service per program, states, admission control."""

    def __init__(self, ttl_s: float, capacity_tokens: int, admission: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.capacity_tokens = capacity_tokens  # pool + host tier, in tokens
        self.admission = admission
        self.clock = clock
        self.table: dict[str, Program] = {}
        # a moving average of the tool pauses of all programs (the pause window's fallback)
        self.mean_pause_s = 0.0
        # a moving average of the peak working sets of the programs found done
        self.expected_tokens = 0.0
        # program key -> its request count, for the programs found done last
        # (`expected_turns`); a program that comes back withdraws its count (a long tool pause
        # made it look done)
        self.done_turns: OrderedDict[str, int] = OrderedDict()
        self.num_seen = 0
        self.num_held = 0  # programs ever held
        self.held_s = 0.0  # seconds held, summed over released programs
        self._next_expire = 0.0
        # called with the key of each program found done after a tool pause (see the module
        # docstring); at most once per program until it comes back
        self.on_done: Callable[[str], None] | None = None

    @classmethod
    def for_scheduler(cls, config: SchedulerConfig, capacity_tokens: int) -> Programs:
        """`capacity_tokens`: the KV pool plus the host tier (the scheduler's KVManager)."""
        return cls(config.program_ttl_s, capacity_tokens, config.program_admission)

    # ---- a request's life ----------------------------------------------------------------
    def arrive(self, req: Req, key: str | None) -> Program | None:
        """`req` entered the server as a turn of program `key` (None: of none)."""
        now = self.clock()
        self.expire(now)
        if key is None:
            return None
        prog = self.table.get(key)
        if prog is None:
            prog = self.table[key] = Program(key, req.arrival, now, now)
            self.num_seen += 1
        elif not prog.in_flight:
            pause = now - prog.last_seen_s
            prog.peak_recorded = prog.done_reported = False  # it came back: not done
            self.done_turns.pop(key, None)
            prog.max_pause_s = max(prog.max_pause_s, pause)
            self.mean_pause_s += PAUSE_EWMA * (pause - self.mean_pause_s)
        if not prog.in_flight:
            prog.busy_since = now
        prog.in_flight.add(req.rid)
        prog.num_requests += 1
        prog.last_seen_s = now
        prog.working_set_tokens = max(prog.working_set_tokens,
                                      req.prompt_len + req.sampling.max_new_tokens)
        prog.first_turn_tokens = prog.first_turn_tokens or prog.working_set_tokens
        req.program = prog
        return prog

    def count_extend(self, req: Req, num_computed: int) -> None:
        """`num_computed` of `req`'s tokens ran in an EXTEND: its program has run."""
        prog = req.program
        if prog is None:
            return
        if num_computed > 0 and req.kv_len < req.prompt_len:
            prog.prefill_tokens += min(num_computed, req.prompt_len - req.kv_len)
        if not prog.admitted:
            prog.admitted = True
            if prog.held_since is not None:
                self.held_s += self.clock() - prog.held_since
                prog.held_since = None

    def finish(self, req: Req) -> None:
        """`req` left the server (finished, aborted or failed); idempotent."""
        prog = req.program
        if prog is None or req.rid not in prog.in_flight:
            return
        now = self.clock()
        prog.in_flight.discard(req.rid)
        prog.decode_tokens += len(req.output_ids)
        prog.last_seen_s = now
        if not prog.in_flight and prog.busy_since is not None:
            prog.server_s += now - prog.busy_since
            prog.busy_since = None

    # ---- states --------------------------------------------------------------------------
    def pause_window_s(self, prog: Program) -> float:
        return max(MIN_PAUSE_S, 2 * (prog.max_pause_s or self.mean_pause_s))

    def state(self, prog: Program, now: float) -> str:
        """"held" (its first turn, by admission control), "active", "paused" (on a tool) or
        "idle"."""
        if prog.held_since is not None and not prog.admitted:
            return "held"
        if prog.in_flight:
            return "active"
        return "paused" if now - prog.last_seen_s <= self.pause_window_s(prog) else "idle"

    def expire(self, now: float) -> None:
        """Report programs found done to `on_done`; forget programs idle for longer than the
        TTL (and the least recently seen idle ones beyond MAX_PROGRAMS), so the table stays
        bounded."""
        if now < self._next_expire and len(self.table) <= MAX_PROGRAMS:
            return
        self._next_expire = now + EXPIRE_EVERY_S
        forget = []
        turns = self.expected_turns()
        for key, prog in self.table.items():
            if prog.in_flight:
                continue
            if (self.on_done is not None and not prog.done_reported and prog.max_pause_s > 0
                    and (self.state(prog, now) == "idle" or self.expected_done(prog, turns))):
                prog.done_reported = True
                self.on_done(key)
            if now - prog.last_seen_s > self.ttl_s:
                forget.append(key)
        for key in forget:
            del self.table[key]
        if len(self.table) > MAX_PROGRAMS:
            idle = sorted((p for p in self.table.values() if not p.in_flight),
                          key=lambda p: p.last_seen_s)
            for prog in idle[: len(self.table) - MAX_PROGRAMS]:
                del self.table[prog.key]

    def clear(self) -> None:
        """Forget every program (none has a request in the server: `/flush_cache`); the
        counters since start-up stay."""
        self.table.clear()
        self.expected_tokens = 0.0
        self.done_turns.clear()

    # ---- admission control ---------------------------------------------------------------
    def resident_tokens(self, now: float) -> int:
        """The expected KV working sets of the admitted programs that are active, or paused
        and not expected done; the peaks and request counts of those found done feed
        `expected_tokens` and `expected_turns`."""
        total = 0
        turns = self.expected_turns()
        for prog in self.table.values():
            if not prog.admitted:
                continue
            state = self.state(prog, now)
            if state == "active" or (state == "paused" and not self.expected_done(prog, turns)):
                total += self.expected_working_set(prog)
            elif state == "idle" and not prog.peak_recorded:
                prog.peak_recorded = True
                self.expected_tokens += PEAK_EWMA * (prog.working_set_tokens
                                                     - self.expected_tokens)
                self.done_turns[prog.key] = prog.num_requests
                self.done_turns.move_to_end(prog.key)
                if len(self.done_turns) > TURN_SAMPLES:
                    self.done_turns.popitem(last=False)
        return total

    @staticmethod
    def expected_done(prog: Program, turns: int | None) -> bool:
        """Whether `prog`, paused, has made `turns` (expected_turns) requests."""
        return turns is not None and not prog.in_flight and prog.num_requests >= turns

    def expected_turns(self) -> int | None:
        """The request count past which a paused program is expected done (module doc); None
        before TURN_SAMPLES_MIN programs were found done."""
        if len(self.done_turns) < TURN_SAMPLES_MIN:
            return None
        counts = sorted(self.done_turns.values())
        return counts[int(TURN_QUANTILE * (len(counts) - 1))]

    def expected_working_set(self, prog: Program) -> int:
        """What a program will hold at its peak: the mean peak of the programs done before
        it, at least FIRST_TURN_GROWTH times its first turn (an agent's context grows each
        turn) and what it holds now."""
        return max(prog.working_set_tokens, FIRST_TURN_GROWTH * prog.first_turn_tokens,
                   int(self.expected_tokens))

    def admissible(self, ready: list[Req], nothing_else_runs: bool) -> list[Req]:
        """The requests of `ready` that admission control lets run now (all of them when off).
        `nothing_else_runs`: no request holds a row; then if no admitted program is resident
        either and none is admissible, the oldest held program's turn is (one larger than the
        capacity is not starved)."""
        if not self.admission:
            return ready
        now = self.clock()
        budget = self.capacity_tokens - self.resident_tokens(now)
        out: list[Req] = []
        held: list[Req] = []
        passed: set[int] = set()  # new programs let through (their working set counted once)
        for req in sorted(ready, key=lambda r: r.arrival):
            prog = req.program
            if prog is None or prog.admitted or id(prog) in passed:
                out.append(req)
            elif not held and self.expected_working_set(prog) <= budget:
                budget -= self.expected_working_set(prog)
                passed.add(id(prog))
                out.append(req)
            else:
                held.append(req)  # FIFO: no new program overtakes a held one
        seen: set[int] = set()
        for req in held:
            prog = req.program
            if id(prog) in seen:
                continue
            seen.add(id(prog))
            if prog.held_since is None:
                prog.held_since = now
                self.num_held += 1
        if not out and held and nothing_else_runs and budget == self.capacity_tokens:
            out.append(held[0])  # nothing runs or is resident: held, it would wait forever
        return out

    # ---- reports -------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """`/server_info` "programs"."""
        now = self.clock()
        self.expire(now)
        states = {"held": 0, "active": 0, "paused": 0, "idle": 0}
        held_now_s = 0.0
        for prog in self.table.values():
            states[self.state(prog, now)] += 1
            if prog.held_since is not None and not prog.admitted:
                held_now_s += now - prog.held_since
        return {
            "num_programs": len(self.table),
            "num_active": states["active"],
            "num_paused": states["paused"],
            "num_idle": states["idle"],
            "num_held": states["held"],
            "admission_control": self.admission,
            "capacity_tokens": self.capacity_tokens,
            "resident_working_set_tokens": self.resident_tokens(now),
            "expected_working_set_tokens": int(self.expected_tokens),
            "expected_turns": self.expected_turns(),
            "num_programs_seen": self.num_seen,
            "num_programs_held": self.num_held,
            "program_held_s": self.held_s + held_now_s,
            "ttl_s": self.ttl_s,
            # the most recently seen programs, newest first, with their service
            "recent": {p.key: self.program_info(p.key) for p in sorted(
                self.table.values(), key=lambda p: -p.last_seen_s)[:RECENT_PROGRAMS]},
        }

    def program_info(self, key: str) -> dict[str, Any] | None:
        """One program's service and state (None: not in the table)."""
        prog = self.table.get(key)
        if prog is None:
            return None
        now = self.clock()
        busy = 0.0 if prog.busy_since is None else now - prog.busy_since
        return {"state": self.state(prog, now), "num_requests": prog.num_requests,
                "prefill_tokens": prog.prefill_tokens, "decode_tokens": prog.decode_tokens,
                "server_s": prog.server_s + busy, "working_set_tokens": prog.working_set_tokens,
                "admitted": prog.admitted}
