"""Appending a step's sampled tokens to a request (host side, no JAX).

    append           one sampled token: a DECODE row, or an EXTEND's last row, after the kept
                     part of a jump-forward draft the EXTEND verified (`verify_draft`)
    append_verified  a speculative draft verified in a DECODE step: the kept run
                     (`speculative.accept`), token by token until a stop condition

After each token: the stop conditions (`finish.check_finished`), then the grammar matcher;
after the last, the grammar's forced tokens (jump-forward). Both return the request's new token
ids with their log-prob entries; the caller sends them, and finishes the request when
`req.finished`. Token counts go to the scheduler's counters.
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from sgl_tpu.executor.step import StepResult
from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.counters import SchedulerStats
from sgl_tpu.scheduler.grammar_steps import GrammarSteps, verify_draft
from sgl_tpu.scheduler.output import LogprobEntries, token_logprobs
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.speculative import Speculator, accept

Appended = tuple[list[int], LogprobEntries]  # (new token ids, their log-prob entries)


class TokenAppender:
    def __init__(self, stats: SchedulerStats, grammar_steps: GrammarSteps,
                 speculator: Speculator | None, eos_token_ids: Set[int],
                 vocab_size: int) -> None:
        self.stats = stats
        self.grammar_steps = grammar_steps
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def append(self, req: Req, result: StepResult, i: int,
               draft_logits: np.ndarray | None = None) -> Appended:
        """Append the token sampled at row `i` of `result`; `draft_logits`: the logits at the
        positions of `req`'s jump-forward draft, computed by the EXTEND of row `i`."""
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
        return verified + [token] + forced, token_logprobs(req, result, i, token)

    def append_verified(self, req: Req, result: StepResult, row: int, draft: list[int]
                        ) -> Appended:
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
        return new_ids + forced, entries
