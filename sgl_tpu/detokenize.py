"""Incremental detokenization and stop-string search, shared by the scheduler (which must see
stop strings to end a request) and the detokenizer process (which produces the text users get),
so both agree on every character offset.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_tpu.messages import ReqOutput, ReqStrOut

logger = logging.getLogger("sgl_tpu.detokenizer")

DecodeFn = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text

# A byte-level BPE token sequence that ends inside a UTF-8 character decodes to U+FFFD.
_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of token ids into text, never emitting half a UTF-8 character.

    Each call decodes only a short window: tokens from `prefix_offset` (context so that
    merging/spacing is right) to the end; text up to `read_offset` was already emitted.
    """

    def __init__(self, decode: DecodeFn, skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def append(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset], self._skip)
        full_text = self._decode(self.ids[self._prefix_offset :], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: emit whatever is left, even an incomplete character."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset], self._skip)
        full_text = self._decode(self.ids[self._prefix_offset :], self._skip)
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, new_len: int, stops: Sequence[str],
              stop_regex: Sequence[str] = ()) -> tuple[int, str] | None:
    """Earliest stop string or `stop_regex` match that ends inside the last `new_len`
    characters of `text`.

    Returns (offset where it begins, the stop string or pattern) or None. Only matches that
    reach into the new text count: older ones would have ended the request earlier. A pattern
    is searched over the whole text (a match may start anywhere), cached compiled by `re`.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    for pattern in stop_regex:
        m = re.search(pattern, text)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), pattern)
    return best


def stop_safe_len(text: str, stops: Sequence[str]) -> int:
    """Length of the prefix of `text` that no stop string can still claim: a streamed text
    holds back a tail that may turn out to be the start of a stop string (trimmed at the end)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return len(text) - hold


def error_str_out(rid: str, message: str, status_code: int) -> ReqStrOut:
    """A final output that ends request `rid` with an error status."""
    return ReqStrOut(rid=rid, new_text="", new_output_ids=[], finished=True,
                     finish_reason={"type": "abort", "message": message,
                                    "status_code": status_code},
                     prompt_tokens=0, completion_tokens=0, cached_tokens=0)


@dataclass
class _Stream:
    """One request's decoder and how much of its text went out already."""

    decoder: IncrementalDecoder
    sent_len: int = 0  # characters of the decoded text delivered in earlier messages


class DetokenizerState:
    """Per-request decoders: scheduler `ReqOutput`s (new token ids) -> `ReqStrOut`s (new text).

    The text a request has so far is `decoder.text` cut where it must not go out yet:

        decoder.text  |---- delivered ----|---- new_text ----|-- held --|
                      0                sent_len             end

    `end` is the whole text once finished (cut at a matched stop), else the text minus a tail
    that could still turn into a stop string (`stop_safe_len`; it never moves backwards). Only
    a final `end` can fall before `sent_len` (a `stop_regex` match in delivered text): then the
    message says `text_cut=end`.

    Runs in the detokenizer process for the server and inline for the in-process `Engine`.
    """

    def __init__(self, decode: DecodeFn) -> None:
        self._decode = decode
        self._streams: dict[str, _Stream] = {}

    def process(self, outputs: Sequence[ReqOutput]) -> list[ReqStrOut]:
        """One `ReqStrOut` per output; an exception while decoding one request ends that
        request with an error (500) and leaves the others alone."""
        result = []
        for o in outputs:
            try:
                result.append(self._one(o))
            except Exception as e:
                logger.error("request %s ended: detokenization failed", o.rid, exc_info=e)
                self._streams.pop(o.rid, None)
                result.append(error_str_out(o.rid, f"internal error while detokenizing "
                                                   f"({type(e).__name__})", 500))
        return result

    def _one(self, o: ReqOutput) -> ReqStrOut:
        stream = self._streams.get(o.rid)
        if stream is None:
            stream = self._streams[o.rid] = _Stream(
                IncrementalDecoder(self._decode, o.skip_special_tokens))
        dec = stream.decoder
        ids = o.new_token_ids
        matched = (o.finish_reason or {}).get("matched")
        if o.finished and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]  # a matched stop token is not part of the text
        dec.append(ids)
        if o.finished:
            dec.flush()
            end = len(dec.text)
            if o.stop_text_offset >= 0:
                end = min(end, o.stop_text_offset)
            del self._streams[o.rid]
        elif o.stop_strs:
            end = max(stop_safe_len(dec.text, o.stop_strs), stream.sent_len)
        else:
            end = len(dec.text)
        text_cut = -1
        if end < stream.sent_len:
            text_cut, new_text = end, ""
        else:
            new_text = dec.text[stream.sent_len : end]
        stream.sent_len = end
        return ReqStrOut(
            rid=o.rid, new_text=new_text, new_output_ids=o.new_token_ids,
            finished=o.finished, finish_reason=o.finish_reason, prompt_tokens=o.prompt_tokens,
            completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens,
            text_cut=text_cut, output_token_logprobs=o.output_token_logprobs,
            output_top_logprobs=o.output_top_logprobs,
            input_token_logprobs=o.input_token_logprobs,
            input_top_logprobs=o.input_top_logprobs, embedding=o.embedding)
