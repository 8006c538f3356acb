"""The output side of a chat request: the model's text split into reasoning, content and tool
calls, as the OpenAI `message` (non-streaming) or `delta`s (streaming).

    final_message(plan, text)          -> (message dict, has tool calls)
    ChatOutput(plan).feed(delta)/.finish() -> [delta dict]   reasoning_content / content /
                                                            tool_calls (index, id, name, then
                                                            argument fragments)
"""

from __future__ import annotations

import uuid
from typing import Any

from sgl_tpu.function_call import CallDelta, Text, ToolCall, ToolCallStream, parse_tool_calls
from sgl_tpu.reasoning_parser import ReasoningSplitter, split_reasoning
from sgl_tpu.server.openai_tools import ChatPlan


def call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        d["index"] = index
    return d


def final_message(plan: ChatPlan, text: str) -> tuple[dict[str, Any], bool]:
    """(the `message` of a finished choice, whether it holds tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.reasoning is not None:
        reasoning, text = split_reasoning(text, plan.in_reasoning)
        message["reasoning_content"] = reasoning
        message["content"] = text.strip()
    if plan.parser is not None:
        content, calls = parse_tool_calls(plan.parser, text, plan.functions)
        message["content"] = content.strip() or None
        if calls:
            message["tool_calls"] = [call_dict(c) for c in calls]
            return message, True
    return message, False


class ChatOutput:
    """Streaming: text deltas in, OpenAI `delta` dicts out (reasoning, content, tool calls).

    Content is trimmed as in the non-streaming message when tools or reasoning are parsed:
    leading whitespace dropped, trailing whitespace held until more text follows it.
    """

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._split = ReasoningSplitter(plan.in_reasoning) if plan.reasoning else None
        self._calls = ToolCallStream(plan.parser, plan.functions) if plan.parser else None
        self._trim = self._split is not None or self._calls is not None
        self._started = False
        self._ws = ""
        self._reasoning_started = False
        self._reasoning_ws = ""
        self._open_args: str | None = None  # arguments streamed of the call being written
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._split is not None:
            r, text = self._split.feed(text, final)
            if r:
                out += self._reasoning(r)
        events: list[Any] = [Text(text)] if text else []
        if self._calls is not None:
            events = self._calls.feed(text) + (self._calls.finish() if final else [])
        for e in events:
            if isinstance(e, CallDelta):
                if e.name is not None:  # a call opens: its id and name go first
                    self._open_args = ""
                    out.append(self._start(e.name))
                elif e.arguments:
                    self._open_args += e.arguments
                    out.append(self._args(e.arguments))
            elif isinstance(e, ToolCall):
                if self._open_args is None:
                    out.append(self._start(e.name))
                    sent = ""
                else:
                    sent, self._open_args = self._open_args, None
                rest = e.arguments[len(sent):] if e.arguments.startswith(sent) else ""
                if rest:
                    out.append(self._args(rest))
            else:
                out += self._content(e.text)
        return out

    def _start(self, name: str) -> dict[str, Any]:
        self.num_calls += 1
        d = call_dict(ToolCall(name, ""), self.num_calls - 1)
        return {"tool_calls": [d]}

    def _args(self, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.num_calls - 1,
                                "function": {"arguments": fragment}}]}

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("", final=True)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not self._trim:
            return [{"content": text}] if text else []
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return [{"content": body}] if body else []

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return []
            self._reasoning_started = True
        text = self._reasoning_ws + text
        body = text.rstrip()
        self._reasoning_ws = text[len(body):]
        return [{"reasoning_content": body}] if body else []
