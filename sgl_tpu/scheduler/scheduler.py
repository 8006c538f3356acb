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

The scheduler owns a `KVManager` (allocator + tree) and drives a `ModelRunner` through the
numpy-only step contract of `executor/step.py` (`forward(mode, steps) -> StepResult`,
`token_logprobs`, `row_logits`); the in-process `Engine` and the scheduler process both drive
it the same way.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.constrained.base import GrammarError
from sgl_tpu.constrained.grammar_manager import GrammarManager
from sgl_tpu.detokenize import IncrementalDecoder, find_stop
from sgl_tpu.executor.step import ForwardMode, ModelRunner, SeqStep, StepResult, mask_words
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.messages import ReqOutput, TokenizedGenerateReq
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler.constrained import (
    GRAMMAR_COMPILE_BUDGET_S,
    MAX_JUMP_TOKENS,
    drop_draft,
    fill_mask,
    grammar_ready,
    jump_forward_enabled,
    make_draft,
    single_allowed_token,
    verify_draft,
)
from sgl_tpu.scheduler.faults import fault_reason
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.policy import order_waiting
from sgl_tpu.scheduler.req import Req
from sgl_tpu.validation import check_request, check_token_ids

logger = logging.getLogger(__name__)

# A waiting request that shares at least this many uncached tokens with a request already in
# the EXTEND batch waits one step, then reuses that request's KV from the tree.
IN_BATCH_SHARED_TOKENS = 32


