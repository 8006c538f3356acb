"""Priority scheduling (`--enable-priority-scheduling`: SGLang's flags and meaning of the value).

A request's `priority` is an integer; a higher value is more urgent (with
`--schedule-low-priority-values-first`, a lower one). Intake stores it on the `Req` one way
round, higher = more urgent (`req_priority`), so this module and the `priority` eviction policy
(which evicts low priorities first) read it alike. Without the flag only `req_priority` runs,
and it keeps the client's value (0 when none), which then orders eviction only.

* Admission order (extend_planner.py). The schedule policy orders the waiting queue (lpm, fcfs,
  dfs-weight), then a stable sort puts higher levels first: requests of one level keep the
  policy's order. SGLang allows only fcfs and lof with priorities; here every policy composes.
* Aging. A request's level is its priority plus `priority_aging_rate` levels per second since it
  arrived, rounded down. One G levels below a steady stream of newer requests is admitted ahead
  of them after G / rate seconds: delayed, never starved. The default, 0.1 (a level per 10 s),
  sets SGLang's preemption threshold of 10 levels against 100 s of waiting: two classes that
  far apart keep their order for up to 100 s of overload (interactive turns take seconds,
  batch jobs minutes), after which the one waiting longer goes first. Aging also shields a
  long-running request from preemption by newer ones.
* Preemption. A waiting request that finds no free row, or too few pages, may retract running
  requests whose priority and level are both more than
  `priority_scheduling_preemption_threshold` below its own (aging alone never lets a lower
  priority retract a higher one): lowest level first, newest first within a level, only as
  many as free what it needs, and none if all of them would not. Retraction is
  decode_memory.py's: the KV goes to the radix tree, the request re-queues and later resumes
  from its cached prefix, so nothing is lost.
* `--retraction-policy priority`: when decode runs out of pages, the lowest level is retracted
  first (then SGLang's `length` order, the least progress).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.mem_cache.tree_node import TreeNode
from sgl_tpu.scheduler.req import Req


def req_priority(priority: int | None, config: SchedulerConfig) -> int:
    """A request's `priority` field as the scheduler keeps it: higher = more urgent."""
    if not config.enable_priority_scheduling:
        return priority or 0
    if priority is None:
        priority = config.default_priority_value or 0
    return -priority if config.schedule_low_priority_values_first else priority


def length_key(req: Req) -> tuple[int, int]:
    """SGLang's `length` retraction order: the least output first, the longest prompt first."""
    return len(req.output_ids), -req.prompt_len


class Priorities:
    def __init__(self, threshold: int, aging_rate: float, preemption: bool,
                 retract_by_priority: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.aging_rate = aging_rate
        self.preemption = preemption
        self.retract_by_priority = retract_by_priority
        self.clock = clock  # the clock of `Req.arrival_s`

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Priorities | None:
        """None without --enable-priority-scheduling."""
        if not config.enable_priority_scheduling:
            return None
        return cls(config.priority_scheduling_preemption_threshold, config.priority_aging_rate,
                   not config.disable_priority_preemption,
                   config.retraction_policy == "priority")

    def level(self, req: Req, now: float) -> int:
        return req.priority + math.floor(self.aging_rate * max(0.0, now - req.arrival_s))

    def order(self, reqs: list[Req]) -> list[Req]:
        """`reqs` (in the schedule policy's order) by level, highest first; stable."""
        now = self.clock()
        return sorted(reqs, key=lambda r: -self.level(r, now))

    def preemptible(self, req: Req, running: list[Req]) -> list[Req]:
        """The running requests `req` may retract, in the order to retract them."""
        if not self.preemption:
            return []
        now, gap = self.clock(), self.threshold
        top = self.level(req, now)
        out = [r for r in running
               if req.priority - r.priority > gap and top - self.level(r, now) > gap]
        return sorted(out, key=lambda r: (self.level(r, now), -r.arrival_s))

    def retraction_victim(self, running: list[Req]) -> Req:
        """The running request a short KV pool retracts first."""
        if not self.retract_by_priority:
            return min(running, key=length_key)
        now = self.clock()
        return min(running, key=lambda r: (self.level(r, now), *length_key(r)))


def pages_freed(reqs: list[Req], tree: RadixCache, page_size: int) -> int:
    """Pages that retracting all of `reqs` makes free or evictable: the pages each owns, and
    the tree pages that only they lock."""
    total, locks = 0, {}
    for req in reqs:
        total += len(req.pages) - req.tree_len // page_size
        node = req.last_node
        while node is not None and not node.is_root:
            locks[node] = locks.get(node, 0) + 1
            node = node.parent
    unlocked: list[TreeNode] = [n for n, k in locks.items() if n.lock_ref == k]
    return total + sum(len(n.key) for n in unlocked) // page_size
