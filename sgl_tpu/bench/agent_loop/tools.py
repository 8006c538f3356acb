"""The `tool-calls` workload's function tools: OpenAI tool definitions, call checks, results.

    Gen(tools=FUNCTION_TOOLS, tool_choice) --ChatDriver--> "tools"/"tool_choice" in the body
    streamed `delta.tool_calls` --ChatDriver.update--> StreamState.tool_calls ({id, name,
        arguments}) --check_call--> None (valid) or the reason it is not
    the next step's observation --tool_messages--> one `role: "tool"` message per call

A call is valid when its name is one of the offered functions and its arguments are a JSON
object that validates against that function's parameter schema (the schemas use nested objects,
enums, integer bounds and arrays, the features a grammar engine can get wrong).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema


def _function(name: str, description: str, properties: dict[str, Any],
              required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


FUNCTION_TOOLS: tuple[dict[str, Any], ...] = (
    _function("search", "Search an encyclopedia index; returns numbered snippets.",
              {"query": {"type": "string", "maxLength": 60},
               "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
              ["query"]),
    _function("calculator", "Evaluate an arithmetic expression.",
              {"expression": {"type": "string", "maxLength": 60}}, ["expression"]),
    _function("convert_units", "Convert a quantity between units.",
              {"quantity": {"type": "object", "properties": {
                  "value": {"type": "number"},
                  "unit": {"enum": ["km", "mile", "kg", "pound", "celsius", "fahrenheit"]}},
                  "required": ["value", "unit"], "additionalProperties": False},
               "to_unit": {"enum": ["km", "mile", "kg", "pound", "celsius", "fahrenheit"]}},
              ["quantity", "to_unit"]),
    _function("weather", "Historical weather for places and a year.",
              {"places": {"type": "array", "items": {"type": "string", "maxLength": 30},
                          "minItems": 1, "maxItems": 3},
               "year": {"type": "integer", "minimum": 1900, "maximum": 2025}},
              ["places", "year"]),
    _function("finish", "Give the final answer.",
              {"answer": {"type": "string", "maxLength": 100}}, ["answer"]),
)


def tool_names(tools: tuple[dict[str, Any], ...]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_call(call: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> str | None:
    """None when `call` ({"name", "arguments": JSON text}) is valid for `tools`, else why not."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    name = call.get("name")
    if name not in schemas:
        return f"unknown function {name!r}"
    try:
        args = json.loads(call.get("arguments") or "")
    except json.JSONDecodeError as e:
        return f"arguments are not JSON: {e}"
    if not isinstance(args, dict):
        return "arguments are not a JSON object"
    try:
        jsonschema.validate(args, schemas[name])
    except jsonschema.ValidationError as e:
        return f"arguments do not match the schema: {e.message}"
    return None


def _is_json(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return True


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn as a client sends it back: its text and its tool calls. Arguments
    that are not JSON (a call cut off by max_tokens) go back as `{}`, as an agent framework
    that could not run the call would send it (the call is counted invalid either way)."""
    return {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {
            "name": c["name"], "arguments": c["arguments"] if _is_json(c["arguments"]) else "{}"}}
        for c in calls]}


def tool_messages(calls: list[dict[str, Any]], observation: str) -> list[dict[str, Any]]:
    """One result per call: the first gets the observation, the others a short note (an error
    note for calls whose arguments were not JSON)."""
    out = []
    for i, c in enumerate(calls):
        if not _is_json(c["arguments"]):
            content = f"{c['name']}: error: the arguments were not valid JSON."
        else:
            content = observation if i == 0 else f"{c['name']}: no further results."
        out.append({"role": "tool", "tool_call_id": c["id"], "content": content})
    return out


def renderable(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages with tool calls/results as plain text turns (for prompt token counting only)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            content += json.dumps({"name": c["function"]["name"],
                                   "arguments": c["function"]["arguments"]})
        role = "user" if m["role"] == "tool" else m["role"]
        out.append({"role": role, "content": content})
    return out
