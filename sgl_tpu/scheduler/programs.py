"""Programs: the agents behind the requests, and admission control over them (host side).

A program is what a request names as its session (`session_id`, `session_params.id`, OpenAI's
`prompt_cache_key`, the `X-SMG-Routing-Key` header, a Responses chain's conversation) or else
its `program_id` (Anthropic's `metadata.user_id`); a request naming none is not tracked. The
client's key never leaves this module: reports name a program by `Program.public_id`, an
HMAC-SHA256 of the key under a random secret of this server, truncated (`PublicIds`).

    first request ──► (held) ──► active ──its last request ends──► paused ──window over──► idle
                                   ▲                                  │                     │
                                   └──────────── its next request ◄───┘          ttl_s ──► forgotten

Per program: the service it attained; its KV working set, the peak sum of its in-flight
requests' contexts (prompt + max_new_tokens, or for a request whose max_new_tokens the server
defaulted to the rest of the context, prompt + the longest output its program, else the mean
output the server, has seen); its state. Paused for longer than its pause window (twice its
longest tool pause, else twice the mean pause, at least MIN_PAUSE_S) it is found idle, and
after a tool pause reported to `on_done` (retention.py releases its session-hint pins). Per
program also where its prompt tokens came from and what prefetching did (`KVCounters`, kept by
prefetch.py in `Program.kv`), and, while it pauses, when it is expected back and the KV it will
claim then (`claims_before`: prefetch.py keeps a prefetch out of a sooner returner's room).

Who is walked, so no call costs the size of the table:

    live    programs not found idle (held, active, paused)    walked by `admissible`, `info`
    held    programs whose first turn admission control holds  in hold order
    table   every program, in last-seen order                  `expire` forgets from its front

Admission control (`admissible`, with `--schedule-policy program`): a new program's first turn
is held while the expected working sets of the admitted live programs plus its own exceed the
capacity (KV pool + host tier). Held programs are looked at in hold order and each one that
fits the budget left goes (a smaller one passes a larger one). When no held program was
admitted for `hold_bound_s()` = max(HOLD_BOUND_MIN_S, the mean turn time) (and the first in
hold order has waited that long), that one goes regardless of the budget and ranks first in
the `program` policy (`program_ranks`): one program per bound past the capacity while the
queue makes no progress, so the k-th held program waits at most k bounds, and a sustained
overload, where admitted programs end and free the budget, is not turned into thrashing. The
first held program also goes when no admitted program is resident (it is larger than the
capacity). Continuations of admitted programs and requests of no program are never held
and never delay a release.

Two populations: one-shot programs (a key per chat, a flood of session ids) and agents that come
back after tool pauses. A paused program that has come back at least once is expected done once
it made `expected_turns` requests (the TURN_QUANTILE of the request counts of such programs
found done): its working set stops counting and `on_done` releases its pins. A program paused
after its first turn counts its working set times `return_rate`, the share of programs seen to
come back after their first turn (a moving mean, 1 until one-shots are seen). So one-shots never
teach the server that agents are done after one turn, and a flood of them does not hold the next
newcomers. The reasoning and the measurements: docs/agents-at-scale.md.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import os
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
RECENT_PROGRAMS = 16  # programs listed one by one (by public id) in /server_info
PAUSE_EWMA = 0.1  # weight of the newest pause in the mean over all programs
PEAK_EWMA = 0.2  # weight of the newest done program's peak working set
TURN_EWMA = 0.1  # weight of the newest turn in the mean turn time
OUTPUT_EWMA = 0.1  # weight of the newest output length in the server's mean
UNSEEN_OUTPUT_TOKENS = 128  # a defaulted request's output before any was seen (the native default)
FIRST_TURN_GROWTH = 2  # a program's expected peak over its first turn, at least
TURN_SAMPLES = 64  # request counts of the programs found done last, kept for expected_turns
RETURN_EWMA = 0.1  # weight of the newest program in `return_rate` (came back or found idle)
TURN_SAMPLES_MIN = 4  # done programs before a turn count is expected
TURN_QUANTILE = 0.9  # of the done programs' request counts: a paused program past it is done
HOLD_BOUND_MIN_S = 10.0  # a held program goes after at most max(this, the mean turn time)
SHARE_AGING_S = 10.0  # a waiting request's share level drops by one per this many seconds
PUBLIC_ID_HEX = 16  # hex digits of a program's public id (64 bits of the HMAC)
PROGRAM_PAUSE_EWMA = 0.3  # weight of a program's newest pause in its own mean (prefetch.py)


class PublicIds:
    """Client keys as reports name them: an HMAC-SHA256 under a random secret of this
    instance, truncated to PUBLIC_ID_HEX hex digits (stable for the server's life, meaningless
    to anyone else)."""

    def __init__(self) -> None:
        self._secret = os.urandom(32)  # never leaves the process

    def __call__(self, key: str) -> str:
        digest = hmac.new(self._secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return digest.hexdigest()[:PUBLIC_ID_HEX]


@dataclass
class KVCounters:
    """Where a program's prompt tokens came from, and what prefetching did for it (per program
    and summed over all; scheduler/prefetch.py)."""

    reused_tokens: int = 0  # cached prompt tokens that were in the pool when the request came
    loaded_tokens: int = 0  # cached prompt tokens loaded from the host or disk tier
    computed_tokens: int = 0  # prompt tokens prefilled
    prefetched_tokens: int = 0  # tokens a prefetch moved from a tier into the pool
    num_prefetches: int = 0  # prefetches started (by the expected pause, or a hint)
    num_prefetch_hits: int = 0  # done before the program came back, and still in the pool
    num_prefetch_late: int = 0  # the program came back while its prefetch was still moving
    num_prefetch_wasted: int = 0  # evicted again, or the program never came back in time
    # not started (once per pause): the programs expected back sooner and the waiting requests
    # would claim the room before it came back
    num_prefetch_skipped: int = 0


@dataclass(eq=False)
class ProgramKV:
    """What the prefetcher (scheduler/prefetch.py) keeps per program."""

    resume_ids: list[int] | None = None  # its last request's cached tokens: what it resends
    resume_namespace: str | None = None
    paused_at: float | None = None  # when its last request ended (None: in flight, or new)
    pause_mean_s: float = 0.0  # its own pauses, a PROGRAM_PAUSE_EWMA mean
    num_pauses: int = 0
    pause_prefetches: int = 0  # prefetches started by time in its current pause
    pause_skipped: bool = False  # a prefetch was skipped in its current pause (counted once)
    prefetch: Any = None  # its prefetch in flight or done (prefetch.Prefetch), or None
    counters: KVCounters = field(default_factory=KVCounters)


@dataclass(eq=False)
class Program:
    key: str  # the client's string: never reported (public_id is)
    public_id: str
    first_arrival: int  # `Req.arrival` of its first request
    first_seen_s: float
    last_seen_s: float  # its last request's arrival or end
    in_flight: dict[str, int] = field(default_factory=dict)  # rid -> context tokens counted
    in_flight_tokens: int = 0  # their sum
    num_requests: int = 0
    prefill_tokens: int = 0  # prompt tokens computed for it (cache hits excluded)
    decode_tokens: int = 0
    server_s: float = 0.0  # seconds with at least one request in the server (closed spans)
    busy_since: float | None = None
    working_set_tokens: int = 0  # peak of in_flight_tokens
    first_turn_tokens: int = 0  # its first request's context
    max_output_tokens: int = 0  # longest output of its finished requests
    admitted: bool = False  # a turn of it has run (admission control no longer holds it)
    returned: bool = False  # it came back after a turn ended (not a one-shot)
    held_since: float | None = None  # its first turn is held by admission control
    release_due: bool = False  # released by the hold bound: its first turn ranks first
    max_pause_s: float = 0.0  # longest gap between one request's end and the next's arrival
    done_recorded: bool = False  # found idle, it fed `expected_tokens`/`return_rate`
    done_reported: bool = False  # found done and reported to `Programs.on_done`
    kv: ProgramKV = field(default_factory=ProgramKV)  # the prefetcher's (prefetch.py)

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
        self.public_id = PublicIds()  # what reports name a program by (sessions.py too)
        self.table: OrderedDict[str, Program] = OrderedDict()  # least recently seen first
        self.live: dict[str, Program] = {}
        self.held: dict[str, Program] = {}
        self.mean_pause_s = 0.0  # of all programs' tool pauses (the pause window's fallback)
        self.mean_turn_s = 0.0  # of the admitted programs' turns (the hold bound)
        self.mean_output_tokens: float | None = None  # of finished requests' outputs
        self.expected_tokens = 0.0  # mean peak working set of the returned programs found done
        # program key -> its request count, for the returned programs found done last
        # (`expected_turns`); a program that comes back withdraws its count
        self.done_turns: OrderedDict[str, int] = OrderedDict()
        self.return_rate = 1.0  # share of programs that came back after their first turn
        self.num_seen = 0
        self.num_held = 0  # programs ever held
        self.held_s = 0.0  # seconds held, summed over programs no longer held
        self.last_release_s = float("-inf")  # when a held program was last admitted
        self.num_visits = 0  # programs looked at by sweeps (what admission costs)
        # paused admitted programs expected back (returned ones count 1, others return_rate),
        # as of the last sweep: the row share keeps their rows (extend_planner `_row_share`)
        self.expected_back = 0.0
        self.kv_totals = KVCounters()  # every program's, since start-up
        # (expected back at, claim tokens) of the paused programs expected back, as of the last
        # sweep (at `returns_at`), and of those paused since (`pausing`): `claims_before` sums
        self.returns: list[tuple[float, int]] = []
        self.returns_at = 0.0
        self._claims: tuple[list[float], list[int]] | None = None  # `returns` sorted, summed
        self._next_expire = 0.0
        # called with the key of each program found done after a tool pause, at most once
        # per program until it comes back
        self.on_done: Callable[[str], None] | None = None

    @classmethod
    def for_scheduler(cls, config: SchedulerConfig, capacity_tokens: int) -> Programs:
        """`capacity_tokens`: the KV pool plus the host tier (the scheduler's KVManager)."""
        return cls(config.program_ttl_s, capacity_tokens, config.program_admission)

    # ---- a request's life ----------------------------------------------------------------
    def arrive(self, req: Req, key: str | None, max_new_tokens_defaulted: bool = False
               ) -> Program | None:
        """`req` entered the server as a turn of program `key` (None: of none).
        `max_new_tokens_defaulted`: the server set its max_new_tokens to the rest of the
        context (the client named none): it counts the outputs seen instead."""
        now = self.clock()
        self.expire(now)
        if key is None:
            return None
        prog = self.table.get(key)
        if prog is None:
            prog = self.table[key] = Program(key, self.public_id(key), req.arrival, now, now)
            self.num_seen += 1
        else:
            self.table.move_to_end(key)
            if not prog.in_flight:
                pause = now - prog.last_seen_s
                prog.done_recorded = prog.done_reported = False  # it came back: not done
                self.done_turns.pop(key, None)
                if not prog.returned:
                    prog.returned = True
                    self.return_rate += RETURN_EWMA * (1.0 - self.return_rate)
                prog.max_pause_s = max(prog.max_pause_s, pause)
                self.mean_pause_s += PAUSE_EWMA * (pause - self.mean_pause_s)
        if not prog.in_flight:
            prog.busy_since = now
        tokens = self.context_tokens(req, prog, max_new_tokens_defaulted)
        prog.in_flight_tokens += tokens - prog.in_flight.get(req.rid, 0)
        prog.in_flight[req.rid] = tokens
        prog.working_set_tokens = max(prog.working_set_tokens, prog.in_flight_tokens)
        prog.first_turn_tokens = prog.first_turn_tokens or tokens
        prog.num_requests += 1
        prog.last_seen_s = now
        self.live[key] = prog
        req.program = prog
        return prog

    def context_tokens(self, req: Req, prog: Program, max_new_tokens_defaulted: bool) -> int:
        """The KV a request of `prog` is expected to reach."""
        out = req.sampling.max_new_tokens
        if max_new_tokens_defaulted:
            seen = prog.max_output_tokens or self.mean_output_tokens or UNSEEN_OUTPUT_TOKENS
            out = min(out, int(seen))
        return req.prompt_len + out

    def count_extend(self, req: Req, num_computed: int) -> None:
        """`num_computed` of `req`'s tokens ran in an EXTEND: its program has run."""
        prog = req.program
        if prog is None:
            return
        if num_computed > 0 and req.kv_len < req.prompt_len:
            prog.prefill_tokens += min(num_computed, req.prompt_len - req.kv_len)
            self.count_kv(prog, computed_tokens=min(num_computed, req.prompt_len - req.kv_len))
        if not prog.admitted:
            prog.admitted = True
            now = self.clock()
            if prog.held_since is not None:
                self.last_release_s = now  # the hold queue moved on
            self._end_hold(prog, now)

    def count_kv(self, prog: Program, **deltas: int) -> None:
        """Add `deltas` (KVCounters fields) to `prog`'s counters and the totals."""
        for name, delta in deltas.items():
            setattr(prog.kv.counters, name, getattr(prog.kv.counters, name) + delta)
            setattr(self.kv_totals, name, getattr(self.kv_totals, name) + delta)

    def count_cached(self, req: Req) -> None:
        """`req` was admitted with `req.cached_tokens` from the cache: those that were in the
        pool at its arrival (`req.pool_hit_tokens`) count as reused, the rest as loaded."""
        if req.program is not None:
            reused = min(req.pool_hit_tokens, req.cached_tokens)
            self.count_kv(req.program, reused_tokens=reused,
                          loaded_tokens=req.cached_tokens - reused)

    def expected_pause_s(self, prog: Program) -> float:
        """How long `prog` is expected to pause: the mean of its own pauses, else the mean of
        every program's (0: no pause seen yet)."""
        return prog.kv.pause_mean_s if prog.kv.num_pauses else self.mean_pause_s

    def finish(self, req: Req) -> None:
        """`req` left the server (finished, aborted or failed); idempotent."""
        prog = req.program
        if prog is None or req.rid not in prog.in_flight:
            return
        now = self.clock()
        prog.in_flight_tokens -= prog.in_flight.pop(req.rid)
        num_output = len(req.output_ids)
        prog.decode_tokens += num_output
        prog.max_output_tokens = max(prog.max_output_tokens, num_output)
        self.mean_output_tokens = num_output if self.mean_output_tokens is None else (
            self.mean_output_tokens + OUTPUT_EWMA * (num_output - self.mean_output_tokens))
        prog.last_seen_s = now
        if self.table.get(prog.key) is prog:
            self.table.move_to_end(prog.key)
        if prog.in_flight:
            return
        if prog.busy_since is not None:
            span = now - prog.busy_since
            prog.server_s += span
            prog.busy_since = None
            if prog.admitted:
                self.mean_turn_s += TURN_EWMA * (span - self.mean_turn_s)
        if not prog.admitted:
            self._end_hold(prog, now)  # it left while held (aborted)

    def _end_hold(self, prog: Program, now: float) -> None:
        if prog.held_since is not None:
            self.held_s += now - prog.held_since
            prog.held_since = None
        prog.release_due = False
        self.held.pop(prog.key, None)

    # ---- states --------------------------------------------------------------------------
    def pause_window_s(self, prog: Program) -> float:
        return max(MIN_PAUSE_S, 2 * (prog.max_pause_s or self.mean_pause_s))

    def state(self, prog: Program, now: float) -> str:
        """"held" (its first turn, by admission control), "active", "paused" (on a tool) or
        "idle" (found idle stays idle until its next request)."""
        if prog.held_since is not None:
            return "held"
        if prog.in_flight:
            return "active"
        if self.live.get(prog.key) is not prog:
            return "idle"
        return "paused" if now - prog.last_seen_s <= self.pause_window_s(prog) else "idle"

    def _sweep(self, now: float) -> int:
        """Walk the live programs: those found idle leave `live` (`_learn_done`), those found
        done after a tool pause are reported to `on_done`. Returns the expected working sets of
        the admitted ones that are active, or paused and not expected done (paused after their
        first turn: times `return_rate`); counts the paused ones into `expected_back`."""
        total = 0
        back = 0.0
        turns = self.expected_turns()
        gone = []
        self.returns = []
        self.returns_at = now
        self._claims = None
        for key, prog in self.live.items():
            self.num_visits += 1
            state = self.state(prog, now)
            if state == "held":
                continue
            expected_done = self.expected_done(prog, turns)
            if state == "active" or (state == "paused" and not expected_done):
                if not prog.admitted:
                    continue
                if state == "paused" and not prog.returned:  # back with chance return_rate
                    total += int(self.return_rate * self.expected_working_set(prog, 1.0))
                    back += self.return_rate
                else:
                    total += self.expected_working_set(prog)
                    back += state == "paused"
                if state == "paused":
                    self._add_return(prog, now)
                continue
            if state == "idle":
                gone.append(key)
                if prog.admitted and not prog.done_recorded:
                    prog.done_recorded = True
                    self._learn_done(prog)
            if self.on_done is not None and not prog.done_reported and prog.max_pause_s > 0:
                prog.done_reported = True
                self.on_done(key)
        for key in gone:
            del self.live[key]
        self.expected_back = back
        return total

    # ---- expected returns (prefetch.py) ---------------------------------------------------------
    def expected_back_at(self, prog: Program, now: float) -> float | None:
        """When paused `prog` is expected back, as seen at `now` (the programs' clock): its
        pause start plus its expected pause, or, once it has paused for longer than half that,
        as long again as it has so far (pauses are heavy-tailed: the longer one has lasted, the
        longer it is likely to last; the median of a Pareto tail of shape 1). None if it is not
        paused or no pause was seen yet."""
        expected = self.expected_pause_s(prog)
        paused_at = prog.kv.paused_at
        if paused_at is None or expected <= 0:
            return None
        return paused_at + max(expected, 2 * (now - paused_at))

    def return_claim_tokens(self, prog: Program) -> int:
        """The KV `prog`'s next turn is expected to claim: its working set (the peak of its
        in-flight contexts), times `return_rate` while it has not come back yet."""
        share = 1.0 if prog.returned else self.return_rate
        return int(share * prog.working_set_tokens)

    def pausing(self, prog: Program) -> None:
        """`prog`'s last request in flight ended (its `kv.paused_at` is set): it counts in
        `claims_before` before the next sweep."""
        if prog.admitted:
            self._add_return(prog, prog.kv.paused_at)

    def _add_return(self, prog: Program, now: float) -> None:
        back_at = self.expected_back_at(prog, now)
        if back_at is not None:
            self.returns.append((back_at, self.return_claim_tokens(prog)))
            self._claims = None

    def claims_before(self, back_at: float) -> int:
        """The tokens the paused programs expected back before `back_at` will claim, as seen at
        `returns_at` (the last sweep; compare a `back_at` seen then), plus those paused since
        (one that came back since still counts, and its request then counts twice until the
        next sweep). Sorts once per change."""
        if self._claims is None:
            ordered = sorted(self.returns)
            self._claims = ([t for t, _ in ordered],
                            list(itertools.accumulate((c for _, c in ordered), initial=0)))
        times, sums = self._claims
        return sums[bisect.bisect_left(times, back_at)]

    def _learn_done(self, prog: Program) -> None:
        """`prog` was found idle: a one-shot lowers `return_rate`; a returned program's peak
        and request count feed `expected_tokens` and `expected_turns`."""
        if not prog.returned:
            self.return_rate -= RETURN_EWMA * self.return_rate
            return
        self.expected_tokens += PEAK_EWMA * (prog.working_set_tokens - self.expected_tokens)
        self.done_turns[prog.key] = prog.num_requests
        self.done_turns.move_to_end(prog.key)
        if len(self.done_turns) > TURN_SAMPLES:
            self.done_turns.popitem(last=False)

    def expire(self, now: float) -> None:
        """At most once per EXPIRE_EVERY_S (or when over MAX_PROGRAMS): sweep the live
        programs, and forget those silent for longer than the TTL, and the least recently seen
        beyond MAX_PROGRAMS, from the table's front (never one with a request in flight)."""
        if now < self._next_expire and len(self.table) <= MAX_PROGRAMS:
            return
        self._next_expire = now + EXPIRE_EVERY_S
        self._sweep(now)
        for _ in range(len(self.table)):
            key, prog = next(iter(self.table.items()))
            if now - prog.last_seen_s <= self.ttl_s and len(self.table) <= MAX_PROGRAMS:
                break
            if prog.in_flight:  # seen now, in effect
                self.table.move_to_end(key)
                continue
            del self.table[key]
            self.live.pop(key, None)

    def clear(self) -> None:
        """Forget every program (none has a request in the server: `/flush_cache`); the
        counters since start-up stay."""
        self.table.clear()
        self.live.clear()
        self.held.clear()
        self.expected_tokens = 0.0
        self.done_turns.clear()
        self.return_rate = 1.0
        self.returns = []
        self._claims = None

    # ---- admission control ---------------------------------------------------------------
    def resident_tokens(self, now: float) -> int:
        """The expected KV working sets of the admitted programs that are active, or paused
        and not expected done."""
        return self._sweep(now)

    @staticmethod
    def expected_done(prog: Program, turns: int | None) -> bool:
        """Whether `prog`, paused after coming back at least once, has made `turns`
        (expected_turns) requests."""
        return (turns is not None and prog.returned and not prog.in_flight
                and prog.num_requests >= turns)

    def expected_turns(self) -> int | None:
        """The request count past which a paused returned program is expected done; None
        before TURN_SAMPLES_MIN returned programs were found done."""
        if len(self.done_turns) < TURN_SAMPLES_MIN:
            return None
        counts = sorted(self.done_turns.values())
        return counts[int(TURN_QUANTILE * (len(counts) - 1))]

    def expected_working_set(self, prog: Program, agent_share: float | None = None) -> int:
        """What a program will hold at its peak: at least what it holds now and
        FIRST_TURN_GROWTH times its first turn (an agent's context grows each turn), and the
        mean peak of the returned programs done before it times `agent_share`, the chance
        that it is an agent (1 once it came back, else `return_rate`)."""
        if agent_share is None:
            agent_share = 1.0 if prog.returned else self.return_rate
        return max(prog.working_set_tokens, FIRST_TURN_GROWTH * prog.first_turn_tokens,
                   int(agent_share * self.expected_tokens))

    def hold_bound_s(self) -> float:
        """When no held program was admitted for this long, the first in hold order goes,
        whatever runs."""
        return max(HOLD_BOUND_MIN_S, self.mean_turn_s)

    def admissible(self, ready: list[Req]) -> list[Req]:
        """The requests of `ready` that admission control lets run now (all of them when off):
        those of no program or of admitted programs; of new programs, in hold order, those
        that fit the budget left, the first held one when no held program was admitted for
        `hold_bound_s()` (it is due), or the first one when no admitted program is resident.
        Costs O(len(ready) + live programs)."""
        if not self.admission:
            return ready
        now = self.clock()
        budget = self.capacity_tokens - self.resident_tokens(now)
        new = {r.program for r in ready if r.program is not None and not r.program.admitted}
        # the queue made no progress for a bound: its first program is due
        overdue = now - self.last_release_s >= self.hold_bound_s()
        held: set[Program] = set()
        for prog in sorted(new, key=lambda p: (p.held_since is None, p.held_since or 0.0,
                                               p.first_arrival)):
            need = self.expected_working_set(prog)
            if need > budget and prog.held_since is None:
                prog.held_since = now
                self.held[prog.key] = prog
                self.num_held += 1
            due = overdue and prog.held_since is not None and (
                now - prog.held_since >= self.hold_bound_s())
            overdue = False  # one program per bound
            # budget == capacity: no admitted program is resident and none passed
            if need <= budget or due or budget == self.capacity_tokens:
                prog.release_due = due
                budget -= need
            else:
                held.add(prog)
        return [r for r in ready if r.program not in held]

    # ---- reports -------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """`/server_info` "programs": counts, and programs by public id only."""
        now = self.clock()
        self.expire(now)
        resident = self._sweep(now)
        states = {"held": 0, "active": 0, "paused": 0, "idle": 0}
        for prog in self.live.values():
            states[self.state(prog, now)] += 1
        states["idle"] += len(self.table) - len(self.live)
        held_now_s = sum(now - p.held_since for p in self.held.values()
                         if p.held_since is not None)
        recent = itertools.islice(reversed(self.table.values()), RECENT_PROGRAMS)
        return {
            "num_programs": len(self.table),
            "num_active": states["active"],
            "num_paused": states["paused"],
            "num_idle": states["idle"],
            "num_held": states["held"],
            "admission_control": self.admission,
            "capacity_tokens": self.capacity_tokens,
            "resident_working_set_tokens": resident,
            "expected_working_set_tokens": int(self.expected_tokens),
            "expected_turns": self.expected_turns(),
            "return_rate": round(self.return_rate, 4),
            "hold_bound_s": self.hold_bound_s(),
            "num_programs_seen": self.num_seen,
            "num_programs_held": self.num_held,
            "program_held_s": self.held_s + held_now_s,  # never decreases
            "ttl_s": self.ttl_s,
            "kv": vars(self.kv_totals).copy(),  # every program's KVCounters, summed
            # the most recently seen programs, newest first, by public id
            "recent": {p.public_id: self._describe(p, now) for p in recent},
        }

    def program_info(self, key: str) -> dict[str, Any] | None:
        """One program's service and state (None: not in the table); in-process only."""
        prog = self.table.get(key)
        return None if prog is None else self._describe(prog, self.clock())

    def _describe(self, prog: Program, now: float) -> dict[str, Any]:
        busy = 0.0 if prog.busy_since is None else now - prog.busy_since
        return {"state": self.state(prog, now), "num_requests": prog.num_requests,
                "prefill_tokens": prog.prefill_tokens, "decode_tokens": prog.decode_tokens,
                "server_s": prog.server_s + busy, "working_set_tokens": prog.working_set_tokens,
                "admitted": prog.admitted, "kv": vars(prog.kv.counters).copy()}


def program_ranks(waiting: list[Req], now: float | None = None) -> dict[int, tuple[int, int]]:
    """The `program` policy's key per request (by `id`): (share level, program's first
    arrival). Level -1: a program released by the hold bound (its first turn goes first).
    Level k: k requests of its program are in the server ahead of it (running, or waiting and
    arrived earlier), less one per SHARE_AGING_S it has waited; so each program gets one
    request's share per level, and one key with many parallel requests does not rank ahead of
    every newer program. A request of no program ranks as a program that arrived with it."""
    now = time.monotonic() if now is None else now
    queued: dict[int, int] = {}
    for r in waiting:
        if r.program is not None:
            queued[id(r.program)] = queued.get(id(r.program), 0) + 1
    ahead: dict[int, int] = {}
    ranks: dict[int, tuple[int, int]] = {}
    for r in sorted(waiting, key=lambda r: r.arrival):
        prog = r.program
        if prog is None:
            ranks[id(r)] = (0, r.arrival)
        elif prog.release_due:
            ranks[id(r)] = (-1, prog.first_arrival)
        else:
            before = ahead.get(id(prog), max(len(prog.in_flight) - queued[id(prog)], 0))
            ahead[id(prog)] = before + 1
            level = max(before - int((now - r.arrival_s) / SHARE_AGING_S), 0)
            ranks[id(r)] = (level, prog.first_arrival)
    return ranks
