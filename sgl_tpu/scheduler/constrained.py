"""Grammar-constrained decoding as the scheduler sees it (host side, no JAX).

Per request with a regex / JSON schema / EBNF constraint:

    add_request ──GrammarManager.request──► Future (compiled off-thread, cached by (kind, text))
    each step:  waiting request whose future is done ──► matcher, or a 400 if it failed
                before running it: matcher.fill_bitmask(row) ──► SeqStep.bitmask (device masks)
                after sampling:    matcher.accept_token(token); terminated ──► finish

Jump-forward: after a sampled token, while the mask allows exactly one token, that token is
appended without a decode step (the request then runs those tokens in one EXTEND). Any
sampler would pick the single allowed token, and the RNG is keyed by output position, so the
output is identical to decoding them one by one, greedy or sampled.
"""

from __future__ import annotations

import numpy as np

from sgl_tpu.constrained.base import GrammarError
from sgl_tpu.scheduler.req import Req

MAX_JUMP_TOKENS = 256  # bound on tokens appended by one jump-forward


def grammar_ready(req: Req) -> bool | str:
    """True when the request may be scheduled, False while its grammar compiles, or the error
    message when compilation failed."""
    fut = req.grammar_future
    if fut is None or req.matcher is not None:
        return True
    if not fut.done():
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
