"""Streamed Responses API events from a stream of `chat.completion.chunk` dicts.

    chat chunks ──ResponseEvents.feed──► output-item events ──finish──► response.completed

The event sequence is the standard one: `response.created`, `response.in_progress`, then for
each output item `response.output_item.added`, its content events (a message:
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`; a function call: `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`; reasoning: `response.reasoning_text.delta`...,
`response.reasoning_text.done`), `response.output_item.done`, and last `response.completed`
(`response.incomplete` when `max_output_tokens` cut it short). One item is open at a time: a
new item (text after reasoning, a tool call after text) closes the previous one.

With log-probs asked for, a chunk's log-probs go out with its text delta (those of a chunk
that carries no text, and those of a chunk's tokens after its text, wait for the next text
delta; those of reasoning or call chunks, and
those no text follows, such as EOS or a trimmed stop string, are dropped), and the message's
`output_text` collects them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl_tpu.server.responses_protocol import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    token_span,
    usage,
)


class ResponseEvents:
    """Turns one choice's chat chunks into Responses events; `response` is the in-progress
    response object (no output yet), completed by `finish`; `count_reasoning` gives the
    reasoning tokens of the final output items."""

    def __init__(self, response: dict[str, Any],
                 count_reasoning: Callable[[list[dict[str, Any]]], int] | None = None) -> None:
        self.response = response
        self.count_reasoning = count_reasoning
        self._pending_logprobs: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []  # output items, final form once closed
        self._seq = 0
        self._open: int | None = None  # output index of the open item
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return event

    def _snapshot(self, status: str) -> dict[str, Any]:
        return {**self.response, "status": status, "output": list(self.items)}

    def start(self) -> list[dict[str, Any]]:
        snap = self._snapshot("in_progress")
        return [self._event("response.created", response=snap),
                self._event("response.in_progress", response=snap)]

    # ---- items -----------------------------------------------------------------------------
    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._open = len(self.items)
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=self._open,
                                  item={**item, "status": "in_progress"}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Finish the open item: its done events, then `output_item.done`."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        at = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            self._pending_logprobs = []  # tokens that wrote no text (EOS, a trimmed stop)
            events += [self._event("response.output_text.done", **at, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", **at, content_index=0,
                                   part=part)]
        elif item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **at,
                                      name=item["name"], arguments=item["arguments"]))
        elif item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", **at, content_index=0,
                                      text=item["content"][0]["text"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _open_item(self, kind: str) -> dict[str, Any] | None:
        if self._open is None or self.items[self._open]["type"] != kind:
            return None
        return self.items[self._open]

    def _message(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The open message item, opening one (with its content part) if needed."""
        item = self._open_item("message")
        if item is not None:
            return item, []
        item = message_item("", item_id=new_id("msg"))
        events = self._add({**item, "content": []})
        self.items[-1] = item
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=self._open, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        return item, events

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        item, events = self._message()
        # one decode step can write the last text and the EOS (or a trimmed stop): the tokens
        # after the delta's text wait, as tokens that wrote no text do, for text to come
        pending = self._pending_logprobs + logprobs
        span = token_span(pending, delta)
        cut = len(pending) if span is None else span[1]
        logprobs, self._pending_logprobs = pending[:cut], pending[cut:]
        item["content"][0]["text"] += delta
        item["content"][0]["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self._open, content_index=0, delta=delta,
                                  logprobs=logprobs))
        return events

    def _reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = []
        item = self._open_item("reasoning")
        if item is None:
            item = reasoning_item("")
            events += self._add({**item, "content": []})
            self.items[-1] = item
        item["content"][0]["text"] += delta
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self._open, content_index=0, delta=delta))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if index not in self._calls:
            item = function_call_item(call.get("id") or new_id("call"), fn.get("name") or "",
                                      "")
            events += self._add(item)
            self._calls[index] = self._open
        out = self._calls[index]
        item = self.items[out]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=out,
                                      delta=fn["arguments"]))
        return events

    # ---- chunks ----------------------------------------------------------------------------
    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(delta["content"], logprobs)
            elif "content" in delta and not delta.get("reasoning_content"):
                self._pending_logprobs += logprobs
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object."""
        events = self._close()
        if not self.items:  # an empty answer is still one (empty) message, as non-streamed
            events += self._message()[1] + self._close()
        incomplete = self._finish_reason == "length"
        final = self._snapshot("incomplete" if incomplete else "completed")
        reasoning = self.count_reasoning(self.items) if self.count_reasoning else 0
        final["usage"] = usage(self._usage, reasoning)
        if incomplete:
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=final))
        return events, final

    def failed(self, message: str, code: int) -> list[dict[str, Any]]:
        """An error mid-stream: an `error` event, then `response.failed`."""
        failed = self._ended("failed")
        failed["error"] = {"code": "server_error" if code >= 500 else "invalid_request",
                           "message": message}
        return [self._event("error", code=str(code), message=message, param=None),
                self._event("response.failed", response=failed)]

    # ---- snapshots of a background response ------------------------------------------------
    def status_event(self, kind: str, status: str) -> dict[str, Any]:
        """`response.created` / `response.queued` / `response.in_progress` with the response
        as it is now."""
        return self._event(kind, response=self.progress(status))

    def progress(self, status: str) -> dict[str, Any]:
        """The response so far (`queued` / `in_progress`): the output items written, the open
        one `in_progress`."""
        snap = self._snapshot(status)
        if self._open is not None:
            snap["output"][self._open] = {**self.items[self._open], "status": "in_progress"}
        return snap

    def cancelled(self) -> dict[str, Any]:
        """The response as a cancel left it: the output written so far, no usage."""
        return self._ended("cancelled")

    def _ended(self, status: str) -> dict[str, Any]:
        """A response that stopped before it finished: the open item `incomplete`."""
        snap = self._snapshot(status)
        if self._open is not None:
            snap["output"][self._open] = {**self.items[self._open], "status": "incomplete"}
        return snap
