"""The non-JSON formats: pythonic (`[f(a=1, b="x"), g()]`, Llama 4 / Llama 3.2 small) and
qwen3_coder (`<tool_call>\\n<function=f>\\n<parameter=a>\\n1\\n</parameter>\\n</function>\\n
</tool_call>`). Argument values come back as JSON (typed by the function's schema for
qwen3_coder, whose values are raw text)."""

from __future__ import annotations

import ast
import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from sgl_tpu.function_call.base import (
    Scan,
    ToolCall,
    ToolCallParser,
    bracket_end,
    dump_args,
    loads,
)
from sgl_tpu.function_call.json_formats import (
    JSON_LAYOUT,
    hoist_defs,
    lark_json,
    parameters_schema,
)

_PY_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\(")
_PY_NAMES = {"true": True, "false": False, "null": None}


def _py_value(node: ast.expr, src: str) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:  # JSON literals are accepted too
        return _PY_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_py_value(e, src) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k, src): _py_value(v, src)
                for k, v in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)
    if isinstance(value, float):  # exact, as JSON would write it (1e999 is not Infinity)
        value = Decimal(ast.get_source_segment(src, node) or repr(value))
    return value


def _bracket_end(s: str) -> int | None:
    """End (exclusive) of the [...] at s[0], skipping Python string literals; None: unclosed."""
    return bracket_end(s, quotes="'\"", opening="[({", closing="])}")


class PythonicParser(ToolCallParser):
    name = "pythonic"
    starts = ("[",)
    trigger = "["
    opener = "["
    sep = ", "
    closer = "]"
    instructions = ("To call functions, respond with a Python list of calls with keyword "
                    'arguments only, e.g. [get_weather(city="Paris"), get_time()].')

    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        if not _PY_START.match(buf):
            # "[", "[ ", "[ab" could still become "[name(": wait, unless no more text comes
            if not final and re.fullmatch(r"\[\s*([A-Za-z_][\w.]*)?", buf):
                return None
            return Scan(1)
        end = _bracket_end(buf)
        if end is None:
            return None if not final else Scan(len(buf), ())
        try:
            tree = ast.parse(buf[:end], mode="eval").body
            calls = []
            for node in tree.elts:  # type: ignore[attr-defined]
                if not isinstance(node, ast.Call) or node.args \
                        or any(k.arg is None for k in node.keywords):
                    return Scan(end)
                args = {k.arg: _py_value(k.value, buf[:end]) for k in node.keywords}
                calls.append(ToolCall(ast.unparse(node.func), dump_args(args)))
        except (SyntaxError, ValueError, TypeError, AttributeError, InvalidOperation,
                MemoryError, RecursionError):
            return Scan(end)
        return Scan(end, tuple(calls)) if calls else Scan(end)

    def call_grammar(self, function: dict[str, Any]) -> str:
        # Every property, in schema order, as name=<JSON value> (JSON literals are accepted
        # by the parser, so a value valid against its schema always parses back).
        args = _param_items(function, lambda p, s: f"{_lit(p + '=')} {lark_json(s)}", ' ", " ')
        return f'{_lit(function["name"] + "(")} {args} ")"'

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        return f"{name}({inner})"


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _param_items(function: dict[str, Any], item, joiner: str) -> str:
    """Each parameter's grammar (its schema carries the function's `$defs`), joined."""
    params, defs = hoist_defs(parameters_schema(function))
    props = params.get("properties") or {}
    parts = [item(p, {**s, **defs, "x-guidance": JSON_LAYOUT} if isinstance(s, dict) else s)
             for p, s in props.items()]
    return joiner.join(parts) if parts else '""'


def _qwen_value(raw: str, schema: dict[str, Any] | None) -> Any:
    if (schema or {}).get("type") == "string":
        return raw
    try:
        return loads(raw)
    except json.JSONDecodeError:
        return raw


_FUNC = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    starts = ("<tool_call>",)
    trigger = "<tool_call>"
    opener = "<tool_call>\n"
    sep = "\n</tool_call>\n<tool_call>\n"
    closer = "\n</tool_call>"
    instructions = ("For each function call, write:\n<tool_call>\n<function=NAME>\n"
                    "<parameter=PARAM>\nVALUE\n</parameter>\n</function>\n</tool_call>")
    _end = "</tool_call>"

    def scan(self, buf: str, final: bool, tools: dict[str, dict[str, Any]],
             at_start: bool) -> Scan | None:
        end = buf.find(self._end)
        if end < 0 and not final:
            return None
        consumed = end + len(self._end) if end >= 0 else len(buf)
        m = _FUNC.match(buf[len(self.trigger):end if end >= 0 else len(buf)])
        if m is None:
            return Scan(consumed, None if end >= 0 else ())
        name = m.group(1).strip()
        props = (parameters_schema(tools.get(name, {})).get("properties") or {})
        args = {p.strip(): _qwen_value(v, props.get(p.strip()))
                for p, v in _PARAM.findall(m.group(2))}
        return Scan(consumed, (ToolCall(name, dump_args(args)),))

    def call_grammar(self, function: dict[str, Any]) -> str:
        def item(p: str, s: dict[str, Any]) -> str:
            if s.get("type") == "string" and "enum" not in s:
                value = "/[^<]*/"  # raw text; the parser keeps it as a string
            elif "enum" in s and all(isinstance(v, str) for v in s["enum"]):
                value = "(" + " | ".join(json.dumps(v) for v in s["enum"]) + ")"
            else:
                value = lark_json(s)
            opener = _lit(f"<parameter={p}>" + "\n")
            return f'{opener} {value} "\\n</parameter>\\n"'

        head = _lit(f"<function={function['name']}>\n")
        return f'{head} {_param_items(function, item, " ")} "</function>"'

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                         "</parameter>\n" for k, v in arguments.items())
        return f"<function={name}>\n{params}</function>"
