"""Room in the KV pool for the next DECODE step (host side, no JAX).

* `make_room`: every running request gets a page for its next token where its last page is
  full. When pages are short (after evicting the tree's unlocked leaves, `KVManager`),
  requests are retracted: first those waiting to re-extend after a jump forward (they hold KV
  but do not decode), then the running request with the least progress (with
  `--retraction-policy priority`, the lowest priority first: `priority.py`).
* `retract`: a request gives its KV to the tree (so its recompute is mostly a cache hit) and
  its row back, and re-queues at the front of the waiting queue.
* `fit_drafts`: a speculative draft is cut to the pages its request holds unless free pages
  cover it with a page per running request left over: a draft never evicts cached KV nor
  makes the next step retract.
"""

from __future__ import annotations

import logging

from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.counters import SchedulerStats
from sgl_tpu.scheduler.grammar_steps import drop_draft
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.priority import Priorities, length_key
from sgl_tpu.scheduler.queues import ReqQueues
from sgl_tpu.scheduler.req import Req

logger = logging.getLogger("sgl_tpu.scheduler.scheduler")


class DecodeMemory:
    def __init__(self, kv: KVManager, queues: ReqQueues, stats: SchedulerStats,
                 priorities: Priorities | None = None) -> None:
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.priorities = priorities  # None: priority scheduling off

    def make_room(self) -> Req | None:
        """Give every running request room for one more token, retracting requests while
        memory is short. Returns a request it had to end for lack of memory (finish reason
        set, out of the queues, still holding its KV), or None."""
        q, kv = self.queues, self.kv
        while True:
            needy = [r for r in q.running if kv.pages_needed(r, r.kv_len + 1)]
            if len(needy) <= kv.available_pages():
                for r in needy:
                    if not kv.alloc_pages(r, 1):
                        raise RuntimeError("page allocation failed despite available pages")
                return None
            if q.jump_forward_reqs:
                self.retract(q.jump_forward_reqs.pop())
                continue
            if len(q.running) == 1:
                # Cannot happen for validated requests (they fit the pool alone, and nothing
                # else holds KV now), but never spin, and never leave the client waiting.
                req = q.running.pop()
                req.finish_reason = finish.abort("out of KV cache memory")
                return req
            victim = (min(q.running, key=length_key) if self.priorities is None
                      else self.priorities.retraction_victim(q.running))
            q.running.remove(victim)
            self.retract(victim)

    def retract(self, req: Req) -> None:
        """Free `req`'s KV (the tree keeps what it can) and row; re-queue it first."""
        drop_draft(req)
        req.jumped = False
        self.kv.release_req(req)
        self.queues.free_row(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.queues.waiting.insert(0, req)
        logger.info("retracted %s (%d output tokens) to free KV memory", req.rid,
                    len(req.output_ids))

    def fit_drafts(self, drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """Allocate pages for the running requests' drafts (by id(req)) where that is safe;
        cut the other drafts to the pages their requests hold."""
        running, ps, alloc = self.queues.running, self.kv.page_size, self.kv.allocator
        for req in running:
            draft = drafts.get(id(req))
            if not draft:
                continue
            need = self.kv.pages_needed(req, req.kv_len + 1 + len(draft))
            if need and (need + len(running) > alloc.num_free_pages
                         or not self.kv.alloc_pages(req, need)):
                drafts[id(req)] = draft[: max(0, len(req.pages) * ps - req.kv_len - 1)]
        return drafts
