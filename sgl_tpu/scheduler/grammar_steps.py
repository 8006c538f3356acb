"""Grammar-constrained decoding as the scheduler sees it (host side, no JAX).

Per request with a regex / JSON schema / EBNF constraint:

    add_request ──GrammarManager.request──► Future (compiled off-thread, cached by (kind, text))
    each step:  waiting request whose future is done ──► matcher, or a 400 if it failed
                before running it: matcher.fill_bitmask(row) ──► SeqStep.bitmask (device masks)
                after sampling:    matcher.accept_token(token); terminated ──► finish

Jump-forward, in two exact forms:

1. While the mask allows exactly one token, it is appended without a decode step (the request
   then runs those tokens in one EXTEND). Any sampler would pick the single allowed token, and
   the RNG is keyed by output position, so the output equals decoding them one by one.
2. Greedy requests also append the backend's canonical forced tokens (e.g. `"name":"` of a
   schema with fixed keys) as a *draft*: the masks allow other tokenizations of the same text,
   so the draft is only a guess. The EXTEND that computes the draft also yields the logits at
   every draft position; the draft is kept up to the first token that differs from the masked
   argmax there, which replaces it (the grammar rolls back, the extra KV is dropped). The
   result is what greedy decoding without jump-forward produces (up to the rounding
   difference between computing a token in an EXTEND and in a DECODE step).
"""

from __future__ import annotations

import time

import numpy as np

from sgl_tpu.constrained.errors import GrammarError
from sgl_tpu.executor.step import ModelRunner, StepResult, mask_words
from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.req import Req

MAX_JUMP_TOKENS = 256  # bound on tokens appended by one jump-forward
MAX_DRAFT_TOKENS = 32  # bound on one canonical draft
# A grammar not compiled within this many seconds ends its request with a 400 (the compile
# goes on in its worker thread, and its result is cached for a later request).
GRAMMAR_COMPILE_BUDGET_S = 20.0


def grammar_ready(req: Req) -> bool | str:
    """True when the request may be scheduled, False while its grammar compiles, or the error
    message when compilation failed."""
    fut = req.grammar_future
    if fut is None or req.matcher is not None:
        return True
    if not fut.done():
        if time.monotonic() > req.grammar_deadline:
            return (f"grammar too complex: not compiled within {GRAMMAR_COMPILE_BUDGET_S:g} s")
        return False
    err = fut.exception()
    if err is not None:
        return str(err) if isinstance(err, GrammarError) else f"grammar error: {err!r}"
    req.matcher = fut.result().new_matcher()
    return True


def fill_mask(req: Req, num_words: int) -> np.ndarray | None:
    if req.matcher is None:
        return None
    row = np.empty(num_words, np.int32)
    req.matcher.fill_bitmask(row)
    return row


def single_allowed_token(row: np.ndarray) -> int | None:
    """The token id if the packed mask allows exactly one token."""
    words = row.view(np.uint32)
    nz = np.flatnonzero(words)
    if len(nz) != 1:
        return None
    w = int(words[nz[0]])
    if w & (w - 1):
        return None
    return int(nz[0]) * 32 + w.bit_length() - 1


def jump_forward_enabled(req: Req, disabled: bool) -> bool:
    """Forced tokens skip the sampler, so they would miss log-probs and penalty counts."""
    return (not disabled and req.matcher is not None and not req.return_logprob
            and not req.sampling.uses_penalties)


def draft_room(req: Req) -> int:
    """How many draft tokens a greedy request may take: drafts are verified later, so only
    where nothing but the grammar can end the request (no stop strings or stop ids) and the
    draft plus one more token fits in max_new_tokens."""
    sp = req.sampling
    if not sp.is_greedy or req.decoder is not None or sp.stop_token_ids:
        return 0
    return max(0, min(MAX_DRAFT_TOKENS, sp.max_new_tokens - len(req.output_ids) - 1))


def make_draft(req: Req, num_words: int) -> None:
    """Append the canonical forced tokens as an unverified draft (see the module docstring)."""
    room = draft_room(req)
    if room == 0:
        return
    matcher = req.matcher
    for token in matcher.forced_tokens()[:room]:
        mask = np.empty(num_words, np.int32)
        matcher.fill_bitmask(mask)
        if not matcher.accept_token(token):
            break
        if matcher.is_terminated():  # let the final token come from a normal step
            matcher.rollback(1)
            break
        req.draft.append(token)
        req.draft_masks.append(mask)
        req.output_ids.append(token)


