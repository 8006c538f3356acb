"""When a request finishes and why: the stop conditions checked after every new token, and the
finish reasons in their wire format (what `ReqOutput.finish_reason` carries to the clients).

    {"type": "stop", "matched": <stop string | regex pattern | token id>}
    {"type": "length", "length": <max_new_tokens>}
    {"type": "abort", "message": <why>, "status_code": <HTTP status, when not a plain abort>}
"""

from __future__ import annotations

from collections.abc import Set
from typing import Literal, TypedDict

from sgl_tpu.detokenize import find_stop
from sgl_tpu.scheduler.req import Req


class FinishReason(TypedDict, total=False):
    type: Literal["stop", "length", "abort"]
    matched: str | int  # stop: the stop string, regex pattern or token id that matched
    length: int  # length: the max_new_tokens that was reached
    message: str  # abort: why
    status_code: int  # abort: the HTTP status the API answers with (400, 500)


def stop(matched: str | int) -> FinishReason:
    return {"type": "stop", "matched": matched}


def length(max_new_tokens: int) -> FinishReason:
    return {"type": "length", "length": max_new_tokens}


def abort(message: str, status_code: int | None = None) -> FinishReason:
    reason: FinishReason = {"type": "abort", "message": message}
    if status_code is not None:
        reason["status_code"] = status_code
    return reason


def check_finished(req: Req, token: int, eos_token_ids: Set[int]) -> None:
    """Set `req.finish_reason` if `token` (just appended to its output) ends it: a stop string
    or regex in the decoded tail, a stop/EOS id once min_new_tokens is reached, max tokens."""
    sp = req.sampling
    num_out = len(req.output_ids)
    if req.decoder is not None:
        delta = req.decoder.append([token])
        if delta:
            hit = find_stop(req.decoder.text, len(delta), sp.stop, sp.stop_regex)
            if hit is not None:
                req.stop_text_offset = -1 if sp.no_stop_trim else hit[0]
                req.finish_reason = stop(hit[1])
                return
    if num_out >= sp.min_new_tokens:
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids):
            req.finish_reason = stop(token)
            return
    if num_out >= sp.max_new_tokens:
        req.finish_reason = length(sp.max_new_tokens)