@dataclass
class SchedulerStats:
    """Counters read by the metrics endpoint and the periodic log line."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_requests_finished: int = 0
    num_retractions: int = 0
    num_extend_steps: int = 0
    num_decode_steps: int = 0
    jump_forward_tokens: int = 0  # tokens appended by jump-forward (no decode step)
    num_requests_failed: int = 0  # ended by an exception while handling them (faults.py)
    last_log_time: float = field(default_factory=time.monotonic)
    last_log_tokens: int = 0


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
        self.decode = decode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        allocator = PageAllocator(num_pages, config.page_size)
        self.kv = KVManager(allocator, RadixCache(allocator, disable=config.disable_radix_cache),
                            session_retention_s=config.session_retention_s)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # a prompt being prefilled in chunks
        self.free_rows = list(range(config.max_running_requests, 0, -1))
        self.stats = SchedulerStats()
        self._aborts: set[str] = set()
        self._seed_rng = random.Random(0x5C1)
        self.grammar = grammar
        self.grammar_supported = grammar is not None
        self.disable_jump_forward = disable_jump_forward
        self.mask_words = mask_words(vocab_size)
        self.jump_forward_reqs: list[Req] = []  # running requests with forced tokens to extend
        self._step_reqs: list[Req] = []  # the batch of the step in progress (for fail_all)

    # ---- intake ----------------------------------------------------------------------------
    def validate(self, prompt_len: int, sampling: SamplingParams) -> str | None:
        """A message if a request can never be served, else None."""
        return check_request(prompt_len, sampling, context_len=self.config.context_len,
                             capacity_tokens=self.kv.capacity_tokens,
                             grammar_supported=self.grammar_supported,
                             vocab_size=self.vocab_size)

    def add_request(self, msg: TokenizedGenerateReq) -> ReqOutput | None:
        """Queue a request; returns an immediate error output if it cannot be served."""
        try:
            sampling = SamplingParams.from_dict(msg.sampling)
        except ValueError as e:
            return _error_output(msg.rid, len(msg.input_ids), str(e))
        error = (check_token_ids("input_ids", msg.input_ids, self.vocab_size)
                 or self.validate(len(msg.input_ids), sampling))
        if error is not None:
            return _error_output(msg.rid, len(msg.input_ids), error)
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(32)
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling=sampling,
                  seed=seed, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len,
                  top_logprobs_num=min(msg.top_logprobs_num, self.config.max_top_logprobs),
                  session_id=msg.session_id)
        if sampling.stop or sampling.stop_regex:
            req.decoder = IncrementalDecoder(self.decode, sampling.skip_special_tokens)
        if sampling.grammar is not None and self.grammar is not None:
            req.grammar_future = self.grammar.request(*sampling.grammar)
            req.grammar_deadline = time.monotonic() + GRAMMAR_COMPILE_BUDGET_S
        self.kv.retain_prefix(req)
        self.waiting.append(req)
        return None

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._aborts
                    or self.jump_forward_reqs)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Run one batch; return the outputs it produced (possibly none).

        An exception in one request's host code ends that request (`fail`); one outside any
        request's code propagates, and the caller decides (`fail_all` or die, `faults.py`)."""
        outputs = self._process_aborts() + self._poll_grammars()
        batch = self._schedule_extend()
        if batch:
            outputs += self._run_extend(batch)
        elif self.running:
            outputs += self._run_decode()
        self._step_reqs = []
        self._maybe_log()
        return outputs

    # ---- faults (see faults.py) ------------------------------------------------------------
    def fail(self, req: Req, exc: BaseException) -> ReqOutput:
        """End `req` alone after `exc` was raised while handling it; its KV is discarded."""
        for queue in (self.waiting, self.running, self.jump_forward_reqs):
            if req in queue:
                queue.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        req.draft, req.draft_masks = [], []
        self.kv.discard_req(req)
        self._free_row(req)
        req.finish_reason = fault_reason(req.rid, exc)
        self.stats.num_requests_failed += 1
        return ReqOutput(rid=req.rid, new_token_ids=[], finished=True,
                         finish_reason=req.finish_reason, prompt_tokens=req.prompt_len,
                         completion_tokens=len(req.output_ids),
                         skip_special_tokens=req.sampling.skip_special_tokens)

    def fail_all(self, exc: BaseException) -> list[ReqOutput]:
        """After a fault outside any one request's code (e.g. the device step): end every
        request that is queued, running or in the failed step."""
        reqs = {id(r): r for r in [*self._step_reqs, *self.running, *self.jump_forward_reqs,
                                   *([self.chunked_req] if self.chunked_req else []),
                                   *self.waiting] if not r.finished}
        self._step_reqs = []
        return [self.fail(r, exc) for r in reqs.values()]

    # ---- EXTEND ----------------------------------------------------------------------------
    def _schedule_extend(self) -> list[tuple[Req, int]]:
        """Pick (request, number of tokens to run) pairs within the token budget."""
        cfg = self.config
        budget = cfg.chunked_prefill_size
        batch: list[tuple[Req, int]] = []
        chunk_blocked = False  # the chunked prompt waits for pages; admit nothing new
        if self.chunked_req is not None:
            req = self.chunked_req
            n = min(len(req.fill_ids) - req.kv_len, budget)
            if self.kv.alloc_pages(req, self.kv.pages_needed(req, req.kv_len + n)):
                batch.append((req, n))
                budget -= n
                self.chunked_req = None
            else:
                chunk_blocked = True
        while self.jump_forward_reqs and budget > 0 and len(batch) < cfg.max_extend_seqs:
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
        if chunk_blocked:
            return batch
        ready = [r for r in self.waiting if r.grammar_future is None or r.matcher is not None]
        if not ready or budget <= 0:
            return batch
        shared_keys: set[int] = set()
        for req in order_waiting(cfg.schedule_policy, ready, self.kv.tree):
            if (len(batch) >= cfg.max_extend_seqs or budget <= 0
                    or len(self.running) + len(self.jump_forward_reqs) + len(batch)
                    >= cfg.max_running_requests):
                break
            self.kv.admit_prefix(req)
            extend_len = len(req.fill_ids) - req.kv_len
            if not self.kv.tree.disable and _shares_uncached(req, shared_keys,
                                                             self.kv.page_size):
                self.kv.release_req(req)
                continue
            n = min(extend_len, budget)
            # Keep a page per running request in reserve so admission does not starve decode.
            reserve = len(self.running) + len(self.jump_forward_reqs) + len(batch)
            need = self.kv.pages_needed(req, req.kv_len + n)
            if need + reserve > self.kv.available_pages() or not self.kv.alloc_pages(req, need):
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
            _add_page_keys(req, shared_keys, self.kv.page_size)
            budget -= n
        return batch

    def _run_extend(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        self._step_reqs = [req for req, _ in batch]
        steps, kept, outputs = [], [], []
        for req, n in batch:
            fill = req.fill_ids
            completes = req.kv_len + n == len(fill)
            try:
                mask = self._step_mask(req) if completes else None
            except Exception as e:
                outputs.append(self.fail(req, e))
                continue
            kept.append((req, n))
            steps.append(SeqStep(
                token_ids=fill[req.kv_len : req.kv_len + n], prefix_len=req.kv_len,
                pages=req.pages, sampling=req.sampling, seed=req.seed,
                num_output_tokens=len(req.output_ids), counts_row=req.row,
                counts_reset=req.counts_fresh,
                sample_valid=completes and req.sampling.max_new_tokens > 0,
                bitmask=mask))
        batch = kept
        if not batch:
            return outputs
        result = self.runner.forward(ForwardMode.EXTEND, steps)
        self.stats.num_extend_steps += 1
        if any(req.wants_input_logprobs for req, _ in batch):
            self._collect_input_logprobs(batch, result)
        draft_logits = self._draft_logits(batch, result)
        for i, (req, n) in enumerate(batch):
            req.counts_fresh = False
            req.kv_len += n
            try:
                out = self._post_extend(req, result, i, draft_logits.get(req.rid))
            except Exception as e:
                out = self.fail(req, e)
            if out is not None:
                outputs.append(out)
        self._take_jump_forward([req for req, _ in batch])
        return outputs

    def _post_extend(self, req: Req, result: StepResult, i: int,
                     draft_logits: np.ndarray | None) -> ReqOutput | None:
        if req.kv_len < len(req.fill_ids):  # more chunks to go
            self.kv.cache_req(req)
            self.chunked_req = req
            return None
        if req.sampling.max_new_tokens == 0:  # prefill only
            req.finish_reason = {"type": "length", "length": 0}
            return self._finish(req, [])
        out = self._append_token(req, result, i, draft_logits)
        if not req.finished:
            self.kv.cache_req(req)
            if not req.jumped:
                self.running.append(req)
        return out

    def _step_mask(self, req: Req) -> np.ndarray | None:
        """The grammar's mask, with EOS and stop ids disallowed before min_new_tokens."""
        row = fill_mask(req, self.mask_words)
        sp = req.sampling
        if len(req.output_ids) < sp.min_new_tokens:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
            if banned:
                row = np.full(self.mask_words, -1, np.int32) if row is None else row
                words = row.view(np.uint32)
                for t in banned:
                    words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return row

    def _draft_logits(self, batch: list[tuple[Req, int]], result: StepResult
                      ) -> dict[str, np.ndarray]:
        """Logits at the positions predicting each request's draft tokens (jump-forward)."""
        rows, owners = [], []
        t = 0
        for req, n in batch:
            k = len(req.draft)
            if k:
                rows.extend(range(t + n - k - 1, t + n - 1))
                owners.append((req, k))
            t += n
        if not rows:
            return {}
        logits = self.runner.row_logits(result.hidden, np.asarray(rows, np.int32))
        out, r = {}, 0
        for req, k in owners:
            out[req.rid] = logits[r : r + k]
            r += k
        return out

    def _collect_input_logprobs(self, batch: list[tuple[Req, int]], result: StepResult) -> None:
        """Prompt log-probs: row t of the step predicts the token after packed token t."""
        targets = np.zeros(sum(n for _, n in batch), np.int32)
        t = 0
        for req, n in batch:
            fill = req.fill_ids
            nxt = fill[req.kv_len + 1 : req.kv_len + n + 1]
            targets[t : t + len(nxt)] = nxt
            t += n
        lp, top_ids, top_lp = self.runner.token_logprobs(result.hidden, targets)
        t = 0
        for req, n in batch:
            if req.wants_input_logprobs:
                start = req.logprob_start_len
                if req.kv_len == 0 and start == 0:
                    req.input_token_logprobs.append([None, req.origin_input_ids[0]])
                    req.input_top_logprobs.append(None)
                k = req.top_logprobs_num
                for j in range(n):
                    pos = req.kv_len + j + 1  # the prompt position predicted by row j
                    if start <= pos < req.prompt_len:
                        # SGLang: the first entry (position logprob_start_len) is null.
                        value = None if pos == start else float(lp[t + j])
                        req.input_token_logprobs.append([value, req.origin_input_ids[pos]])
                        req.input_top_logprobs.append(
                            [[float(top_lp[t + j, c]), int(top_ids[t + j, c])]
                             for c in range(k)] if k else None)
            t += n

    # ---- DECODE ----------------------------------------------------------------------------
    def _run_decode(self) -> list[ReqOutput]:
        self._ensure_decode_pages()
        self._step_reqs = batch = []
        steps, outputs = [], []
        for req in list(self.running):
            try:
                mask = self._step_mask(req)
            except Exception as e:
                outputs.append(self.fail(req, e))
                continue
            batch.append(req)
            steps.append(SeqStep(token_ids=[req.output_ids[-1]], prefix_len=req.kv_len,
                                 pages=req.pages, sampling=req.sampling, seed=req.seed,
                                 num_output_tokens=len(req.output_ids), counts_row=req.row,
                                 bitmask=mask))
        if not batch:
            return outputs
        result = self.runner.forward(ForwardMode.DECODE, steps)
        self.stats.num_decode_steps += 1
        for i, req in enumerate(batch):
            req.kv_len += 1
            try:
                outputs.append(self._append_token(req, result, i))
            except Exception as e:
                outputs.append(self.fail(req, e))
        self._take_jump_forward(batch)
        self.running = [r for r in self.running if not r.finished and not r.jumped]
        return outputs

    def _ensure_decode_pages(self) -> None:
        """Every running request gets room for one more token; retract when memory is short."""
        while True:
            needy = [r for r in self.running if self.kv.pages_needed(r, r.kv_len + 1)]
            if len(needy) <= self.kv.available_pages():
                for r in needy:
                    if not self.kv.alloc_pages(r, 1):
                        raise RuntimeError("page allocation failed despite available pages")
                return
            if len(self.running) == 1:
                # Cannot happen for validated requests (they fit the pool alone), but never spin.
                req = self.running.pop()
                req.finish_reason = {"type": "abort", "message": "out of KV cache memory"}
                self._release(req)
                return
            victim = min(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len))
            self.running.remove(victim)
            self._retract(victim)

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
        new_ids = verified + [token]
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        self._check_finished(req, token)
        self._advance_grammar(req, token)
        if not req.finished and jump_forward_enabled(req, self.disable_jump_forward):
            new_ids += self._jump_forward(req)
        lp = tops = None
        if req.return_logprob:
            lp = [[float(result.logprobs[i]), token]]
            k = req.top_logprobs_num
            tops = [[[float(result.top_logprobs[i, c]), int(result.top_ids[i, c])]
                     for c in range(k)]] if k else None
        if req.finished:
            return self._finish(req, new_ids, lp, tops)
        return self._output(req, new_ids, lp, tops)

    def _advance_grammar(self, req: Req, token: int) -> None:
        if req.matcher is None or req.finished:
            return
        if not req.matcher.accept_token(token):
            error = req.matcher.error()
            if error is not None:  # a parser limit: the grammar is too complex
                raise GrammarError(f"grammar too complex for the parser's limits: {error}")
            raise RuntimeError(f"token {token} violates the grammar its mask allowed")
        elif req.matcher.is_terminated():
            # Complete, and nothing may follow: end as if the EOS came next.
            req.finish_reason = {"type": "stop", "matched": min(self.eos_token_ids)}

    def _jump_forward(self, req: Req) -> list[int]:
        """Append the tokens the grammar forces (exactly one allowed token at a time)."""
        forced: list[int] = []
        row = np.empty(self.mask_words, np.int32)
        while len(forced) < MAX_JUMP_TOKENS and not req.finished:
            req.matcher.fill_bitmask(row)
            token = single_allowed_token(row)
            if token is None or token in self.eos_token_ids:
                break
            forced.append(token)
            req.output_ids.append(token)
            self._check_finished(req, token)
            self._advance_grammar(req, token)
        if not req.finished:
            make_draft(req, self.mask_words)
        if forced or req.draft:
            req.jumped = not req.finished
            self.stats.jump_forward_tokens += len(forced)
            self.stats.generated_tokens += len(forced)
        return forced

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
                outputs.append(_error_output(req.rid, req.prompt_len, state))
        return outputs

    def _check_finished(self, req: Req, token: int) -> None:
        sp = req.sampling
        num_out = len(req.output_ids)
        if req.decoder is not None:
            delta = req.decoder.append([token])
            if delta:
                hit = find_stop(req.decoder.text, len(delta), sp.stop, sp.stop_regex)
                if hit is not None:
                    req.stop_text_offset = -1 if sp.no_stop_trim else hit[0]
                    req.finish_reason = {"type": "stop", "matched": hit[1]}
                    return
        if num_out >= sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
                req.finish_reason = {"type": "stop", "matched": token}
                return
        if num_out >= sp.max_new_tokens:
            req.finish_reason = {"type": "length", "length": sp.max_new_tokens}

    def _finish(self, req: Req, new_ids: list[int], lp=None, tops=None) -> ReqOutput:
        self._release(req)
        self.stats.num_requests_finished += 1
        return self._output(req, new_ids, lp, tops)

    def _release(self, req: Req) -> None:
        # A turn of an agent session that ended normally: its next turn will resend it.
        self.kv.release_req(req, retain=req.finish_reason["type"] != "abort")
        self._free_row(req)

    def _free_row(self, req: Req) -> None:
        if req.row:
            self.free_rows.append(req.row)
            req.row = 0

    def _output(self, req: Req, new_ids: list[int], lp=None, tops=None) -> ReqOutput:
        out = ReqOutput(
            rid=req.rid, new_token_ids=new_ids, finished=req.finished,
            finish_reason=req.finish_reason, prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids) - len(req.draft),
            cached_tokens=req.cached_tokens,
            stop_text_offset=req.stop_text_offset,
            skip_special_tokens=req.sampling.skip_special_tokens,
            stop_strs=[] if req.sampling.no_stop_trim else list(req.sampling.stop),
            output_token_logprobs=lp, output_top_logprobs=tops)
        if req.return_logprob and not req.input_logprobs_sent:
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            req.input_logprobs_sent = True
        return out

    # ---- aborts / control ------------------------------------------------------------------
    def _process_aborts(self) -> list[ReqOutput]:
        if not self._aborts:
            return []
        outputs = []
        aborted = {"type": "abort", "message": "request aborted"}
        for req in list(self.waiting):
            if req.rid in self._aborts:
                self.waiting.remove(req)
                req.finish_reason = dict(aborted)
                outputs.append(self._output(req, []))
        for req in list(self.running):
            if req.rid in self._aborts:
                self.running.remove(req)
                req.finish_reason = dict(aborted)
                outputs.append(self._finish(req, []))
        for req in list(self.jump_forward_reqs):
            if req.rid in self._aborts:
                self.jump_forward_reqs.remove(req)
                req.finish_reason = dict(aborted)
                outputs.append(self._finish(req, []))
        if self.chunked_req is not None and self.chunked_req.rid in self._aborts:
            req, self.chunked_req = self.chunked_req, None
            req.finish_reason = dict(aborted)
            outputs.append(self._finish(req, []))
        self._aborts.clear()
        return outputs

    def flush_cache(self) -> bool:
        """Empty the radix tree; refused (False) while requests hold KV."""
        if self.running or self.chunked_req or self.waiting or self.jump_forward_reqs:
            return False
        self.kv.tree.reset()
        return True

    def check_integrity(self) -> None:
        holding = (list(self.running) + self.jump_forward_reqs
                   + ([self.chunked_req] if self.chunked_req else []))
        self.kv.check(holding)

    def memory_info(self) -> dict[str, int]:
        alloc, tree = self.kv.allocator, self.kv.tree
        return {
            "num_pages_total": alloc.num_usable_pages,
            "num_pages_free": alloc.num_free_pages,
            "num_pages_tree": tree.num_pages_held(),
            "num_pages_requests": alloc.num_usable_pages - alloc.num_free_pages
                                  - tree.num_pages_held(),
            "tree_evictable_tokens": tree.evictable_size(),
            "tree_protected_tokens": tree.protected_size(),
            "tree_retained_tokens": tree.retained_size(),
            "evicted_tokens": tree.num_evicted_tokens,
            "evicted_retained_tokens": tree.num_evicted_retained_tokens,
            "page_size": self.kv.page_size,
            "max_total_tokens": self.kv.capacity_tokens,
        }

    def _maybe_log(self, interval_s: float = 10.0) -> None:
        now = time.monotonic()
        s = self.stats
        if now - s.last_log_time < interval_s:
            return
        tokens = s.generated_tokens - s.last_log_tokens
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        logger.info(
            "running: %d, waiting: %d, free pages: %d, cache hit rate: %.1f%%, "
            "gen throughput: %.1f tok/s", len(self.running), len(self.waiting),
            self.kv.allocator.num_free_pages, 100 * hit, tokens / (now - s.last_log_time))
        s.last_log_time, s.last_log_tokens = now, s.generated_tokens


def _error_output(rid: str, prompt_len: int, message: str) -> ReqOutput:
    return ReqOutput(rid=rid, new_token_ids=[], finished=True,
                     finish_reason={"type": "abort", "message": message, "status_code": 400},
                     prompt_tokens=prompt_len)


def _page_hashes(req: Req, page_size: int) -> list[int]:
    """Chained hashes of the request's fill pages after its cached prefix: hash k covers
    tokens [0, (k+1) * page_size)."""
    fill = req.fill_ids
    out, h = [], 0
    for i in range(0, len(fill) - page_size + 1, page_size):
        h = hash((h, tuple(fill[i : i + page_size])))
        out.append(h)
    return out


def _add_page_keys(req: Req, keys: set[int], page_size: int) -> None:
    keys.update(_page_hashes(req, page_size))


def _shares_uncached(req: Req, keys: set[int], page_size: int) -> bool:
    if not keys:
        return False
    shared = 0
    for h in _page_hashes(req, page_size):
        if h not in keys:
            break
        shared += page_size
    return shared - req.kv_len >= IN_BATCH_SHARED_TOKENS
