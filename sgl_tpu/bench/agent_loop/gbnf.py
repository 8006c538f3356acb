"""JSON schema -> GBNF grammar, for the small schema subset the workloads use.

llama.cpp's /v1/completions takes no schema, only a GBNF `grammar`; this turns the tool-call
schema into one so the peer does the same constrained work there. Supported: objects whose
properties are all required (in `properties` order, no extras), string enums, and strings with
`maxLength`. Anything else raises ValueError rather than constraining less than asked.
"""

from __future__ import annotations

import json
from typing import Any

_STRING_CHAR = r'[^"\\\x7F\x00-\x1F]'


def _rule(schema: dict[str, Any], name: str, rules: dict[str, str]) -> str:
    if "enum" in schema:
        if not all(isinstance(v, str) for v in schema["enum"]):
            raise ValueError("gbnf: only string enums are supported")
        rules[name] = " | ".join(json.dumps(json.dumps(v)) for v in schema["enum"])
        return name
    kind = schema.get("type")
    if kind == "string":
        n = schema.get("maxLength")
        chars = f"{_STRING_CHAR}{{0,{int(n)}}}" if n is not None else f"{_STRING_CHAR}*"
        rules[name] = f'"\\"" {chars} "\\""'
        return name
    if kind == "object":
        props = schema.get("properties", {})
        if set(schema.get("required", [])) != set(props) or schema.get(
                "additionalProperties", True) is not False:
            raise ValueError("gbnf: objects need every property required and no extras")
        parts = ['"{" ws']
        for i, (key, sub) in enumerate(props.items()):
            sep = '"," ws ' if i else ""
            child = _rule(sub, f"{name}-{key.replace('_', '-')}", rules)
            parts.append(f'{sep}{json.dumps(json.dumps(key))} ws ":" ws {child} ws')
        parts.append('"}"')
        rules[name] = " ".join(parts)
        return name
    raise ValueError(f"gbnf: unsupported schema {schema!r}")


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    rules: dict[str, str] = {}
    _rule(schema, "value", rules)
    lines = ["root ::= value", *(f"{k} ::= {v}" for k, v in rules.items()), "ws ::= [ ]?"]
    return "\n".join(lines) + "\n"
