"""Grammars for tool calls and for output after a reasoning block, as llguidance Lark text
(sent through the `ebnf` grammar kind, which llguidance reads as Lark).

    tool_call_grammar(parser, functions, mode="required", parallel=True)
        start: "<tool_call>\\n" call ("\\n</tool_call>\\n<tool_call>\\n" call)* "\\n</tool_call>"
        call:  f_0 | f_1 | ...       each admits one function's name + schema-valid arguments
    tool_call_grammar(..., mode="auto")
        start: TEXT | trig "\\n" call (...)* "\\n</tool_call>"
        trig[lazy]: TEXT "<tool_call>"   free text until the model writes the trigger; from
                                         there on the call is constrained like "required"
    reasoning="inside" puts `think[lazy]: TEXT "</think>"` first (the output starts inside a
    reasoning block), "optional" puts `("<think>" think)?` first (the model may open one): the
    constraint starts once the reasoning block closes.

The format pieces (opener / sep / closer / trigger / one call) come from the parser, so the
grammar and the parser describe the same text. Objects that list `properties` (even none) but say
nothing of `additionalProperties` are closed in the grammar (a subset of what the schema
allows, so still valid), which keeps a weak model from inventing keys forever.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sgl_tpu.function_call import ToolCallParser

THINK_START, THINK_END = "<think>", "</think>"

_TEXT = "TEXT: /(.|\\n)*/"


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False) if s else '""'


def close_objects(schema: Any) -> Any:
    """A copy of `schema` whose objects with `properties` get additionalProperties: false
    unless they say otherwise."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) \
            and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _closed(function: dict[str, Any]) -> dict[str, Any]:
    f = copy.copy(function)
    if isinstance(f.get("parameters"), dict):
        f["parameters"] = close_objects(f["parameters"])
    return f


Reasoning = Literal["inside", "optional"] | None


def _prefix(reasoning: Reasoning) -> tuple[str, list[str]]:
    """"inside": the output starts in the block; "optional": the model may open one."""
    if reasoning is None:
        return "", []
    rule = [f"think[lazy]: TEXT {_lit(THINK_END)}"]
    if reasoning == "inside":
        return "think ", rule
    return f"({_lit(THINK_START)} think)? ", rule


def tool_call_grammar(parser: ToolCallParser, functions: list[dict[str, Any]], *,
                      mode: Literal["required", "auto"], parallel: bool,
                      reasoning: Reasoning = None) -> str:
    """Lark text admitting calls of `functions` in `parser`'s format (see the module doc)."""
    if not functions:
        raise ValueError("no functions to call")
    rules = [f"f_{i}: {parser.call_grammar(_closed(f))}" for i, f in enumerate(functions)]
    rules.append("call: " + " | ".join(f"f_{i}" for i in range(len(functions))))
    more = f" ({_lit(parser.sep)} call)*" if parallel else ""
    calls = f"call{more} {_lit(parser.closer)}"
    prefix, extra = _prefix(reasoning)
    if mode == "required":
        ws = " /\\n{0,2}/ " if reasoning else " "
        start = f"start: {prefix}{ws}{_lit(parser.opener)} {calls}"
    else:
        rest = parser.opener[len(parser.trigger):]
        start = f"start: {prefix}(TEXT | trig {_lit(rest)} {calls})"
        extra.append(f"trig[lazy]: TEXT {_lit(parser.trigger)}")
    return "\n".join(["%llguidance {}", start, *extra, *rules, _TEXT]) + "\n"


def json_after_reasoning(schema: dict[str, Any], reasoning: Reasoning) -> str:
    """Lark text: a reasoning block (see `_prefix`), then one JSON value of `schema`."""
    from sgl_tpu.function_call.json_formats import JSON_LAYOUT

    schema = {**schema, "x-guidance": JSON_LAYOUT}
    prefix, extra = _prefix(reasoning)
    return "\n".join(["%llguidance {}", f"start: {prefix}/\\n{{0,2}}/ json", *extra,
                      "json: %json " + json.dumps(schema, ensure_ascii=False), _TEXT]) + "\n"
