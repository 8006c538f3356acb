"""Streamed Anthropic Messages events from a stream of `chat.completion.chunk` dicts.

    chat chunks (usage in every chunk) ──MessageEvents.feed──► content block events
                                       ──finish──► message_delta, message_stop

The sequence is Anthropic's: `message_start` (the message with empty content and the prompt's
usage), `ping`, then per content block `content_block_start`, its `content_block_delta`s
(`thinking_delta`, `text_delta`, or `input_json_delta` whose `partial_json` fragments
concatenate to the call's input), `content_block_stop`; last `message_delta` (stop_reason,
stop_sequence, the final usage) and `message_stop`. One block is open at a time: reasoning
after text, text after a call or a new call closes the open block. An error after the stream
has started is an `error` event (Anthropic's error body).
"""

from __future__ import annotations

from typing import Any

from sgl_tpu.server.anthropic_protocol import stop_reason, tool_use_id, usage
from sgl_tpu.server.http_common import anthropic_error_body


class MessageEvents:
    """Turns one choice's chat chunks into Messages stream events; `message` is the message
    object without content, stop reason or usage (filled from the chunks)."""

    def __init__(self, message: dict[str, Any], stop_sequences: list[str] | None) -> None:
        self.message = message
        self.stop_sequences = stop_sequences
        self._index = -1  # index of the last block opened
        self._open: str | None = None  # its type while it is open
        self._usage: dict[str, Any] | None = None
        self._finish: tuple[str | None, Any] = (None, None)

    def start(self, first: dict[str, Any] | None) -> list[dict[str, Any]]:
        if first is not None and first.get("usage"):
            self._usage = first["usage"]
        start = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": usage(self._usage)}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    # ---- blocks ----------------------------------------------------------------------------
    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._index += 1
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": self._index,
                       "content_block": block})
        return events

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "content_block_delta", "index": self._index,
                 "delta": {"type": kind, **delta}}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self._open == "text" else self._begin({"type": "text", "text": ""})
        return events + self._delta("text_delta", {"text": text})

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        events = [] if self._open == "thinking" else self._begin(
            {"type": "thinking", "thinking": "", "signature": ""})
        return events + self._delta("thinking_delta", {"thinking": text})

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        fn = call.get("function") or {}
        if call.get("id"):  # a call opens: its id and name come first
            events += self._begin({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": fn.get("name") or "", "input": {}})
        if fn.get("arguments") and self._open == "tool_use":
            events += self._delta("input_json_delta", {"partial_json": fn["arguments"]})
        return events

    # ---- chunks ----------------------------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._thinking(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish = (choice["finish_reason"], choice.get("matched_stop"))
        return events

    def finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if self._index < 0:  # an empty answer is still one (empty) text block, as non-streamed
            events += self._begin({"type": "text", "text": ""}) + self._close()
        reason, sequence = stop_reason(*self._finish, self.stop_sequences)
        events += [{"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(self._usage)},
                   {"type": "message_stop"}]
        return events

    def failed(self, message: str, status_code: int) -> list[dict[str, Any]]:
        return [anthropic_error_body(message, status_code)]
