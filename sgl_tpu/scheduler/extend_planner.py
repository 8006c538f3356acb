"""Which requests the next EXTEND step runs, and how many tokens of each (host side, no JAX).

Within the token budget (`chunked_prefill_size`) and `max_extend_seqs`, in this order (after a
chunk of a prompt that has more, the scheduler runs a DECODE step first if any request runs):

    1. the chunked prompt's next chunk      a prompt longer than the budget runs in pieces
    2. jump-forward re-admissions           running requests whose forced tokens need an EXTEND
    3. waiting requests, in policy order    prefix matched and locked, then pages allocated
                                            (not while their prefix is read from disk)

Admission control (programs.py, with `--schedule-policy program`) first holds back new
programs' first turns while the admitted programs' KV working sets fill the pool and host tier.
With it, a program is admitted to at most its share of the rows, `max_running_requests` over
the programs with requests in the server (a request of no program counts as one) or expected
back from a tool pause: one key's parallel requests cannot fill the decode batch, and so every
step, that other agents' turns run in, nor take the rows of agents busy in their tools
(`_row_share`).
A chunked prompt that cannot get its pages admits nothing new (it is not starved). A waiting
request is admitted only with a page per running request kept in reserve, so admission does
not starve decode, and not when it shares a long uncached prefix with a request already in
the batch: it waits a step and then reuses that request's KV from the tree
(`policy.InBatchPrefixes`).

With priority scheduling (`priority.py`) the policy's order is sorted by priority level, and a
request that finds no free row or too few pages (a new one, or the chunked prompt's next chunk)
may retract lower-priority running requests (`_preempt`); the first waiting request that still
does not fit ends the admissions, as without it.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.scheduler.counters import SchedulerStats
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.policy import InBatchPrefixes, order_waiting
from sgl_tpu.scheduler.priority import Priorities, pages_freed
from sgl_tpu.scheduler.programs import Programs
from sgl_tpu.scheduler.queues import ReqQueues
from sgl_tpu.scheduler.req import Req

ExtendBatch = list[tuple[Req, int]]  # (request, number of its tokens to run)


class ExtendPlanner:
    def __init__(self, config: SchedulerConfig, kv: KVManager, queues: ReqQueues,
                 stats: SchedulerStats, retract: Callable[[Req], None],
                 priorities: Priorities | None = None, programs: Programs | None = None
                 ) -> None:
        self.config = config
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.retract = retract
        self.priorities = priorities  # None: priority scheduling off
        self.can_preempt = priorities is not None and priorities.preemption
        self.programs = programs  # admission control (None: none)

    def next_batch(self) -> ExtendBatch:
        """Pick the next EXTEND batch; admitted requests leave their queues and hold pages."""
        batch: ExtendBatch = []
        q = self.queues
        self.kv.poll_loads(q.waiting, busy=bool(q.running or q.jump_forward_reqs)
                           or q.chunked_req is not None)
        budget = self.config.chunked_prefill_size
        budget, chunk_blocked = self._continue_chunk(batch, budget)
        budget = self._readmit_jump_forward(batch, budget)
        if not chunk_blocked:  # a chunked prompt waiting for pages: admit nothing new
            self._admit_waiting(batch, budget)
        return batch

    def _continue_chunk(self, batch: ExtendBatch, budget: int) -> tuple[int, bool]:
        req = self.queues.chunked_req
        if req is None:
            return budget, False
        n = min(len(req.fill_ids) - req.kv_len, budget)
        need = self.kv.pages_needed(req, req.kv_len + n)
        if not self.kv.alloc_pages(req, need) and not (
                self.can_preempt and self._preempt(req, self._held(batch), need)
                and self.kv.alloc_pages(req, need)):
            return budget, True
        batch.append((req, n))
        self.queues.chunked_req = None
        return budget - n, False

    def _readmit_jump_forward(self, batch: ExtendBatch, budget: int) -> int:
        q = self.queues
        while q.jump_forward_reqs and budget > 0 and len(batch) < self.config.max_extend_seqs:
            req = q.jump_forward_reqs[0]
            n = len(req.fill_ids) - req.kv_len
            if n > budget or not self.kv.alloc_pages(req, self.kv.pages_needed(req,
                                                                                req.kv_len + n)):
                if not q.running and not batch:
                    # Nothing else runs, so nothing will free pages: give this one's KV back.
                    self.retract(q.jump_forward_reqs.pop(0))
                    continue
                break
            q.jump_forward_reqs.pop(0)
            batch.append((req, n))
            budget -= n
        return budget

    def _admit_waiting(self, batch: ExtendBatch, budget: int) -> None:
        cfg, q = self.config, self.queues
        ready = [r for r in q.waiting if (r.grammar_future is None or r.matcher is not None)
                 and not self.kv.loading(r)]
        if self.programs is not None and ready:
            ready = self.programs.admissible(ready)
        preempt = self.can_preempt
        if not ready or budget <= 0 or len(batch) >= cfg.max_extend_seqs \
                or (self._held(batch) >= cfg.max_running_requests and not preempt):
            return  # nothing can be admitted: do not order the queue
        in_batch = InBatchPrefixes(self.kv.page_size)
        order = order_waiting(cfg.schedule_policy, ready, self.kv.tree)
        if self.priorities is not None:
            order = self.priorities.order(order)
        rows_of, share = self._row_share(ready, batch)
        for req in order:
            held = self._held(batch)
            rows_short = held >= cfg.max_running_requests
            if len(batch) >= cfg.max_extend_seqs or budget <= 0 or (rows_short and not preempt):
                break
            if req.program is not None and rows_of.get(id(req.program), 0) >= share:
                continue  # its program has its share while others wait
            self.kv.admit_prefix(req)
            if not self.kv.tree.disable and in_batch.shares_uncached(req):
                self.kv.release_req(req)
                continue
            n = min(len(req.fill_ids) - req.kv_len, budget)
            # Keep a page per running request in reserve so admission does not starve decode.
            need = self.kv.pages_needed(req, req.kv_len + n)
            if (rows_short or need + held > self.kv.available_pages()) \
                    and not (preempt and self._preempt(req, held, need)):
                self.kv.release_req(req)
                break
            if not self.kv.alloc_pages(req, need):
                self.kv.release_req(req)
                break
            q.waiting.remove(req)
            q.take_row(req)
            if req.num_retractions == 0:
                req.cached_tokens = req.kv_len
                self.stats.prompt_tokens += req.prompt_len
                self.stats.cached_tokens += req.kv_len
                if self.programs is not None:
                    self.programs.count_cached(req)
            batch.append((req, n))
            in_batch.add(req)
            budget -= n
            if req.program is not None:
                rows_of[id(req.program)] = rows_of.get(id(req.program), 0) + 1

    def _row_share(self, ready: list[Req], batch: ExtendBatch) -> tuple[dict[int, int], int]:
        """Rows each program holds (running, re-extending, in this batch; by id), and a
        program's share of max_running_requests among the programs with requests holding rows
        or ready and, with admission control, the paused ones expected back from their tools
        (`Programs.expected_back`: their rows stay free for their next turns); the whole batch
        for one, and outside `--schedule-policy program`."""
        q, rows = self.queues, self.config.max_running_requests
        held = [*q.running, *q.jump_forward_reqs, *(req for req, _ in batch)]
        rows_of: dict[int, int] = {}
        for req in held:
            if req.program is not None:
                rows_of[id(req.program)] = rows_of.get(id(req.program), 0) + 1
        if self.config.schedule_policy != "program":
            return rows_of, rows
        present = {id(r.program) if r.program is not None else id(r) for r in [*ready, *held]}
        back = 0.0 if self.programs is None else self.programs.expected_back
        return rows_of, max(1, int(rows / (len(present) + back)))

    def _held(self, batch: ExtendBatch) -> int:
        """Rows held: running, waiting to re-extend, admitted to this batch."""
        q = self.queues
        return len(q.running) + len(q.jump_forward_reqs) + len(batch)

    def _preempt(self, req: Req, held: int, need: int) -> bool:
        """Retract the fewest lower-priority running requests that give `req` a row and `need`
        pages (with the reserve); retract none and return False if all of them would not."""
        ps, tree = self.kv.page_size, self.kv.tree
        available = self.kv.available_pages()
        victims: list[Req] = []
        for victim in self.priorities.preemptible(req, self.queues.running):
            victims.append(victim)
            left = held - len(victims)
            if left < self.config.max_running_requests \
                    and need + left <= available + pages_freed(victims, tree, ps):
                break
        else:
            return False
        for victim in victims:
            self.queues.running.remove(victim)
            self.retract(victim)
        self.stats.num_priority_preemptions += len(victims)
        return True
