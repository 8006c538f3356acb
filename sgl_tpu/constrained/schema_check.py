"""Does a JSON schema admit a finite document? A schema whose `$ref`s recurse without a base
case (`{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}`) only admits infinite ones: a
grammar built from it lets the model write `{"a":{"a":...` until `max_new_tokens`, so it is
refused up front with a message naming the cycle.

The check is a least fixpoint over the schema's sub-schemas: a sub-schema is *finite* when some
document satisfies it without recursing forever. Starting from "nothing is finite", rounds mark

    a leaf (no $ref, no required children) ........................... finite
    {"$ref": r} ...................................................... finite(r)
    anyOf / oneOf .................................................... any branch finite
    allOf ............................................................ every branch finite
    an object ........................................................ every required property
                                                                       with a schema finite
    an array ......................................................... minItems == 0, or its
                                                                       items schema finite

until nothing changes. Local `$ref`s (`#`, `#/...` JSON pointers) are followed; others are taken
as finite (the backend resolves or rejects them). Conservative: it only refuses what is surely
infinite under these rules.
"""

from __future__ import annotations

from typing import Any

from sgl_tpu.constrained.errors import GrammarError

_MAX_NODES = 100_000  # sub-schemas examined at most (larger schemas are left to the backend)


def check_schema_is_finite(schema: Any) -> None:
    """Raise GrammarError if `schema` (parsed JSON) admits only infinitely nested documents."""
    if not isinstance(schema, dict):
        return
    nodes = _collect(schema)
    if nodes is None:
        return
    finite: set[str] = set()
    changed = True
    while changed:
        changed = False
        for path, node in nodes.items():
            if path not in finite and _is_finite(node, path, nodes, finite):
                finite.add(path)
                changed = True
    if "#" not in finite:
        refs = sorted({str(nodes[p]["$ref"]) for p in nodes
                       if p not in finite and "$ref" in nodes[p]})[:3]
        where = f" (through {', '.join(map(repr, refs))})" if refs else ""
        raise GrammarError("invalid JSON schema: it recurses without a base case, so no finite "
                           f"document matches it{where}")


def _collect(schema: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Every sub-schema (dict) by its JSON pointer, e.g. "#/properties/a"."""
    nodes: dict[str, dict[str, Any]] = {}
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        if len(nodes) >= _MAX_NODES:
            return None
        nodes[path] = node
        for key, value in node.items():
            sub = f"{path}/{_escape(key)}"
            if isinstance(value, dict):
                stack.append((sub, value))
            elif isinstance(value, list):
                stack.extend((f"{sub}/{i}", v) for i, v in enumerate(value))
    return nodes


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _child(path: str, *keys: str | int) -> str:
    return path + "".join(f"/{_escape(str(k))}" for k in keys)


def _is_finite(node: dict[str, Any], path: str, nodes: dict[str, dict[str, Any]],
               finite: set[str]) -> bool:
    def ok(sub_path: str) -> bool:
        # Not a dict (true/false schemas, or a path outside the collected nodes): a leaf.
        return sub_path not in nodes or sub_path in finite

    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        target = ref.rstrip("/") if ref != "#" else "#"
        if target in nodes and target not in finite:
            return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            if not any(ok(_child(path, key, i)) for i in range(len(branches))):
                return False
    branches = node.get("allOf")
    if isinstance(branches, list):
        if not all(ok(_child(path, "allOf", i)) for i in range(len(branches))):
            return False
    props = node.get("properties")
    required = node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name in props and not ok(_child(path, "properties",
                                                                           name)):
                return False
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and min_items > 0:
        items = node.get("items")
        if isinstance(items, dict) and not ok(_child(path, "items")):
            return False
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            for i in range(min(min_items, len(prefix))):
                if not ok(_child(path, "prefixItems", i)):
                    return False
    return True
