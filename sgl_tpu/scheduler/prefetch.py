"""Prefetch: a paused program's KV back in the pool before its next request (host side).

A program (programs.py) whose last request ended is paused on a tool, and its next request
resends that request's cached tokens (`ProgramKV.resume_ids`). Under pressure the pool evicts
them (with tiers: demotes them to the host tier, then disk). The prefetcher moves them back:

    its last request ends ──► paused ──DUE_FRACTION of its expected pause──► due
                                                                              │ checked every
                                                                              │ RECHECK_S while
    a part of its prefix is in a tier, and the pool has room ◄────────────────┘ it stays paused
              │
              ▼
    prefetch (a kv_manager.PrefixLoad: a step's part per step), pinned ──► its next request:
    a hit (done, still in the pool), late (still moving: its own load takes the rest), or
    wasted (evicted again: a new prefetch may start; or its pause window ended, or it was
    found done, first)

Expected pause: the mean of the program's own pauses, else of every program's (none seen yet:
nothing starts by time; a hint still can; by time at most PREFETCHES_PER_PAUSE per pause).
Room: the pages free in the pool or evictable, less the pages the waiting requests' prompts
need and those other programs' prefetches pin (prefetches never evict each other); running
requests' KV is locked, never evicted. By time, a prefetch takes only what is left after the
programs expected back before it (`Programs.expected_back_at`) claim their working sets
(`Programs.claims_before`); with nothing left it is skipped, counted once per pause. Due
programs are looked at in the order they are expected back. A prefetch moves only in steps
where no waiting request's own load moved: one `TieredCache.step_pages` part per step while
requests run, the whole prefix while none does; none while the room is gone.
Its pin (owner `prefetch_owner`) lasts until the program's pause window ends (at least
PIN_MIN_S, at most --max-retention-s) and is dropped once the program's request is admitted
(admission locks the prefix) or the prefetch is found wasted.

Client hints (`/kv_hints`: the retain / prefetch / release actions of SGLang's RFC #27574, in
the `kv_hints` envelope of its follow-up #36224), by program key: `retain` pins the program's
resume prefix, as far as it is in the pool, for `ttl_seconds`; `prefetch` starts its prefetch
now (pinned for `ttl_seconds`, else its pause window); `release` drops its retain, prefetch and
session-hint pins and stops its prefetch. Reasoning and measurements: docs/agents-at-scale.md.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_tpu.scheduler.kv_manager import IDLE_LOAD_WAIT_S, KVManager, PrefixLoad
from sgl_tpu.scheduler.programs import PROGRAM_PAUSE_EWMA, Program, Programs
from sgl_tpu.scheduler.req import Req

DUE_FRACTION = 0.5  # a prefetch is first considered after this fraction of the expected pause
RECHECK_S = 0.5  # a due program whose prefix is resident, or that found no room, is checked again
PIN_MIN_S = 5.0  # a prefetch's pin lasts at least this long
PREFETCHES_PER_PAUSE = 2  # by time: a second one only after the first was evicted again


def prefetch_owner(key: str) -> str:
    """The pin owner of a program's prefetched KV."""
    return f"prefetch\x00{key}"


def retain_owner(key: str) -> str:
    """The pin owner of a program's `retain` hint."""
    return f"retain\x00{key}"


@dataclass(eq=False)
class Prefetch:
    load: PrefixLoad
    start: int  # tokens of the prefix in the pool when it started
    limit: int  # tokens of the prefix it stops at (what the tiers held and the room allowed)
    pin_until: float  # on the tree's clock
    done: bool = False