def verify_draft(req: Req, logits: np.ndarray, vocab_size: int) -> tuple[list[int], int | None]:
    """Check the draft against the masked greedy choice at each position.

    logits: f32[len(draft), V], row j = the prediction for draft[j]. Returns (verified draft
    tokens, the model's token replacing the first wrong one or None). On a mismatch the
    request's output, grammar state and kv_len are cut back to the verified part.
    """
    draft, masks = req.draft, req.draft_masks
    req.draft, req.draft_masks = [], []
    for j, token in enumerate(draft):
        allowed = np.unpackbits(masks[j].view(np.uint8), bitorder="little")[:vocab_size]
        choice = int(np.where(allowed.astype(bool), logits[j, :vocab_size], -np.inf).argmax())
        if choice != token:
            drop = len(draft) - j
            del req.output_ids[-drop:]
            req.matcher.rollback(drop)
            req.kv_len -= drop
            return draft[:j], choice
    return draft, None


def drop_draft(req: Req) -> None:
    """Forget an unverified draft (the request is retracted before its EXTEND ran)."""
    if req.draft:
        del req.output_ids[-len(req.draft):]
        req.matcher.rollback(len(req.draft))
        req.draft, req.draft_masks = [], []


class GrammarSteps:
    """The grammar work of the scheduler's steps for constrained requests: the mask before a
    step, the matcher's advance after it, jump-forward (forced tokens and the canonical draft)
    and the logits rows that verify a draft. Holds no request state of its own."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int],
                 disable_jump_forward: bool) -> None:
        self.vocab_size = vocab_size
        self.mask_words = mask_words(vocab_size)
        self.eos_token_ids = eos_token_ids
        self.disable_jump_forward = disable_jump_forward

    def step_mask(self, req: Req, ahead: int = 0) -> np.ndarray | None:
        """The grammar's mask, with EOS and stop ids disallowed before min_new_tokens; for the
        output position `ahead` tokens past the request's outputs (a speculative draft's, or
        the step after the one in flight under overlap scheduling).

        EOS is banned there whether or not `ignore_eos` is set, as SGLang's min-new-tokens
        penalizer (and llama.cpp's `min_tokens`) do: `ignore_eos` only says an EOS does not
        end the request, so a length-forced answer (`ignore_eos` with `min_new_tokens` =
        `max_new_tokens`) holds no EOS, whose text the answer would drop."""
        row = fill_mask(req, self.mask_words)
        sp = req.sampling
        if len(req.output_ids) + ahead < sp.min_new_tokens:
            # (an EOS id past the model's vocabulary cannot be sampled: nothing to ban)
            banned = {t for t in (*sp.stop_token_ids, *self.eos_token_ids)
                      if 0 <= t < self.vocab_size}
            if banned:
                row = np.full(self.mask_words, -1, np.int32) if row is None else row
                words = row.view(np.uint32)
                for t in banned:
                    words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return row

    def advance(self, req: Req, token: int) -> None:
        """Feed the sampled `token` to the matcher; a terminated grammar ends the request."""
        if req.matcher is None or req.finished:
            return
        if not req.matcher.accept_token(token):
            error = req.matcher.error()
            if error is not None:  # a parser limit: the grammar is too complex
                raise GrammarError(f"grammar too complex for the parser's limits: {error}")
            raise RuntimeError(f"token {token} violates the grammar its mask allowed")
        if req.matcher.is_terminated():
            # Complete, and nothing may follow: end as if the EOS came next.
            req.finish_reason = finish.stop(min(self.eos_token_ids))

    def jump_forward(self, req: Req) -> list[int]:
        """Append the tokens the grammar forces (exactly one allowed token at a time), then a
        canonical draft; `req.jumped` says whether an EXTEND must now compute them."""
        if req.finished or not jump_forward_enabled(req, self.disable_jump_forward):
            return []
        forced: list[int] = []
        row = np.empty(self.mask_words, np.int32)
        while len(forced) < MAX_JUMP_TOKENS and not req.finished:
            req.matcher.fill_bitmask(row)
            token = single_allowed_token(row)
            if token is None or token in self.eos_token_ids:
                break
            forced.append(token)
            req.output_ids.append(token)
            finish.check_finished(req, token, self.eos_token_ids)
            self.advance(req, token)
        if not req.finished:
            make_draft(req, self.mask_words)
        if forced or req.draft:
            req.jumped = not req.finished
        return forced

    def draft_logits(self, batch: list[tuple[Req, int]], result: StepResult,
                     runner: ModelRunner) -> dict[str, np.ndarray]:
        """Logits at the positions predicting each request's draft tokens, per rid."""
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
        logits = runner.row_logits(result.hidden, np.asarray(rows, np.int32))
        out, r = {}, 0
        for req, k in owners:
            out[req.rid] = logits[r : r + k]
            r += k
        return out
