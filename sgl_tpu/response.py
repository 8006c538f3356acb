"""Builds SGLang-shaped `/generate` results from a request's stream of `ReqStrOut`s, which
carry only what is new (text, ids, log-probs); the accumulator holds the request's totals.

Shared by the in-process `Engine` and the HTTP tokenizer manager, so both answer identically:

    {"text": ..., "output_ids": [...], "meta_info": {"id", "prompt_tokens", "completion_tokens",
     "cached_tokens", "finish_reason", "e2e_latency", [log-prob fields when asked]}}

and an embedding request (SGLang's `/encode`): `{"embedding": [...], "meta_info": {"id",
"prompt_tokens", "cached_tokens", "finish_reason", "e2e_latency"}}`, the vector as the scheduler
pooled it (`embedding_vector` truncates and normalizes it).

Log-prob entries are `[logprob, token_id, text_or_None]` (text when `return_text_in_logprobs`).
The dicts are cumulative; `incremental_logprobs` turns a stream of them into SGLang's streamed
form, where each chunk carries only its new output log-probs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sgl_tpu.messages import ReqStrOut

NORM_EPS = 1e-12  # a zero vector stays zero


class ResponseAccumulator:
    def __init__(
        self,
        rid: str,
        *,
        return_logprob: bool = False,
        return_text_in_logprobs: bool = False,
        decode_token: Callable[[int], str] | None = None,
    ) -> None:
        self.rid = rid
        self.return_logprob = return_logprob
        self._with_text = return_text_in_logprobs and decode_token is not None
        self._decode_token = decode_token
        self.start_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last: ReqStrOut | None = None
        self.text = ""  # output text so far
        self.output_ids: list[int] = []  # output ids so far
        self.output_token_logprobs: list[list[Any]] = []
        self.output_top_logprobs: list[Any] = []
        self.input_token_logprobs: list[list[Any]] | None = None
        self.input_top_logprobs: list[Any] | None = None
        self.embedding: list[float] | None = None  # an embedding request's pooled vector

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def update(self, out: ReqStrOut) -> None:
        if self.first_token_time is None and out.completion_tokens:
            self.first_token_time = time.perf_counter()
        self.last = out
        if out.text_cut >= 0:
            self.text = self.text[: out.text_cut]
        if out.new_text:
            self.text += out.new_text
        self.output_ids += out.new_output_ids
        if out.embedding is not None:
            self.embedding = out.embedding
        if not self.return_logprob:
            return
        if out.output_token_logprobs:
            self.output_token_logprobs += [self._entry(e) for e in out.output_token_logprobs]
        if out.output_top_logprobs:
            self.output_top_logprobs += [self._tops(t) for t in out.output_top_logprobs]
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = [self._entry(e) for e in out.input_token_logprobs]
            self.input_top_logprobs = [self._tops(t) for t in (out.input_top_logprobs or [])]

    def _entry(self, e: Sequence[Any]) -> list[Any]:
        lp, tid = e[0], e[1]
        return [lp, tid, self._decode_token(tid) if self._with_text else None]

    def _tops(self, tops: Sequence[Sequence[Any]] | None) -> list[list[Any]] | None:
        return None if tops is None else [self._entry(e) for e in tops]

    def to_dict(self) -> dict[str, Any]:
        o = self.last
        assert o is not None, "no output yet"
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens,
            "finish_reason": _public_reason(o.finish_reason) if o.finished else None,
            "e2e_latency": time.perf_counter() - self.start_time,
        }
        if self.embedding is not None:  # SGLang's /encode answer (no output tokens)
            del meta["completion_tokens"]
            return {"embedding": self.embedding, "meta_info": meta}
        # Copies of the growing lists: a streamed dict may wait (in a queue, or while the
        # response starts) while more tokens arrive, and its entries must match its text.
        if self.return_logprob:
            meta["input_token_logprobs"] = self.input_token_logprobs or []
            meta["output_token_logprobs"] = list(self.output_token_logprobs)
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
            meta["input_top_logprobs"] = self.input_top_logprobs or []
            meta["output_top_logprobs"] = list(self.output_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def embedding_vector(values: Sequence[float], dimensions: int | None = None,
                     normalize: bool = True) -> np.ndarray:
    """A pooled embedding's first `dimensions` values (all: None), divided by their L2 norm
    if `normalize`: f32[dimensions or D]."""
    v = np.asarray(values, np.float32)[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), NORM_EPS)
    return v


# Output-side log-prob lists that a streamed chunk carries only the new entries of.
_INCREMENTAL_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs")


def incremental_logprobs(result: dict[str, Any], num_sent: int) -> dict[str, Any]:
    """A streamed chunk of cumulative `result` whose output log-prob lists hold only the
    entries after the first `num_sent` (those went out in earlier chunks), as SGLang streams
    them; `output_token_logprobs_length` stays the running total, so that
    `len(chunk entries) == output_token_logprobs_length - previous length` for every chunk."""
    meta = result["meta_info"]
    if "output_token_logprobs" not in meta:
        return result
    meta = {**meta, **{k: meta[k][num_sent:] for k in _INCREMENTAL_LOGPROB_KEYS}}
    return {**result, "meta_info": meta}


def _public_reason(reason: dict[str, Any] | None) -> dict[str, Any] | None:
    if reason is None:
        return None
    return {k: v for k, v in reason.items() if k != "status_code"}


def error_status(out: ReqStrOut | None) -> tuple[int, str] | None:
    """(HTTP status, message) when the request was rejected, else None."""
    if out is None or not out.finish_reason or out.finish_reason.get("type") != "abort":
        return None
    code = out.finish_reason.get("status_code")
    return (code, out.finish_reason.get("message", "")) if code else None
