"""The scheduler loop: continuous batching over a radix-cached, paged KV pool (host side, no JAX).

Each `step()` is: take aborts, build one batch, run it, post-process.

    waiting ──(policy order, prefix match + lock, page alloc, token budget)──► EXTEND batch
    running ──(one page more where a page fills; retract on shortage)────────► DECODE batch

* EXTEND runs new requests' uncached tokens (a long prompt in chunks of the token budget); after
  it every unfinished request's KV is inserted into the radix tree, so requests arriving later
  (forks, `n > 1`, the next agent turn) reuse it while it is still running.
* DECODE runs one token for every running request. When pages run out, the tree's unlocked
  leaves are evicted first; if that is not enough the request with the least progress is
  retracted: its KV goes to the tree (so the recompute is mostly a cache hit), it re-queues.
* Finished requests give their KV to the tree and unlock it; nothing else holds pages. A
  request with a `session_id` (one turn of an agent loop) also retains it for
  `session_retention_s`: under memory pressure it is evicted after all unretained KV, since the
  agent's next turn resends it (`KVManager`, `mem_cache/eviction.py`).

With overlap scheduling (`SchedulerConfig.overlap_schedule`, scheduler/overlap.py) a DECODE
step is dispatched before the previous one's tokens reach the host, and the host processes
step t while the device runs step t+1; a step that needs host data first drains the one in
flight and runs the serial way.

The scheduler owns a `KVManager` (allocator + tree) and drives a `ModelRunner` through the
numpy-only step contract of `executor/step.py` (`forward(mode, steps) -> StepResult`,
`token_logprobs`, `row_logits`); the in-process `Engine` and the scheduler process both drive
it the same way. This class only schedules; the rest of a step's host work lives beside it:

    intake.py         message -> Req (re-validated), or a 400 output
    policy.py         waiting-queue order; in-batch prefix sharing
    grammar_steps.py  masks, matcher advance, jump-forward and draft verification
    speculative.py    speculative decoding: drafts (ngram.py) verified in the DECODE step
    overlap.py        which DECODE steps may overlap the previous one; the step in flight
    finish.py         stop conditions and finish reasons (wire format)
    output.py         ReqOutput assembly, token log-prob entries
    logprobs.py       prompt log-probs of an EXTEND step
    faults.py         what an exception while handling one request means
    stats.py          counters, the periodic log line, the memory report
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.constrained.grammar_manager import GrammarManager
from sgl_tpu.executor.step import DoneStep, ForwardMode, ModelRunner, StepResult
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.messages import ReqOutput, TokenizedGenerateReq
from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.faults import fault_reason
from sgl_tpu.scheduler.grammar_steps import (
    GrammarSteps,
    drop_draft,
    grammar_ready,
    verify_draft,
)
from sgl_tpu.scheduler.intake import Intake
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.logprobs import collect_input_logprobs
from sgl_tpu.scheduler.output import error_output, make_output, token_logprobs
from sgl_tpu.scheduler.overlap import PendingDecode, finishes_in_flight, overlappable
from sgl_tpu.scheduler.policy import InBatchPrefixes, order_waiting
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.speculative import Speculator, accept, verify_steps
from sgl_tpu.scheduler.stats import SchedulerStats, memory_info

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        runner: ModelRunner,
        *,
        num_pages: int,
        decode: Callable[[Sequence[int], bool], str],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        grammar: GrammarManager | None = None,
        disable_jump_forward: bool = False,
    ) -> None:
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        allocator = PageAllocator(num_pages, config.page_size)
        self.kv = KVManager(allocator, RadixCache(allocator, disable=config.disable_radix_cache),
                            session_retention_s=config.session_retention_s)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # a prompt being prefilled in chunks
        self.jump_forward_reqs: list[Req] = []  # running requests with forced tokens to extend
        self.free_rows = list(range(config.max_running_requests, 0, -1))
        self.stats = SchedulerStats()
        self._aborts: set[str] = set()
        self.grammar = grammar
        self.intake = Intake(config, vocab_size=vocab_size,
                             capacity_tokens=self.kv.capacity_tokens, grammar=grammar,
                             decode=decode)
        self.grammar_steps = GrammarSteps(vocab_size, self.eos_token_ids, disable_jump_forward)
        self._step_reqs: list[Req] = []  # the batch of the step in progress (for fail_all)
        self.speculator = None if config.speculative_algorithm is None else Speculator(
            config.speculative_algorithm, config.speculative_num_draft_tokens,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
            max_rows=config.max_running_requests, max_batch=config.speculative_max_batch)
        # A DECODE step in flight whose results are not processed yet (overlap scheduling).
        self._pending: PendingDecode | None = None
        self.overlap = (config.overlap_schedule and self.speculator is None
                        and hasattr(runner, "dispatch"))

    # ---- intake ----------------------------------------------------------------------------
    @property
    def grammar_supported(self) -> bool:
        return self.grammar is not None

    def add_request(self, msg: TokenizedGenerateReq) -> ReqOutput | None:
        """Queue a request; returns an immediate error output if it cannot be served."""
        req = self.intake.new_req(msg)
        if isinstance(req, ReqOutput):
            return req
        self.kv.retain_prefix(req)
        self.waiting.append(req)
        return None

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def _queued(self) -> Iterator[tuple[list[Req] | None, Req]]:
        """Every request the scheduler holds, with the queue it sits in (None: the chunked
        prompt between its chunks)."""
        for queue in (self.waiting, self.running, self.jump_forward_reqs):
            for req in list(queue):
                yield queue, req
        if self.chunked_req is not None:
            yield None, self.chunked_req

    def _dequeue(self, queue: list[Req] | None, req: Req) -> None:
        if queue is None:
            self.chunked_req = None
        else:
            queue.remove(req)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished: decoding, waiting to re-extend after a jump
        forward, or a prompt between its prefill chunks (all hold KV pages)."""
        return (len(self.running) + len(self.jump_forward_reqs)
                + (self.chunked_req is not None))

    @property
    def has_work(self) -> bool:
        return (bool(self._aborts) or self._pending is not None
                or next(self._queued(), None) is not None)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one batch; return the outputs it produced (possibly none).

        An exception in one request's host code ends that request (`fail`); one outside any
        request's code propagates, and the caller decides (`fail_all` or die, `faults.py`)."""
        outputs = []
        if self._pending is not None and not self._can_overlap():
            outputs += self._drain()  # the serial way from here
        outputs += self._process_aborts() + self._poll_grammars()
        if self._pending is not None:
            # Overlap: step t+1 goes to the device first, then the host processes step t.
            in_flight = self._pending
            self._pending = self._dispatch_lagged_decode(in_flight)
            outputs += self._process_decode(in_flight)
            if not self.running:  # what is in flight now has only finished requests' rows
                outputs += self._drain()
        else:
            batch = self._schedule_extend()
            if batch:
                outputs += self._run_extend(batch)
            elif self.running:
                outputs += self._run_decode()
        self._step_reqs = []
        self.stats.maybe_log(self.num_running, len(self.waiting),
                             self.kv.allocator.num_free_pages)
        return outputs

    # ---- faults (see faults.py) ------------------------------------------------------------
    def fail(self, req: Req, exc: BaseException) -> ReqOutput:
        """End `req` alone after `exc` was raised while handling it; its KV is discarded."""
        for queue, queued in self._queued():
            if queued is req:
                self._dequeue(queue, req)
        req.draft, req.draft_masks = [], []
        self.kv.discard_req(req)
        self._free_row(req)
        req.finish_reason = fault_reason(req.rid, exc)
        self.stats.num_requests_failed += 1
        return make_output(req, [])

    def fail_all(self, exc: BaseException) -> list[ReqOutput]:
        """After a fault outside any one request's code (e.g. the device step): end every
        request that is queued, running or in the failed step."""
        reqs = {id(r): r for r in [*self._step_reqs, *(r for _, r in self._queued())]
                if not r.finished}
        self._step_reqs = []
        self._pending = None  # its results are not trusted either
        return [self.fail(r, exc) for r in reqs.values()]

    # ---- EXTEND ----------------------------------------------------------------------------
    def _schedule_extend(self) -> list[tuple[Req, int]]:
        """Pick (request, number of tokens to run) pairs within the token budget: the chunked
        prompt's next chunk, then jump-forward re-admissions, then waiting requests."""
        batch: list[tuple[Req, int]] = []
        budget = self.config.chunked_prefill_size
        budget, chunk_blocked = self._continue_chunk(batch, budget)
        budget = self._readmit_jump_forward(batch, budget)
        if not chunk_blocked:  # a chunked prompt waiting for pages: admit nothing new
            self._admit_waiting(batch, budget)
        return batch

    def _continue_chunk(self, batch: list[tuple[Req, int]], budget: int) -> tuple[int, bool]:
        req = self.chunked_req
        if req is None:
            return budget, False
        n = min(len(req.fill_ids) - req.kv_len, budget)
        if not self.kv.alloc_pages(req, self.kv.pages_needed(req, req.kv_len + n)):
            return budget, True
        batch.append((req, n))
        self.chunked_req = None
        return budget - n, False

    def _readmit_jump_forward(self, batch: list[tuple[Req, int]], budget: int) -> int:
        while (self.jump_forward_reqs and budget > 0
               and len(batch) < self.config.max_extend_seqs):
            req = self.jump_forward_reqs[0]
            n = len(req.fill_ids) - req.kv_len
            if n > budget or not self.kv.alloc_pages(req, self.kv.pages_needed(req,
                                                                                req.kv_len + n)):
                if not self.running and not batch:
                    # Nothing else runs, so nothing will free pages: give this one's KV back.
                    self._retract(self.jump_forward_reqs.pop(0))
                    continue
                break
            self.jump_forward_reqs.pop(0)
            batch.append((req, n))
            budget -= n
        return budget

    def _admit_waiting(self, batch: list[tuple[Req, int]], budget: int) -> None:
        cfg = self.config
        ready = [r for r in self.waiting if r.grammar_future is None or r.matcher is not None]
        held = len(self.running) + len(self.jump_forward_reqs) + len(batch)
        if not ready or budget <= 0 or len(batch) >= cfg.max_extend_seqs \
                or held >= cfg.max_running_requests:
            return  # nothing can be admitted: do not order the queue
        in_batch = InBatchPrefixes(self.kv.page_size)
        for req in order_waiting(cfg.schedule_policy, ready, self.kv.tree):
            held = len(self.running) + len(self.jump_forward_reqs) + len(batch)
            if len(batch) >= cfg.max_extend_seqs or budget <= 0 \
                    or held >= cfg.max_running_requests:
                break
            self.kv.admit_prefix(req)
            if not self.kv.tree.disable and in_batch.shares_uncached(req):
                self.kv.release_req(req)
                continue
            n = min(len(req.fill_ids) - req.kv_len, budget)
            # Keep a page per running request in reserve so admission does not starve decode.
            need = self.kv.pages_needed(req, req.kv_len + n)
            if need + held > self.kv.available_pages() or not self.kv.alloc_pages(req, need):
                self.kv.release_req(req)
                break
            self.waiting.remove(req)
            req.row = self.free_rows.pop()
            req.counts_fresh = True
            if req.num_retractions == 0:
                req.cached_tokens = req.kv_len
                self.stats.prompt_tokens += req.prompt_len
                self.stats.cached_tokens += req.kv_len
            batch.append((req, n))
            in_batch.add(req)
            budget -= n

    def _run_extend(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        self._step_reqs = [req for req, _ in batch]
        steps, kept, outputs = [], [], []
        for req, n in batch:
            completes = req.kv_len + n == len(req.fill_ids)
            try:
                mask = self.grammar_steps.step_mask(req) if completes else None
            except Exception as e:
                outputs.append(self.fail(req, e))
                continue
            kept.append((req, n))
            steps.append(req.extend_step(n, mask))
        if not kept:
            return outputs
        started = time.perf_counter()
        result = self.runner.forward(ForwardMode.EXTEND, steps)
        self.stats.count_extend(sum(n for _, n in kept), time.perf_counter() - started)
        if any(req.wants_input_logprobs for req, _ in kept):
            collect_input_logprobs(kept, result, self.runner)
        draft_logits = self.grammar_steps.draft_logits(kept, result, self.runner)
        for i, (req, n) in enumerate(kept):
            req.counts_fresh = False
            req.kv_len += n
            try:
                out = self._post_extend(req, result, i, draft_logits.get(req.rid))
            except Exception as e:
                out = self.fail(req, e)
            if out is not None:
                outputs.append(out)
        self._take_jump_forward([req for req, _ in kept])
        return outputs

    def _post_extend(self, req: Req, result: StepResult, i: int,
                     draft_logits: np.ndarray | None) -> ReqOutput | None:
        if req.kv_len < len(req.fill_ids):  # more chunks to go
            self.kv.cache_req(req)
            self.chunked_req = req
            return None
        if req.sampling.max_new_tokens == 0:  # prefill only
            req.finish_reason = finish.length(0)
            return self._finish(req, [])
        out = self._append_token(req, result, i, draft_logits)
        if not req.finished:
            self.kv.cache_req(req)
            if not req.jumped:
                self.running.append(req)
        return out

    # ---- DECODE ----------------------------------------------------------------------------
    def _run_decode(self) -> list[ReqOutput]:
        outputs = self._ensure_decode_pages()
        if not self.running:
            return outputs
        drafts = self._drafts()
        self._step_reqs = reqs = []
        batch, steps = [], []  # batch: (req, draft, its first row)
        for req in list(self.running):
            draft = drafts.get(id(req), [])
            try:
                if draft:
                    draft, masks = self.speculator.masks(req, draft, self.grammar_steps.step_mask)
                req_steps = verify_steps(req, draft, masks) if draft else [
                    req.decode_step(self.grammar_steps.step_mask(req))]
            except Exception as e:
                outputs.append(self.fail(req, e))
                continue
            reqs.append(req)
            batch.append((req, draft, len(steps)))
            steps += req_steps
        if not batch:
            return outputs
        if self.overlap and all(overlappable(req) for req in reqs):
            self._pending = PendingDecode(batch, self.runner.dispatch(ForwardMode.DECODE, steps))
            return outputs  # processed in the next step(), while the device runs the one after
        started = time.perf_counter()
        return outputs + self._process_decode(PendingDecode(
            batch, DoneStep(self.runner.forward(ForwardMode.DECODE, steps)), started))

    def _process_decode(self, decode: PendingDecode) -> list[ReqOutput]:
        """Wait for `decode`'s tokens and append them; rows of requests that ended while it
        was in flight (overlap: one step late) are discarded."""
        result = decode.step.result()
        self.stats.count_decode(time.perf_counter() - decode.dispatched_at)
        outputs = []
        for req, draft, row in decode.batch:
            if req.finished:
                continue
            try:
                if draft:
                    outputs.append(self._append_verified(req, result, row, draft))
                else:
                    req.kv_len += 1
                    outputs.append(self._append_token(req, result, row))
            except Exception as e:
                outputs.append(self.fail(req, e))
        self._take_jump_forward(decode.reqs)
        self.running = [r for r in self.running if not r.finished and not r.jumped]
        return outputs

    # ---- overlap (scheduler/overlap.py) ------------------------------------------------------
    def _can_overlap(self) -> bool:
        """Whether the next DECODE may be dispatched before the one in flight is processed:
        nothing to admit, extend or abort, no request that needs its last token on the host,
        and a page for every running request's next token without retracting any."""
        if not self.overlap or self._aborts or self.chunked_req is not None \
                or self.jump_forward_reqs:
            return False
        if any(r.grammar_future is None or r.matcher is not None for r in self.waiting):
            return False  # admissible now: the serial loop would prefill it next
        if not all(overlappable(r) for r in self.running):
            return False
        needy = sum(1 for r in self.running if not finishes_in_flight(r)
                    and self.kv.pages_needed(r, r.kv_len + 2))
        return needy <= self.kv.available_pages()

    def _dispatch_lagged_decode(self, in_flight: PendingDecode) -> PendingDecode | None:
        """Dispatch the DECODE after `in_flight` (see `_can_overlap`): each running request
        that `in_flight` does not certainly finish runs the token `in_flight` samples for it,
        read on the device."""
        rows = {id(req): row for req, _, row in in_flight.batch}
        reqs = [r for r in self.running if not finishes_in_flight(r)]
        for r in reqs:
            if not self.kv.alloc_pages(r, self.kv.pages_needed(r, r.kv_len + 2)):
                raise RuntimeError("page allocation failed despite available pages")
        if not reqs:
            return None
        self._step_reqs = reqs
        self.stats.num_overlapped_steps += 1
        # no grammar here (overlappable), but a min_new_tokens ban, one token ahead
        steps = [r.decode_step(self.grammar_steps.step_mask(r, 1), prev_row=rows[id(r)])
                 for r in reqs]
        batch = [(r, [], i) for i, r in enumerate(reqs)]
        return PendingDecode(batch, self.runner.dispatch(ForwardMode.DECODE, steps))

    def _drain(self) -> list[ReqOutput]:
        """Process the step in flight, if any."""
        in_flight, self._pending = self._pending, None
        return [] if in_flight is None else self._process_decode(in_flight)

    def _ensure_decode_pages(self) -> list[ReqOutput]:
        """Every running request gets room for one more token; when memory is short, retract
        first the requests waiting to re-extend after a jump forward (they hold KV but do not
        decode), then running ones. Returns the output of a request ended for lack of memory."""
        while True:
            needy = [r for r in self.running if self.kv.pages_needed(r, r.kv_len + 1)]
            if len(needy) <= self.kv.available_pages():
                for r in needy:
                    if not self.kv.alloc_pages(r, 1):
                        raise RuntimeError("page allocation failed despite available pages")
                return []
            if self.jump_forward_reqs:
                self._retract(self.jump_forward_reqs.pop())
                continue
            if len(self.running) == 1:
                # Cannot happen for validated requests (they fit the pool alone, and nothing
                # else holds KV now), but never spin, and never leave the client waiting.
                req = self.running.pop()
                req.finish_reason = finish.abort("out of KV cache memory")
                return [self._finish(req, [])]
            victim = min(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len))
            self.running.remove(victim)
            self._retract(victim)

    def _drafts(self) -> dict[int, list[int]]:
        """Speculative drafts (by id(req)) of the running requests, each cut to the pages it
        holds unless free pages cover it with one page per running request left over (a
        draft never evicts cached KV nor makes the next step retract)."""
        if self.speculator is None:
            return {}
        drafts = self.speculator.drafts(self.running)
        ps, alloc = self.kv.page_size, self.kv.allocator
        for req in self.running:
            draft = drafts.get(id(req))
            if not draft:
                continue
            need = self.kv.pages_needed(req, req.kv_len + 1 + len(draft))
            if need and (need + len(self.running) > alloc.num_free_pages
                         or not self.kv.alloc_pages(req, need)):
                drafts[id(req)] = draft[: max(0, len(req.pages) * ps - req.kv_len - 1)]
        return drafts

    def _retract(self, req: Req) -> None:
        drop_draft(req)
        req.jumped = False
        self.kv.release_req(req)
        self._free_row(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.insert(0, req)
        logger.info("retracted %s (%d output tokens) to free KV memory", req.rid,
                    len(req.output_ids))

    # ---- post-processing -------------------------------------------------------------------
    def _append_token(self, req: Req, result: StepResult, i: int,
                      draft_logits: np.ndarray | None = None) -> ReqOutput:
        token = int(result.token_ids[i])
        verified: list[int] = []
        if draft_logits is not None:
            verified, correction = verify_draft(req, draft_logits, self.vocab_size)
            token = token if correction is None else correction
            self.stats.jump_forward_tokens += len(verified)
            self.stats.generated_tokens += len(verified)
        req.jumped = False
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        finish.check_finished(req, token, self.eos_token_ids)
        self.grammar_steps.advance(req, token)
        forced = self.grammar_steps.jump_forward(req)
        self.stats.jump_forward_tokens += len(forced)
        self.stats.generated_tokens += len(forced)
        new_ids = verified + [token] + forced
        logprobs = token_logprobs(req, result, i, token)
        if req.finished:
            return self._finish(req, new_ids, logprobs)
        return make_output(req, new_ids, logprobs)

    def _append_verified(self, req: Req, result: StepResult, row: int, draft: list[int]
                         ) -> ReqOutput:
        """Append what the verify of `draft` (rows row .. row + len(draft) of `result`) keeps
        (speculative.py), token by token, stopping where a stop condition ends the request."""
        sampled = result.token_ids[row : row + len(draft) + 1]
        kept = accept(draft, sampled)
        self.speculator.record(req, len(draft), len(kept) - 1)
        self.stats.spec_verify_reqs += 1
        self.stats.spec_draft_tokens += len(draft)
        self.stats.spec_accepted_tokens += len(kept) - 1
        new_ids: list[int] = []
        logprobs, tops = [], []
        for j, token in enumerate(kept):
            req.kv_len += 1  # the K/V of the token before this one is now kept
            req.output_ids.append(token)
            new_ids.append(token)
            self.stats.generated_tokens += 1
            lp, top = token_logprobs(req, result, row + j, token)
            logprobs += lp or []
            tops += top or []
            finish.check_finished(req, token, self.eos_token_ids)
            self.grammar_steps.advance(req, token)
            if req.finished:
                break
        forced = self.grammar_steps.jump_forward(req)
        self.stats.jump_forward_tokens += len(forced)
        self.stats.generated_tokens += len(forced)
        entries = (logprobs, tops or None) if req.return_logprob else (None, None)
        if req.finished:
            return self._finish(req, new_ids + forced, entries)
        return make_output(req, new_ids + forced, entries)

    def _take_jump_forward(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.jumped and not req.finished:
                self.jump_forward_reqs.append(req)

    def _poll_grammars(self) -> list[ReqOutput]:
        """Requests whose grammar failed to compile end with a 400."""
        outputs = []
        for req in [r for r in self.waiting if r.grammar_future is not None]:
            try:
                state = grammar_ready(req)
            except Exception as e:
                outputs.append(self.fail(req, e))
                continue
            if isinstance(state, str):
                self.waiting.remove(req)
                outputs.append(error_output(req.rid, req.prompt_len, state))
        return outputs

    def _finish(self, req: Req, new_ids: list[int], logprobs=(None, None)) -> ReqOutput:
        self._release(req)
        self.stats.num_requests_finished += 1
        return make_output(req, new_ids, logprobs)

    def _release(self, req: Req) -> None:
        # A turn of an agent session that ended normally: its next turn will resend it.
        self.kv.release_req(req, retain=req.finish_reason["type"] != "abort")
        self._free_row(req)

    def _free_row(self, req: Req) -> None:
        if req.row:
            self.free_rows.append(req.row)
            req.row = 0

    # ---- aborts / control ------------------------------------------------------------------
    def _process_aborts(self) -> list[ReqOutput]:
        if not self._aborts:
            return []
        outputs = []
        for queue, req in self._queued():
            if req.rid in self._aborts:
                self._dequeue(queue, req)
                req.finish_reason = finish.abort("request aborted")
                # A waiting request holds no KV and no row: nothing to release.
                outputs.append(make_output(req, []) if queue is self.waiting
                               else self._finish(req, []))
        self._aborts.clear()
        return outputs

    def flush_cache(self) -> bool:
        """Empty the radix tree; refused (False) while requests hold KV."""
        if next(self._queued(), None) is not None:
            return False
        self.kv.tree.reset()
        return True

    def check_integrity(self) -> None:
        self.kv.check([req for queue, req in self._queued() if queue is not self.waiting])

    def memory_info(self) -> dict[str, int]:
        return memory_info(self.kv)
