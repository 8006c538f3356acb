"""The JSON-bodied formats: hermes / qwen25 (`<tool_call>{json}</tool_call>`), llama3
(`<|python_tag|>{"name", "parameters"}` joined by `;`), mistral (`[TOOL_CALLS] [{...}, ...]`)."""

from __future__ import annotations

import json
import re
from typing import Any

from sgl_tpu.function_call.base import (
    Scan,
    ToolCall,
    ToolCallParser,
    call_from_json,
    json_value_end,
    loads,
    skip_ws,
)

# JSON inside a grammar: one layout (json.dumps' separators), so a weak model cannot pad it with
# whitespace forever and the text is fixed between values (jump-forward).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object",
                                                               "properties": {}}


_DEFS = ("$defs", "definitions")


def hoist_defs(schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema without its `$defs`/`definitions`, those). A schema nested in a bigger one
    keeps its `#/$defs/...` references working when its definitions move to the new root."""
    defs = {k: schema[k] for k in _DEFS if k in schema}
    return {k: v for k, v in schema.items() if k not in _DEFS}, defs


def call_object_schema(function: dict[str, Any], args_key: str) -> dict[str, Any]:
    """{"name": <this function>, args_key: <its parameters>}, in that order, nothing else."""
    params, defs = hoist_defs(parameters_schema(function))
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": JSON_LAYOUT, **defs}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema, ensure_ascii=False)


# `{"name": "f", "arguments": ` at the start of a call: from here the arguments can stream.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                   r'\s*"(?:arguments|parameters)"\s*:\s*')


class HermesParser(ToolCallParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    starts = ("<tool_call>",)
    trigger = "<tool_call>"
    opener = "<tool_call>\n"
    sep = "\n</tool_call>\n<tool_call>\n"
    closer = "\n</tool_call>"
    instructions = ("For each function call, return a json object with function name and "
                    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    _end = "</tool_call>"

    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        # the block ends at the first closing tag after its JSON object: a tag inside one of
        # the object's strings is text the model wrote there, not the block's end
        start = skip_ws(buf, len(self.starts[0]))
        search = start
        if buf[start:start + 1] == "{":
            obj_end = json_value_end(buf, start)
            if obj_end is None and not final:
                return None
            search = len(buf) if obj_end is None else obj_end
        end = buf.find(self._end, search)
        if end < 0 and not final:
            return None
        body = buf[len(self.starts[0]):end if end >= 0 else len(buf)]
        consumed = end + len(self._end) if end >= 0 else len(buf)
        try:
            call = call_from_json(loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return Scan(consumed, None if end >= 0 else ())  # cut off: dropped
        head = _HEAD.match(body)
        if head is not None and body[head.end():head.end() + 1] == "{":  # as streamed: raw
            raw = body[head.end():json_value_end(body, head.end())]
            call = ToolCall(call.name, raw)
        return Scan(consumed, (call,))

    def partial_call(self, buf: str) -> tuple[str, int] | None:
        body = len(self.starts[0])
        head = _HEAD.match(buf, body)
        if head is None or buf[head.end():head.end() + 1] != "{":
            return None
        try:
            return json.loads(f'"{head.group(1)}"'), head.end()
        except json.JSONDecodeError:
            return None

    def call_grammar(self, function: dict[str, Any]) -> str:
        return lark_json(call_object_schema(function, "arguments"))

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


class Qwen25Parser(HermesParser):
    name = "qwen25"


class Llama3Parser(ToolCallParser):
    """`<|python_tag|>{"name": "f", "parameters": {...}}; {...}`, or the JSON alone when it
    is the whole reply (Llama 3.1/3.2 JSON tool calling)."""

    name = "llama3"
    starts = ("<|python_tag|>", "{")
    trigger = "<|python_tag|>"
    opener = "<|python_tag|>"
    sep = "; "
    closer = ""
    instructions = ("To call a function, respond with <|python_tag|> followed by a JSON object "
                    '{"name": <function-name>, "parameters": <args-json-object>}; separate '
                    "several calls with \"; \".")

    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        if buf.startswith("{") and not at_start:
            return Scan(1)  # JSON in running text is text
        i = len(self.trigger) if buf.startswith(self.trigger) else 0
        calls: list[ToolCall] = []
        consumed = 0
        while True:
            i = skip_ws(buf, i)
            if i >= len(buf):
                if not final:
                    return None
                break
            if buf[i] != "{":
                break
            end = json_value_end(buf, i)
            if end is None:
                if not final:
                    return None
                if calls:
                    break
                return Scan(len(buf), () if buf.startswith(self.trigger) else None)
            try:
                call = call_from_json(loads(buf[i:end]), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return Scan(end)
            calls.append(call)
            consumed = i = end
            j = skip_ws(buf, i)
            if j >= len(buf) and not final:
                return None
            if j < len(buf) and buf[j] == ";":
                i = j + 1
                continue
            break
        return Scan(consumed, tuple(calls)) if calls else Scan(max(i, 1))

    def call_grammar(self, function: dict[str, Any]) -> str:
        return lark_json(call_object_schema(function, "parameters"))

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`."""

    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    trigger = "[TOOL_CALLS]"
    opener = "[TOOL_CALLS] ["
    sep = ", "
    closer = "]"
    instructions = ("To call functions, respond with [TOOL_CALLS] followed by a JSON list of "
                    '{"name": <function-name>, "arguments": <args-json-object>} objects.')

    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        i = skip_ws(buf, len(self.trigger))
        if i >= len(buf):
            return None if not final else Scan(len(buf), ())
        if buf[i] != "[":
            return Scan(i)
        end = json_value_end(buf, i)
        if end is None:
            return None if not final else Scan(len(buf), ())
        try:
            items = loads(buf[i:end])
        except json.JSONDecodeError:
            return Scan(end)
        calls = [call_from_json(x) for x in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls):
            return Scan(end)
        return Scan(end, tuple(calls))

    def call_grammar(self, function: dict[str, Any]) -> str:
        return lark_json(call_object_schema(function, "arguments"))

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
