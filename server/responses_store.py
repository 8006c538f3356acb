"""In-memory store of the Responses API's stored responses and their conversations.

Each stored response keeps the response object (for `GET /v1/responses/{id}`) and the items
its model saw (`input_items`, for `GET /v1/responses/{id}/input_items`; `responses_items.py`),
so that a request naming it as `previous_response_id` sends only its new items: its
conversation is those items and the response's output. The conversation id (the first response's
id) is the agent's `session_id`: the radix cache keeps the trajectory at eviction priority
between turns (`KVManager.retain_prefix`). A background response created with `stream` also
keeps its events (`GET /v1/responses/{id}?stream=true`).

Bounded two ways: at most `max_count` responses (the least recently used goes first) and each
for `ttl_s` seconds after it was last stored or read. Nothing survives a restart. Item
dicts are shared between a response and its successors (lists are copied, not items).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Responses API object, as returned
    input_items: list[dict[str, Any]]  # the items the model saw (no instructions, no output)
    conversation_id: str  # = session_id of every turn of this conversation
    expires_at: float
    # a background response created with `stream`: its events, for `GET ...?stream=true`
    events: list[dict[str, Any]] | None = None


class ResponseStore:
    def __init__(self, max_count: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_count < 1 or ttl_s <= 0:
            raise ValueError("max_count must be >= 1 and ttl_s > 0")
        self.max_count = max_count
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            conversation_id: str, events: list[dict[str, Any]] | None = None) -> None:
        self._expire()
        rid = response["id"]
        self._entries[rid] = StoredResponse(response, input_items, conversation_id,
                                            self._clock() + self.ttl_s, events)
        self._entries.move_to_end(rid)
        while len(self._entries) > self.max_count:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        """The stored response (its expiry renewed), or None if unknown, expired or evicted."""
        self._expire()
        entry = self._entries.get(rid)
        if entry is not None:
            entry.expires_at = self._clock() + self.ttl_s
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._entries.pop(rid, None) is not None

    def _expire(self) -> None:
        """Drop expired entries; renewals move entries to the end, so the front is oldest."""
        now = self._clock()
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[rid]