class Prefetcher:
    def __init__(self, kv: KVManager, programs: Programs, *, enabled: bool,
                 max_retention_s: float) -> None:
        self.kv = kv
        self.tree = kv.tree
        self.programs = programs
        self.enabled = enabled and kv.tiers is not None  # prefetch by expected pause
        self.max_retention_s = max_retention_s
        self._seq = itertools.count()
        # (due on the programs' clock, tie-break, program, its paused_at when queued)
        self._due: list[tuple[float, int, Program, float]] = []
        self._moving: dict[str, Program] = {}  # programs whose prefetch moves, in start order
        self._returned: dict[str, Program] = {}  # came back: unpinned once admitted
        self._held: dict[str, int] = {}  # program key -> pages its prefetch pins (or will)

    # ---- the scheduler's hooks -------------------------------------------------------------
    def turn_ending(self, req: Req) -> None:
        """`req` finished normally (before its KV is released): what its program resends, and
        when its program, if this was its last request in flight, paused."""
        prog = req.program
        if prog is None or self.tree.disable:
            return
        ps = self.kv.page_size
        prog.kv.resume_ids = req.fill_ids[: req.kv_len // ps * ps]
        prog.kv.resume_namespace = req.cache_namespace
        if list(prog.in_flight) != [req.rid]:
            return
        now = self.programs.clock()
        prog.kv.paused_at = now
        expected = self.programs.expected_pause_s(prog)
        if self.enabled:
            self.programs.pausing(prog)
        if self.enabled and expected > 0:
            heapq.heappush(self._due, (now + DUE_FRACTION * expected, next(self._seq), prog,
                                       now))

    def arrived(self, req: Req) -> None:
        """`req` arrived (before any load for it starts): what of its prompt the pool holds,
        its program's pause, and how its prefetch turned out."""
        prog = req.program
        if prog is None:
            return
        key = req.fill_ids[: req.max_prefix_len]
        req.pool_hit_tokens = self.tree.peek_prefix(lambda: key,
                                                    namespace=req.cache_namespace).prefix_len
        kv = prog.kv
        if kv.paused_at is not None:
            pause = self.programs.clock() - kv.paused_at
            kv.pause_mean_s = pause if not kv.num_pauses else (
                kv.pause_mean_s + PROGRAM_PAUSE_EWMA * (pause - kv.pause_mean_s))
            kv.num_pauses += 1
            kv.paused_at = None
        kv.pause_prefetches = 0
        kv.pause_skipped = False
        prefetch = kv.prefetch
        if prefetch is None:
            return
        if not prefetch.done:
            self.programs.count_kv(prog, num_prefetch_late=1)
            self._stop(prog)
        elif req.pool_hit_tokens >= prefetch.limit:
            self.programs.count_kv(prog, num_prefetch_hits=1)
        else:
            self.programs.count_kv(prog, num_prefetch_wasted=1)
        kv.prefetch = None
        self._returned[prog.key] = prog

    def done(self, key: str) -> None:
        """The program table found program `key` done: what it prefetched is wasted."""
        prog = self.programs.table.get(key)
        if prog is not None:
            self._waste(prog)
            prog.kv.resume_ids = None

    def has_work(self) -> bool:
        """Whether a step has a prefetch to move or start now."""
        return bool(self._moving) or bool(self._due) and (
            self._due[0][0] <= self.programs.clock())

    def idle_wait_s(self, longest_s: float) -> float:
        """How long the idle scheduler may wait for a message before a prefetch is due."""
        if not self._due:
            return longest_s
        return min(longest_s, max(0.0, self._due[0][0] - self.programs.clock()))

    def step(self, waiting: list[Req], busy: bool) -> None:
        """Once per scheduler step: unpin what returned programs' admitted requests locked,
        start the prefetches that are due and move one (all, when nothing runs). `waiting`:
        the requests whose prompts need pages first (waiting, or prefilled in chunks)."""
        if self._returned:
            self._release_returned(waiting)
        if self._due and self._due[0][0] <= self.programs.clock():
            self._start_due(waiting)
        if self._moving and not (busy and self.kv.has_loads()):
            self._move(busy, waiting)

    # ---- prefetches ----------------------------------------------------------------------------
    def _start_due(self, waiting: list[Req]) -> None:
        """Look at the due programs, the one expected back first first."""
        now = self.programs.clock()
        self.programs.expire(now)  # at most once per EXPIRE_EVERY_S: the expected returns
        due = []
        while self._due and self._due[0][0] <= now:
            _, _, prog, paused_at = heapq.heappop(self._due)
            if prog.kv.paused_at != paused_at or self.programs.table.get(prog.key) is not prog:
                continue  # it came back, or is forgotten
            back_at = self.programs.expected_back_at(prog, now)
            due.append((now if back_at is None else back_at, next(self._seq), prog, paused_at))
        for _, _, prog, paused_at in sorted(due):
            if self.programs.state(prog, now) != "paused":
                self._waste(prog)  # its pause window is over: it is not coming back soon
                continue
            prefetch = prog.kv.prefetch
            if prefetch is not None and prefetch.done and self._resident(
                    prefetch.load) < prefetch.limit:
                self._waste(prog)  # evicted again while it pauses: a new one may start
            if prog.kv.prefetch is None and prog.kv.pause_prefetches < PREFETCHES_PER_PAUSE:
                status = self._start(prog, paused_at + self.programs.pause_window_s(prog) - now,
                                     waiting, reserve=True)
                if status == "accepted":
                    prog.kv.pause_prefetches += 1
                elif status == "skipped" and not prog.kv.pause_skipped:
                    prog.kv.pause_skipped = True
                    self.programs.count_kv(prog, num_prefetch_skipped=1)
            heapq.heappush(self._due, (now + RECHECK_S, next(self._seq), prog, paused_at))

    def _start(self, prog: Program, pin_s: float, waiting: list[Req], reserve: bool = False
               ) -> str:
        """Start `prog`'s prefetch: "accepted", "resident" (nothing in a tier to move),
        "computed" (computing it is faster than loading it: below the tier crossover),
        "deferred" (no room now), "skipped" (`reserve`: the room left after what the programs
        expected back sooner will claim is none, or its part there is below the crossover) or
        "missing" (nothing known to resume)."""
        kv = prog.kv
        if kv.resume_ids is None or self.kv.tiers is None:
            return "missing"
        key = np.asarray(kv.resume_ids, dtype=np.int32)
        peek = self.tree.peek_prefix(lambda: key, namespace=kv.resume_namespace)
        start = peek.prefix_len
        below = self.kv.tiers.pages_below(key, peek)
        if not below.num_pages:
            return "resident" if start else "missing"
        ps = self.kv.page_size
        room = self._room(waiting, prog.key)
        if room <= 0:
            return "deferred"
        match = self.tree.match_prefix(key, kv.resume_namespace)
        if not self.kv.tiers.worth_loading(below):
            return "computed"
        if reserve:
            room -= self._reserved(prog)
            if room <= 0 or (room < below.num_pages and not self.kv.tiers.worth_loading(
                    below, max_pages=room)):
                return "skipped"
        pin_s = min(max(pin_s, PIN_MIN_S), self.max_retention_s)
        # pages the host tier no longer holds are read from disk first, off this thread
        load = PrefixLoad(key, kv.resume_namespace, self.kv.tiers.start_disk_load(key, match),
                          start)
        kv.prefetch = Prefetch(load, start, start + min(below.num_pages, room) * ps,
                               self.tree.clock() + pin_s)
        self._held[prog.key] = min(below.num_pages, room)
        self._moving[prog.key] = prog
        self.programs.count_kv(prog, num_prefetches=1)
        return "accepted"

    def _room(self, waiting: list[Req], key: str) -> int:
        """Pages program `key`'s prefetch may take now: free or evictable, less what `waiting`
        needs and what other programs' prefetches pin (prefetches never evict each other)."""
        ps = self.kv.page_size
        others = sum(pages for k, pages in self._held.items() if k != key)
        return (self.kv.available_pages() - others
                - sum(-(-len(r.fill_ids) // ps) for r in waiting))

    def _reserved(self, prog: Program) -> int:
        """Pages the programs expected back before `prog` will claim in the pool first (their
        working sets; what their own prefetches pin `_room` counted already), as the last sweep
        saw them."""
        seen_at = self.programs.returns_at
        back_at = self.programs.expected_back_at(prog, seen_at)
        if back_at is None:
            return 0
        tokens = self.programs.claims_before(back_at)
        for key, pages in self._held.items():
            other = self.programs.table.get(key)
            other_back_at = None if other is None else self.programs.expected_back_at(
                other, seen_at)
            if key != prog.key and other_back_at is not None and other_back_at < back_at:
                tokens -= min(pages * self.kv.page_size, self.programs.return_claim_tokens(other))
        return -(-max(tokens, 0) // self.kv.page_size)

    def _move(self, busy: bool, waiting: list[Req]) -> None:
        """Move the first moving prefetch on: a step's part while requests run, else all;
        nothing while the pool has no room for it."""
        key, prog = next(iter(self._moving.items()))
        if self._room(waiting, key) <= 0:
            if not busy:  # nothing will free room: it ends where it is
                self._finish(prog)
            return
        prefetch = prog.kv.prefetch
        load = prefetch.load
        if load.disk is not None:
            if not busy:  # nothing else to do: wait a moment for the read, do not spin
                self.kv.tiers.wait_disk_loads([load.disk], IDLE_LOAD_WAIT_S)
            if self.kv.tiers.advance_disk_load(load.disk):
                load.disk = None
            return
        before = self._resident(load)
        more = True
        while more:
            more = self.kv.load_step(load) and load.disk is None
            after = self._resident(load)
            if after >= prefetch.limit:
                more = False
            if busy:
                break
        if after > before:
            self.programs.count_kv(prog, prefetched_tokens=after - before)
            node = self.tree.match_prefix(load.key[:after], load.namespace).last_node
            self.tree.pin(node, prefetch_owner(key), prefetch.pin_until)
        if not more and load.disk is None:
            self._finish(prog)

    def _finish(self, prog: Program) -> None:
        """`prog`'s prefetch is over: what it aims for is what it moved (nothing: wasted)."""
        prefetch = prog.kv.prefetch
        self._stop(prog)
        prefetch.done = True
        prefetch.limit = min(prefetch.limit, self._resident(prefetch.load))
        if prefetch.limit <= prefetch.start:
            self._waste(prog)
        else:
            self._held[prog.key] = (prefetch.limit - prefetch.start) // self.kv.page_size

    def _resident(self, load: PrefixLoad) -> int:
        return self.tree.peek_prefix(lambda: load.key, namespace=load.namespace).prefix_len

    def _stop(self, prog: Program) -> None:
        """Stop `prog`'s prefetch where it is (what moved stays, pinned)."""
        prefetch = prog.kv.prefetch
        if prefetch is not None and prefetch.load.disk is not None:
            self.kv.tiers.cancel_disk_load(prefetch.load.disk)
            prefetch.load.disk = None
        self._moving.pop(prog.key, None)

    def _waste(self, prog: Program) -> None:
        """`prog` did not come back in time: its prefetch, if any, is wasted and unpinned."""
        if prog.kv.prefetch is None:
            return
        self._stop(prog)
        prog.kv.prefetch = None
        self.programs.count_kv(prog, num_prefetch_wasted=1)
        self._unpin(prog.key)

    def _unpin(self, key: str) -> None:
        self.tree.unpin(prefetch_owner(key))
        self._held.pop(key, None)

    def _release_returned(self, waiting: list[Req]) -> None:
        still_waiting = {id(r.program) for r in waiting if r.program is not None}
        for key, prog in list(self._returned.items()):
            if id(prog) not in still_waiting:
                del self._returned[key]
                if prog.kv.prefetch is None:
                    self._unpin(key)

    def clear(self) -> None:
        """Forget every prefetch (`/flush_cache`: the tree and the tiers are empty)."""
        for prog in list(self._moving.values()):
            self._stop(prog)
        self._due.clear()
        self._moving.clear()
        self._returned.clear()
        self._held.clear()

    # ---- client hints ----------------------------------------------------------------------------
    def hint(self, key: str, action_type: str, ttl_s: float | None,
             waiting: list[Req]) -> dict[str, Any]:
        """Apply one hint action to program `key`: {"status", "detail"?}. Status: accepted,
        clipped (ttl cut to --max-retention-s), deferred (no room now), or missing (no such
        program, or nothing of it is cached)."""
        prog = self.programs.table.get(key)
        if action_type == "release":
            self.kv.retention.release_hint(key)
            self.tree.unpin(retain_owner(key))
            if prog is not None:
                self._stop(prog)
                prog.kv.prefetch = None
            self._unpin(key)
            return {"status": "accepted"}
        if prog is None or prog.kv.resume_ids is None:
            return {"status": "missing", "detail": "no finished request of this program is known"}
        clipped = ttl_s is not None and ttl_s > self.max_retention_s
        if ttl_s is not None:
            ttl_s = min(ttl_s, self.max_retention_s)
        if action_type == "retain":
            key_ids = prog.kv.resume_ids
            node = self.tree.match_prefix(key_ids, prog.kv.resume_namespace).last_node
            if node.is_root:
                return {"status": "missing", "detail": "none of its prefix is in the pool"}
            self.tree.pin(node, retain_owner(key), self.tree.clock() + (ttl_s or PIN_MIN_S))
            return {"status": "clipped" if clipped else "accepted"}
        if prog.kv.prefetch is not None:
            return {"status": "clipped" if clipped else "accepted",
                    "detail": "a prefetch is already under way or done"}
        if self.kv.tiers is None:
            return {"status": "missing", "detail": "the server has no KV cache tiers"}
        pin_s = ttl_s if ttl_s is not None else self.programs.pause_window_s(prog)
        status = self._start(prog, pin_s, waiting)
        if status == "resident":
            return {"status": "accepted", "detail": "its prefix is in the pool"}
        if status == "computed":
            return {"status": "accepted", "detail": "computing its prefix is faster than "
                    "loading it (below the tier crossover): nothing to prefetch"}
        if status == "accepted" and clipped:
            return {"status": "clipped"}
        return {"status": status}

