"""A Responses conversation as items: the stored form, `input_items` pages, truncation cuts.

A stored response keeps the items its model saw (`input_items`: the earlier turns' input and
output items, then its own input) beside its output, each an item resource with an `id`:

    turn 1 input        [user msg]                          ─┐ input_items of response 1
    turn 1 output       [reasoning, message]                 │
    turn 2 input        [user msg]                          ─┴ input_items of response 2
    turn 2 output       [function_call]
    turn 3 input        [function_call_output]              ... input_items of response 3

The chat messages of a turn are `items_to_messages(input_items)` (reasoning items dropped).
`truncation: "auto"` drops a prefix of the earlier turns' items, cut only where a user message
starts (or at the new input), and never between a function call and its output.
"""

from __future__ import annotations

from typing import Any

from sgl_tpu.server.responses_protocol import new_id
from sgl_tpu.server.tokenizer_manager import RequestError

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}
MAX_PAGE_ITEMS = 100  # as OpenAI
DEFAULT_PAGE_ITEMS = 20


def input_item_resources(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` (already checked by `items_to_messages`) as item resources: each
    with an `id` and a `status`, message text as content parts."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        resource = {**item, "type": kind}
        resource.setdefault("id", new_id(_ID_PREFIXES.get(kind, "item")))
        if kind != "reasoning":
            resource.setdefault("status", "completed")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            resource["content"] = [{"type": part, "text": item["content"]}]
        out.append(resource)
    return out


def truncation_cuts(items: list[dict[str, Any]], num_prior: int) -> list[int]:
    """Where the conversation may start when its oldest items are dropped, fewest dropped
    first: before a user message of the earlier turns, and at the new input (`num_prior`),
    but never between a function call and its output."""
    split = [0] * (len(items) + 1)  # split[c] > 0: a cut at c separates a call from its output
    call_at = {}
    for i, item in enumerate(items):
        if item.get("type") == "function_call":
            call_at[item.get("call_id")] = i
        elif item.get("type") == "function_call_output" and item.get("call_id") in call_at:
            split[call_at[item["call_id"]] + 1] += 1
            split[i + 1] -= 1
    cuts, open_calls = [], 0
    for cut in range(1, num_prior + 1):
        open_calls += split[cut]
        item = items[cut]
        starts_turn = item.get("type", "message") == "message" and item.get("role") == "user"
        if open_calls == 0 and (starts_turn or cut == num_prior):
            cuts.append(cut)
    return cuts


def page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of `GET /v1/responses/{id}/input_items` (query: `after`, `limit`, `order`),
    in OpenAI's list shape; RequestError (400) for a bad parameter."""
    order = query.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be 'asc' or 'desc', got {order!r}")
    raw_limit = query.get("limit")
    limit = DEFAULT_PAGE_ITEMS
    if raw_limit is not None:
        if not raw_limit.strip().isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE_ITEMS:
            raise RequestError(f"limit must be an integer in [1, {MAX_PAGE_ITEMS}], "
                               f"got {raw_limit[:40]!r}")
        limit = int(raw_limit)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise RequestError(f"after: no input item {after[:100]!r} in this response")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}
