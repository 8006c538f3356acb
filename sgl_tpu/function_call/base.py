"""Tool-call parsers: model text -> OpenAI tool calls, one parser per output format.

A parser knows three things about its format:

    starts / scan(buf, final, tools)    where a call region may begin, and what a region that
                                        begins at buf[0] holds: calls, plain text, or "need more"
    opener / sep / closer / call_grammar   the same format as a Lark grammar (constrained decoding)
    tools_prompt / render_calls         the format described to (and written for) the model

`ToolCallStream` drives `scan` incrementally: text is fed in arbitrary chunks, and it emits
plain text as soon as it cannot be the beginning of a call, and each call once its markup is
complete. `parse_tool_calls` is the non-streaming path: the whole text in one pass with
`final=True` (the same scanning rules, so both paths agree by construction; the tests check it
on arbitrary chunk splits).

    feed("Sure. <tool_") -> [Text("Sure. ")]            "<tool_" held back: could be a marker
    feed('call>\n{"name": "f", "arguments": {}}\n</tool_call>') -> [Call(f, "{}")]

A region whose markup is malformed, or that names a function that was not offered, is plain
text (as SGLang's parsers do), so a returned call always names an offered function. A region
the output ends inside (cut off by max_tokens) that does not parse is dropped: call markup never
shows up as content. So is the start of a marker the output ends on after a call ("<tool_":
the next call, cut off); before any call such an ending stays text (an answer may end in "<").
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (compact separators, non-ASCII kept)


@dataclass(frozen=True)
class Scan:
    """What a region starting at buf[0] holds over `consumed` chars: `calls`, or None (plain
    text), or () (dropped: call markup cut off by the end of the output, e.g. max_tokens)."""

    consumed: int
    calls: tuple[ToolCall, ...] | None = None


def loads(text: str) -> Any:
    """json.loads keeping numbers exact (a huge exponent stays a number, not Infinity); too
    deep nesting is a JSONDecodeError too."""
    try:
        return json.loads(text, parse_float=Decimal)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def dump_args(args: Any) -> str:
    """JSON text of parsed arguments; Decimals are written as the numbers they are."""
    if isinstance(args, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {dump_args(v)}"
                               for k, v in args.items()) + "}"
    if isinstance(args, (list, tuple)):
        return "[" + ", ".join(dump_args(v) for v in args) + "]"
    if isinstance(args, Decimal):
        return str(args) if args.is_finite() else "null"
    if isinstance(args, float) and not math.isfinite(args):
        return "null"
    return json.dumps(args, ensure_ascii=False)


def bracket_end(s: str, i: int = 0, *, quotes: str = '"', opening: str = "{[",
                closing: str = "}]") -> int | None:
    """End (exclusive) of the bracketed value starting at s[i], by bracket balance outside
    string literals (delimited by any of `quotes`, backslash escapes); None if the text ends
    first."""
    depth, quote, esc = 0, None, False
    for j in range(i, len(s)):
        c = s[j]
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = None
        elif c in quotes:
            quote = c
        elif c in opening:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def json_value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON object/array starting at s[i] ('{' or '['); None if the
    text ends first."""
    return bracket_end(s, i)


def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} -> ToolCall (None if not that shape)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], dump_args(args))


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


