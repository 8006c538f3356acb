"""Request limits shared by the HTTP side (answers 400 before anything is queued) and the
scheduler (which re-checks, since the in-process Engine and other clients reach it directly)."""

from __future__ import annotations

from sgl_tpu.config import PRIORITY_RANGE
from sgl_tpu.messages import TokenizedGenerateReq
from sgl_tpu.sampling_params import SamplingParams

MAX_SESSION_ID_LEN = 256
# Prompts x samples of one HTTP request (each becomes a scheduler request): a bound, so one
# request cannot queue tens of thousands of generations ahead of everybody else.
MAX_BATCH_ITEMS = 1024


def check_batch_size(num_prompts: int, n: int = 1) -> str | None:
    """A message if a batch request asks for more than MAX_BATCH_ITEMS generations."""
    if num_prompts * n > MAX_BATCH_ITEMS:
        return (f"the request asks for {num_prompts} prompt(s) x n={n} generations; at most "
                f"{MAX_BATCH_ITEMS} per request")
    return None


def check_dimensions(dimensions: int | None, hidden_size: int) -> str | None:
    """A message if an embedding's `dimensions` (its first values kept) is out of range."""
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        return (f"dimensions must be in [1, {hidden_size}] (the model's hidden size), "
                f"got {dimensions}")
    return None


def check_session_id(session_id: object, field: str = "session_id") -> str | None:
    """A message naming the problem if `session_id` (a retention hint, see
    `KVManager.retain_prefix`; sent as the request's `field`) is malformed, else None."""
    if session_id is None:
        return None
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= MAX_SESSION_ID_LEN:
        got = (f"{len(session_id)} characters" if isinstance(session_id, str)
               else type(session_id).__name__)
        return f"{field} must be a string of 1 to {MAX_SESSION_ID_LEN} characters, got {got}"
    return None


def check_cache_control(session_id: object, priority: object, retention_seconds: object,
                        max_retention_s: float) -> str | None:
    """A message naming the problem with a request's cache-control fields, else None:
    `session_id` (see `check_session_id`), `priority` (an integer in PRIORITY_RANGE, or None),
    `retention_seconds` (seconds in [0, --max-retention-s])."""
    if (error := check_session_id(session_id)) is not None:
        return error
    lo, hi = PRIORITY_RANGE
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not lo <= priority <= hi):
        return f"priority must be an integer in [{lo}, {hi}], got {priority!r}"
    if (isinstance(retention_seconds, bool) or not isinstance(retention_seconds, int | float)
            or not 0 <= retention_seconds <= max_retention_s):
        return (f"retention_seconds must be a number of seconds in [0, {max_retention_s}] "
                f"(--max-retention-s), got {retention_seconds!r}")
    return None


def check_generate_fields(req: TokenizedGenerateReq, max_retention_s: float) -> str | None:
    """A message naming the problem with a request's fields beyond its prompt and sampling
    params (cache control, `program_id`), else None; the HTTP side and the scheduler both ask."""
    return (check_cache_control(req.session_id, req.priority, req.retention_seconds,
                                max_retention_s)
            or check_session_id(req.program_id, "program_id"))


def check_token_ids(name: str, ids: object, vocab_size: int) -> str | None:
    """A message if `ids` is not a list of token ids within the vocabulary, else None."""
    if not isinstance(ids, list | tuple) or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
            for t in ids):
        return f"{name} must be integers in [0, {vocab_size})"
    return None


def check_request(prompt_len: int, sampling: SamplingParams, *, context_len: int,
                  capacity_tokens: int, grammar_supported: bool, vocab_size: int
                  ) -> str | None:
    """A message naming the problem if the request can never be served, else None."""
    if (error := check_token_ids("stop_token_ids", sampling.stop_token_ids, vocab_size)):
        return error
    if prompt_len == 0:
        return "the prompt is empty"
    if prompt_len >= context_len:
        return f"the prompt has {prompt_len} tokens; the context length is {context_len}"
    total = prompt_len + sampling.max_new_tokens
    if total > context_len:
        return (f"prompt ({prompt_len} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"= {total} exceeds the context length {context_len}")
    if total > capacity_tokens:
        return (f"prompt + max_new_tokens = {total} tokens exceeds the KV cache capacity of "
                f"{capacity_tokens} tokens")
    if sampling.grammar is not None and not grammar_supported:
        return f"{sampling.grammar[0]} constraints are not supported by this server"
    return None
