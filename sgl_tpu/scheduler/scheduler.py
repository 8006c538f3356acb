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
  request with a `session_id` (one turn of an agent loop) also pins it: until its open
  session closes (sessions.py), else for `session_retention_s`; so do `retention_seconds` and a
  turn that ends in tool calls (retention.py). Under memory pressure pinned KV is evicted after
  all unpinned KV, since the agent's next turn resends it (`mem_cache/eviction.py`).

With overlap scheduling (`SchedulerConfig.overlap_schedule`, scheduler/overlap.py) a DECODE
step is dispatched before the previous one's tokens reach the host, and the host processes
step t while the device runs step t+1; a step that needs host data first drains the one in
flight and runs the serial way.

The scheduler owns a `KVManager` (allocator + tree) and drives a `ModelRunner` through the
numpy-only step contract of `executor/step.py` (`forward(mode, steps) -> StepResult`,
`token_logprobs`, `row_logits`); the in-process `Engine` and the scheduler process both drive
it the same way. This class only schedules; the rest of a step's host work lives beside it:

    intake.py          message -> Req (re-validated), or a 400 output
    queues.py          where requests sit between steps (waiting, running, ...), their rows
    extend_planner.py  the next EXTEND batch: chunks, jump-forward re-admissions, admissions
    policy.py          waiting-queue order; in-batch prefix sharing
    programs.py        the agents behind requests: service, states, admission control
    prefetch.py        a paused program's KV back from the tiers before its next request
    priority.py        priority scheduling: admission by priority with aging, preemption
    decode_memory.py   a page for each running request's next token; retraction; draft pages
    append.py          appending sampled tokens: stop conditions, grammar, jump-forward
    grammar_steps.py   masks, matcher advance, jump-forward and draft verification
    speculative.py     speculative decoding: drafts (ngram.py) verified in the DECODE step
    overlap.py         which DECODE steps may overlap the previous one; the step in flight
    finish.py          stop conditions and finish reasons (wire format)
    output.py          ReqOutput assembly, token log-prob entries
    logprobs.py        prompt log-probs of an EXTEND step
    pooling.py         embedding requests: their prompt's hidden states pooled (--pooling)
    faults.py          what an exception while handling one request means
    counters.py        counters and the periodic log line (stats.py: /server_info, /get_load)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.constrained.grammar_manager import GrammarManager