class ToolCallParser(ABC):
    """One tool-call format. Subclasses set the class attributes and implement `scan` and
    `call_grammar`; everything else derives from them."""

    name: str
    starts: tuple[str, ...]   # a call region may begin where one of these appears
    trigger: str              # the prefix that opens calls in free text (lazy grammar trigger)
    opener: str               # grammar: region = opener call (sep call)* closer
    sep: str
    closer: str
    instructions: str         # how to call, for the injected system-prompt block

    @abstractmethod
    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        """The region at buf[0] (buf starts with one of `starts`); None: more text needed
        (never when `final`). `tools`: name -> function dict; `at_start`: no text before."""

    @abstractmethod
    def call_grammar(self, function: dict[str, Any]) -> str:
        """A Lark expression for one call of `function` (between opener/sep/closer) that
        admits only its name and arguments valid against its parameters schema."""

    @abstractmethod
    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it (without opener/closer)."""

    def partial_call(self, buf: str) -> tuple[str, int] | None:
        """For a region still open at buf[0]: (function name, offset where its arguments
        object starts in buf) once both are known, so the arguments can stream as the model
        writes them; None when the format does not stream arguments (the call is then sent
        when complete). A format that returns this must return the raw argument text as
        `ToolCall.arguments` for the completed call."""
        return None

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return self.opener + self.sep.join(self.render_call(n, a) for n, a in calls) \
            + self.closer

    def tools_prompt(self, functions: list[dict[str, Any]]) -> str:
        """The system-prompt block that describes the tools when the template does not."""
        lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                          for f in functions)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{lines}\n</tools>\n\n{self.instructions}")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """Part of a call still being written: `name` on its first delta, then argument text."""

    name: str | None
    arguments: str


Event = Text | CallDelta | ToolCall


class ToolCallStream:
    """Incremental parsing: `feed(chunk)` / `finish()` -> list of events.

    Every call ends with its ToolCall event. Formats with `partial_call` also stream it as it is
    written: CallDelta(name, "") then CallDelta(None, fragment)...; the completed call's
    arguments then start with the fragments sent (its rest follows the ToolCall). A call cut
    off by the end of the output leaves only its CallDeltas.
    """

    def __init__(self, parser: ToolCallParser, functions: list[dict[str, Any]]) -> None:
        self.parser = parser
        self.tools = {f["name"]: f for f in functions}
        self._buf = ""
        self._at_start = True
        self._called = False  # a call was emitted
        self._sent: int | None = None  # argument chars streamed of the open call

    def feed(self, chunk: str) -> list[Event]:
        self._buf += chunk
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _stream_partial(self, out: list) -> None:
        partial = self.parser.partial_call(self._buf)
        if partial is None or partial[0] not in self.tools:
            return
        name, start = partial
        if self._sent is None:
            out.append(CallDelta(name, ""))
            self._sent = 0
        end = json_value_end(self._buf, start) or len(self._buf)
        piece = self._buf[start + self._sent:end]
        if piece:
            out.append(CallDelta(None, piece))
            self._sent += len(piece)

    def _emit_text(self, out: list, n: int) -> None:
        text, self._buf = self._buf[:n], self._buf[n:]
        if text:
            out.append(Text(text))
            if text.strip():
                self._at_start = False

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            found = [p for p in (self._buf.find(m) for m in self.parser.starts) if p >= 0]
            if not found:
                keep = partial_marker_len(self._buf, self.parser.starts)
                if final and not self._called:
                    keep = 0  # plain text that happens to end like a marker's start
                self._emit_text(out, len(self._buf) - keep)
                if final:
                    self._buf = ""  # after a call: the next one's marker, cut off
                break
            pos = min(found)
            if pos:
                self._emit_text(out, pos)
            scan = self.parser.scan(self._buf, final, self.tools, self._at_start)
            if scan is None:
                self._stream_partial(out)
                break
            self._sent = None
            calls = scan.calls
            if calls == ():
                self._buf = self._buf[scan.consumed:]
                continue
            if calls is not None and any(c.name not in self.tools for c in calls):
                calls = None  # a function that was not offered: not a call
            if calls is None:
                self._emit_text(out, max(scan.consumed, 1))
            else:
                out.extend(calls)
                self._buf = self._buf[scan.consumed:]
                self._at_start = False
                self._called = True
        return out


def partial_marker_len(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if m.startswith(buf[-k:]):
                best = k
                break
    return best


def parse_tool_calls(parser: ToolCallParser, text: str, functions: list[dict[str, Any]]
                     ) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (text outside the calls, the calls)."""
    stream = ToolCallStream(parser, functions)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    return content, [e for e in events if isinstance(e, ToolCall)]
