"""Cache control for agents through a real server (the default model, a 32-page KV pool, the
priority eviction policy): an open session's trajectory survives traffic that evicts everything
else and is evictable again once closed; low-priority KV goes before high-priority KV; the
session endpoints' errors. Unit tests of the same rules: tests/test_session_retention.py."""

from __future__ import annotations

import random

import pytest

FLAGS = ("--skip-warmup", "--page-size", "16", "--max-total-tokens", "512",
         "--radix-eviction-policy", "priority", "--session-retention-s", "0")
SP = {"temperature": 0.0, "max_new_tokens": 1}


@pytest.fixture(scope="module")
def server():
    from server_harness import launch_server

    handle = launch_server(*FLAGS)
    yield handle
    handle.stop()


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _cached(server, ids: list[int], **fields) -> int:
    out = server.post_ok("/generate", {"input_ids": ids, "sampling_params": SP, **fields})
    return out["meta_info"]["cached_tokens"]


def _traffic(server, seed: int) -> None:
    """Three unrelated 200-token prompts: each needs 13 of the 32 pages."""
    for k in range(3):
        _cached(server, _ids(200, seed + k))


@pytest.mark.slow
def test_open_session_survives_traffic_until_closed(server):
    before = {s["id"] for s in server.info()["sessions"]["open"]}
    r = server.post("/open_session", {"capacity_of_str_len": 1000, "timeout": 300})
    assert r.status_code == 200, r.text
    sid = r.json()
    # listed by public id (a keyed hash), never by the id: the one not listed before
    (public_id,) = {s["id"] for s in server.info()["sessions"]["open"]} - before
    assert public_id != sid
    assert isinstance(sid, str) and sid
    turn = _ids(160, 1)
    _cached(server, turn, session_params={"id": sid})
    _traffic(server, 10)
    info = server.info()
    assert info["memory"]["evicted_tokens"] > 0  # the pool overflowed
    (listed,) = [s for s in info["sessions"]["open"] if s["id"] == public_id]
    assert listed["pinned_tokens"] >= 160
    assert _cached(server, turn + _ids(8, 2), session_params={"id": sid}) >= 160
    assert server.post("/close_session", {"session_id": sid}).status_code == 200
    assert server.info()["sessions"]["num_open"] == 0
    _traffic(server, 20)  # the closed session's KV is the oldest now: evicted first
    assert _cached(server, turn) == 0


@pytest.mark.slow
def test_low_priority_kv_is_evicted_before_high_priority(server):
    high, low = _ids(160, 30), _ids(160, 31)
    _cached(server, high, priority=10)  # older, but high priority
    _cached(server, low, priority=0)
    _cached(server, _ids(200, 32))  # needs pages: the low-priority prompt goes, not the older
    assert _cached(server, high) == 144  # all it may reuse: its last token must run
    assert _cached(server, low) == 0


@pytest.mark.slow
def test_session_and_field_errors_are_4xx(server):
    def error(path: str, body: dict, status: int) -> None:
        r = server.post(path, body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"], r.text

    error("/close_session", {"session_id": "never-opened"}, 404)
    error("/open_session", {"timeout": 0}, 400)
    error("/open_session", {"timeout": 10**6}, 400)  # past --max-retention-s
    error("/open_session", {"session_id": ""}, 400)
    assert server.post("/open_session", {"session_id": "dup"}).json() == "dup"
    error("/open_session", {"session_id": "dup"}, 409)
    assert server.post("/close_session", {"session_id": "dup"}).status_code == 200
    prompt = {"input_ids": _ids(20, 40), "sampling_params": SP}
    error("/generate", {**prompt, "retention_seconds": 10**4}, 400)
    error("/generate", {**prompt, "priority": "high"}, 400)
    error("/v1/completions", {"prompt": _ids(20, 41), "max_tokens": 1,
                              "retention_seconds": -1}, 400)
    ok = server.post("/v1/completions", {"prompt": _ids(20, 42), "max_tokens": 1,
                                         "priority": 3, "retention_seconds": 5,
                                         "tool_pause": True})
    assert ok.status_code == 200, ok.text
    assert server.info()["integrity"] == "ok"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Lisbon", "Paris"]}},
                   "required": ["city"]}}}


def _chat(server, system: str, tool_choice: str) -> dict:
    r = server.post("/v1/chat/completions", {
      "messages": [{"role": "system", "content": system},
                   {"role": "user", "content": "What is the weather in Lisbon?"}],
      "tools": [WEATHER_TOOL], "tool_choice": tool_choice, "parallel_tool_calls": False,
      "max_tokens": 64, "temperature": 0})
    assert r.status_code == 200, (r.text, server.log_tail())
    return r.json()


@pytest.mark.slow
def test_a_turn_that_ends_in_tool_calls_keeps_its_kv_through_the_tool_pause(server):
    """Last in this module: the paused turn stays pinned for --tool-pause-grace-s (10 s)."""
    paused_system = "You are a weather agent. Call a tool, then answer in one line."
    first = _chat(server, paused_system, "required")
    assert first["choices"][0]["message"]["tool_calls"]
    plain_system = "You are a travel agent. Answer in one short line, without tools."
    plain = _chat(server, plain_system, "none")
    assert not plain["choices"][0]["message"].get("tool_calls")
    _traffic(server, 50)  # every unpinned page is evicted
    assert server.info()["memory"]["evicted_tokens"] > 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    resent = _chat(server, paused_system, "required")["usage"]
    assert resent["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 17
    resent_plain = _chat(server, plain_system, "none")["usage"]
    assert resent_plain["prompt_tokens_details"]["cached_tokens"] < prompt_tokens // 2