from sgl_tpu.executor.step import DoneStep, ForwardMode, ModelRunner, StepResult
from sgl_tpu.lora import LoraError
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.mem_cache.tiers import TieredCache
from sgl_tpu.messages import ReqOutput, TokenizedGenerateReq
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.append import Appended, TokenAppender
from sgl_tpu.scheduler.counters import SchedulerStats
from sgl_tpu.scheduler.decode_memory import DecodeMemory
from sgl_tpu.scheduler.extend_planner import ExtendBatch, ExtendPlanner
from sgl_tpu.scheduler.faults import fault_reason
from sgl_tpu.scheduler.grammar_steps import GrammarSteps, grammar_ready
from sgl_tpu.scheduler.intake import Intake
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.logprobs import collect_input_logprobs
from sgl_tpu.scheduler.lora_registry import LoraRegistry
from sgl_tpu.scheduler.output import error_output, make_output
from sgl_tpu.scheduler.overlap import PendingDecode, can_overlap, lagged_rows, overlappable
from sgl_tpu.scheduler.pooling import collect_pooled, pooled
from sgl_tpu.scheduler.prefetch import Prefetcher
from sgl_tpu.scheduler.priority import Priorities
from sgl_tpu.scheduler.programs import Programs
from sgl_tpu.scheduler.queues import ReqQueues
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.speculative import Speculator, verify_steps


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
        tiers: Callable[[RadixCache], TieredCache] | None = None,
        lora: LoraRegistry | None = None,
    ) -> None:
        """`tiers` builds the host/disk tiers below the pool over the tree (None: no tiers);
        `lora`: the loaded LoRA adapters (None: LoRA off)."""
        self.lora = lora
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        pools = getattr(runner, "config", None)  # a hybrid model's sliding-window pool
        swa_pages = getattr(pools, "swa_num_pages", 0)
        self.kv = KVManager.for_config(
            config, num_pages, tiers, swa=(pools.swa_window, swa_pages) if swa_pages else None)
        self.tiers, self.sessions = self.kv.tiers, self.kv.sessions
        self.queues = ReqQueues(config.max_running_requests)
        self.stats = SchedulerStats()
        self._aborts: set[str] = set()
        self.grammar = grammar
        self.intake = Intake(config, vocab_size=vocab_size,
                             capacity_tokens=self.kv.capacity_tokens, grammar=grammar,
                             decode=decode, lora=lora)
        self.grammar_steps = GrammarSteps(vocab_size, self.eos_token_ids, disable_jump_forward)
        self._step_reqs: list[Req] = []  # the batch of the step in progress (for fail_all)
        self.speculator = None if config.speculative_algorithm is None else Speculator(
            config, row_limit=getattr(runner, "decode_row_limit", None))
        priorities = Priorities.from_config(config)  # None: no --enable-priority-scheduling
        self.memory = DecodeMemory(self.kv, self.queues, self.stats, priorities)
        tiers = self.kv.tiers  # admission counts the pool and the host tier, in tokens
        host_tokens = 0 if tiers is None else tiers.host.capacity * self.kv.page_size
        self.programs = Programs.for_scheduler(config, self.kv.capacity_tokens + host_tokens)
        self.prefetcher = Prefetcher(self.kv, self.programs,
                                     enabled=not config.disable_kv_prefetch,
                                     max_retention_s=config.max_retention_s)
        self.programs.on_done = self._program_done
        if self.sessions is not None:  # one public id per key in /server_info
            self.sessions.public_id = self.programs.public_id
        self.extend_planner = ExtendPlanner(config, self.kv, self.queues, self.stats,
                                            retract=self.memory.retract, priorities=priorities,
                                            programs=self.programs)
        self.appender = TokenAppender(self.stats, self.grammar_steps, self.speculator,
                                      self.eos_token_ids, vocab_size)
        # A DECODE step in flight whose results are not processed yet (overlap scheduling).
        self._pending: PendingDecode | None = None
        self._chunk_ran = False  # the last step ran a chunk of a prompt that has more
        self.overlap = (config.overlap_schedule and self.speculator is None
                        and hasattr(runner, "dispatch"))

    # The queues (queues.py), read by reports and tests.
    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, msg: TokenizedGenerateReq, sampling: SamplingParams | None = None
                    ) -> ReqOutput | None:
        """Queue a request; returns an immediate error output if it cannot be served.
        `sampling`: its params as the in-process Engine parsed them (None: from another
        process, parsed again here)."""
        req = self.intake.new_req(msg, sampling)
        if isinstance(req, ReqOutput):
            return req
        self.programs.arrive(req, msg.session_id or msg.program_id, msg.max_new_tokens_defaulted)
        self.prefetcher.arrived(req)
        self.kv.load_ahead(req)
        self.kv.retain_prefix(req)
        self.waiting.append(req)
        return None

    def _program_done(self, key: str) -> None:
        """The program table found program `key` done (after a tool pause)."""
        self.kv.retention.release_hint(key)
        self.prefetcher.done(key)

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name` (LoraError when unknown, or while a request uses it)."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled on this server (start it with --enable-lora)")
        self.lora.unload(name, (req.lora_id for _, req in self.queues))

    @property
    def num_running(self) -> int:
        return self.queues.num_running

    @property
    def has_work(self) -> bool:
        return (bool(self._aborts) or self._pending is not None or not self.queues.is_empty()
                or self.prefetcher.has_work())

    def idle_wait_s(self, longest_s: float) -> float:
        """How long the idle loop may wait for a message (a prefetch may come due sooner)."""
        return self.prefetcher.idle_wait_s(longest_s)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one batch; return the outputs it produced (possibly none).

        An exception in one request's host code ends that request (`fail`); one outside any
        request's code propagates, and the caller decides (`fail_all` or die, `faults.py`)."""
        outputs = []
        if self._pending is not None and not self._can_overlap():
            outputs += self._drain()  # the serial way from here
        outputs += self._process_aborts() + self._poll_grammars()
        chunked = self.queues.chunked_req  # its next chunks' pages are no prefetch's room
        self.prefetcher.step([*self.waiting, *([chunked] if chunked is not None else [])],
                             busy=bool(self.running) or self._pending is not None
                             or chunked is not None)
        if self._pending is not None:
            # Overlap: step t+1 goes to the device first, then the host processes step t.
            in_flight = self._pending
            self._pending = self._dispatch_lagged_decode(in_flight)
            outputs += self._process_decode(in_flight)
            if not self.running:  # what is in flight now has only finished requests' rows
                outputs += self._drain()
        else:
            # A prompt prefilled in chunks takes turns with the running requests' DECODE
            # steps: a long prompt delays each stream by a chunk, not by its whole prefill.
            batch = ([] if self._chunk_ran and self.running
                     else self.extend_planner.next_batch())
            self._chunk_ran = False
            if batch:
                outputs += self._run_extend(batch)
                self._chunk_ran = self.queues.chunked_req is not None
            elif self.running:
                outputs += self._run_decode()
        self._step_reqs = []
        self.stats.maybe_log(self.num_running, len(self.waiting),
                             self.kv.allocator.num_free_pages)
        return outputs

    # ---- faults (see faults.py) ------------------------------------------------------------
    def fail(self, req: Req, exc: BaseException) -> ReqOutput:
        """End `req` alone after `exc` was raised while handling it; its KV is discarded."""
        for queue, queued in self.queues:
            if queued is req:
                self.queues.remove(queue, req)
        req.draft, req.draft_masks = [], []
        self.kv.discard_req(req)
        self.queues.free_row(req)
        req.finish_reason = fault_reason(req.rid, exc)
        self.programs.finish(req)
        self.stats.num_requests_failed += 1
        return make_output(req, [])

    def fail_all(self, exc: BaseException) -> list[ReqOutput]:
        """After a fault outside any one request's code (e.g. the device step): end every
        request that is queued, running or in the failed step."""
        reqs = {id(r): r for r in [*self._step_reqs, *(r for _, r in self.queues)]
                if not r.finished}
        self._step_reqs = []
        self._pending = None  # its results are not trusted either
        return [self.fail(r, exc) for r in reqs.values()]

    # ---- EXTEND ----------------------------------------------------------------------------
    def _run_extend(self, batch: ExtendBatch) -> list[ReqOutput]:
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
        result = self.runner.forward(ForwardMode.EXTEND, self.kv.with_windows(steps))
        num_tokens, seconds = sum(n for _, n in kept), time.perf_counter() - started
        self.stats.count_extend(num_tokens, seconds)
        if self.tiers is not None:  # what computing a prefix costs (load_cost.py)
            self.tiers.load_cost.observe_compute(num_tokens, seconds)
        if any(req.wants_input_logprobs for req, _ in kept):
            collect_input_logprobs(kept, result, self.runner)
        if any(req.pooling is not None for req, _ in kept):
            collect_pooled(kept, result, self.runner)
        draft_logits = self.grammar_steps.draft_logits(kept, result, self.runner)
        for i, (req, n) in enumerate(kept):
            req.counts_fresh = False
            self.programs.count_extend(req, n)
            req.kv_len += n
            try:
                out = self._post_extend(req, result, i, draft_logits.get(req.rid))
            except Exception as e:
                out = self.fail(req, e)
            if out is not None:
                outputs.append(out)
        self.queues.take_jump_forward([req for req, _ in kept])
        return outputs

    def _post_extend(self, req: Req, result: StepResult, i: int,
                     draft_logits: np.ndarray | None) -> ReqOutput | None:
        if req.kv_len < len(req.fill_ids):  # more chunks to go
            self.kv.cache_req(req)
            self.queues.chunked_req = req
            return None
        if req.sampling.max_new_tokens == 0:  # prefill only (an embedding request: pooled)
            embedding = None if req.pooling is None else pooled(req)
            req.finish_reason = finish.length(0)
            out = self._finish(req, [])
            out.embedding = embedding
            return out
        out = self._output(req, self.appender.append(req, result, i, draft_logits))
        if not req.finished:
            self.kv.cache_req(req)
            if not req.jumped:
                self.running.append(req)
        return out

    # ---- DECODE ----------------------------------------------------------------------------
    def _run_decode(self) -> list[ReqOutput]:
        ended = self.memory.make_room()
        outputs = [] if ended is None else [self._finish(ended, [])]
        if not self.running:
            return outputs
        spec_started = time.perf_counter()  # the draft gate times drafting too
        drafts = {} if self.speculator is None else self.memory.fit_drafts(
            self.speculator.drafts(self.running))
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
        steps = self.kv.with_windows(steps)
        if self.overlap and all(overlappable(req) for req in reqs):
            self._pending = PendingDecode(batch, self.runner.dispatch(ForwardMode.DECODE, steps))
            return outputs  # processed in the next step(), while the device runs the one after
        started = time.perf_counter()
        # tokens emitted by this step, for the draft gate (only counted when it runs)
        num_outputs = 0 if self.speculator is None else sum(len(r.output_ids) for r in reqs)
        outputs += self._process_decode(PendingDecode(
            batch, DoneStep(self.runner.forward(ForwardMode.DECODE, steps)), started))
        if self.speculator is not None:
            self.speculator.record_decode(time.perf_counter() - spec_started,
                                          sum(len(req.output_ids) for req in reqs) - num_outputs)
        return outputs

    def _process_decode(self, decode: PendingDecode) -> list[ReqOutput]:
        """Wait for `decode`'s tokens and append them; rows of requests that ended while it
        was in flight (overlap: one step late) are discarded."""
        result = decode.step.result()
        seconds = time.perf_counter() - decode.dispatched_at
        self.stats.count_decode(seconds)
        if self.speculator is not None:
            self.speculator.record_step(sum(1 + len(d) for _, d, _ in decode.batch), seconds)
        outputs = []
        for req, draft, row in decode.batch:
            if req.finished:
                continue
            try:
                if draft:
                    appended = self.appender.append_verified(req, result, row, draft)
                else:
                    req.kv_len += 1
                    appended = self.appender.append(req, result, row)
                outputs.append(self._output(req, appended))
            except Exception as e:
                outputs.append(self.fail(req, e))
        self.queues.take_jump_forward(decode.reqs)
        self.queues.running = [r for r in self.running if not r.finished and not r.jumped]
        return outputs

    # ---- overlap (scheduler/overlap.py) ------------------------------------------------------
    def _can_overlap(self) -> bool:
        return self.overlap and not self._aborts and can_overlap(self.queues, self.kv)

    def _dispatch_lagged_decode(self, in_flight: PendingDecode) -> PendingDecode | None:
        """Dispatch the DECODE after `in_flight` (`overlap.lagged_rows`)."""
        lagged = lagged_rows(in_flight, self.running, self.kv)
        if not lagged:
            return None
        self._step_reqs = [r for r, _ in lagged]
        self.stats.num_overlapped_steps += 1
        # no grammar here (overlappable), but a min_new_tokens ban, one token ahead
        steps = self.kv.with_windows([r.decode_step(self.grammar_steps.step_mask(r, 1),
                                                    prev_row=row) for r, row in lagged])
        batch = [(r, [], i) for i, (r, _) in enumerate(lagged)]
        return PendingDecode(batch, self.runner.dispatch(ForwardMode.DECODE, steps))

    def _drain(self) -> list[ReqOutput]:
        """Process the step in flight, if any."""
        in_flight, self._pending = self._pending, None
        return [] if in_flight is None else self._process_decode(in_flight)

    # ---- post-processing -------------------------------------------------------------------
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
                self.programs.finish(req)
                outputs.append(error_output(req.rid, req.prompt_len, state))
        return outputs

    def _output(self, req: Req, appended: Appended) -> ReqOutput:
        """The output of `req`'s newly appended tokens; finishes `req` if they ended it."""
        if req.finished:
            return self._finish(req, *appended)
        return make_output(req, *appended)

    def _finish(self, req: Req, new_ids: list[int], logprobs=(None, None)) -> ReqOutput:
        # A turn of an agent session that ended normally: its next turn will resend it.
        if req.finish_reason["type"] != "abort":
            self.prefetcher.turn_ending(req)
        self.kv.release_req(req, retain=req.finish_reason["type"] != "abort")
        self.queues.free_row(req)
        self.programs.finish(req)
        if self.speculator is not None:
            self.speculator.finished(req)
        self.stats.num_requests_finished += 1
        return make_output(req, new_ids, logprobs)

    # ---- aborts / control ------------------------------------------------------------------
    def _process_aborts(self) -> list[ReqOutput]:
        if not self._aborts:
            return []
        outputs = []
        for queue, req in self.queues:
            if req.rid in self._aborts:
                self.queues.remove(queue, req)
                req.finish_reason = finish.abort("request aborted")
                # A waiting request holds no KV and no row: nothing to release.
                self.programs.finish(req)
                outputs.append(make_output(req, []) if queue is self.waiting
                               else self._finish(req, []))
        self._aborts.clear()
        return outputs

    def flush_cache(self) -> bool:
        """Empty the radix tree and the tiers below it, forget the programs; refused (False)
        while requests hold KV."""
        if not self.queues.is_empty():
            return False
        self.kv.flush()
        self.prefetcher.clear()
        self.programs.clear()  # their KV is gone: a program that comes back starts over
        return True

    def check_integrity(self) -> None:
        self.kv.check(self.queues.holding_kv())

    def memory_info(self) -> dict[str, int]:
        return self.kv.memory_info()
