"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) end to end with the
real `anthropic` client and `langchain-anthropic` on the default model: plain and streamed
messages (the event order), usage from the prefix cache, stop sequences, a tool-use loop with
`tool_result` turns and forced tools, token counting, error shapes; `x-api-key` on the API-key
middleware."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sgl_tpu.server.anthropic_protocol import MessagesRequest, chat_request, message_content
from sgl_tpu.server.anthropic_stream import MessageEvents
from sgl_tpu.server.http_server import ApiKeyMiddleware
from sgl_tpu.server.tokenizer_manager import RequestError

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "description": "Local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
SYSTEM = [{"type": "text", "text": "You are a helpful assistant. Answer briefly.",
           "cache_control": {"type": "ephemeral"}}]
QUESTION = [{"role": "user", "content": "Name three colours."}]
# The client's typed signature has no sampling fields beyond max_tokens; the API takes them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(default_model_server_f32):
    # the float32 server: tests here compare tokens across cache hits and streams
    return default_model_server_f32


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def plain(client):
    return client.messages.create(model="claude-local", max_tokens=12, **GREEDY,
                                  system=SYSTEM, messages=QUESTION, metadata={"user_id": "u1"})


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed `/v1/messages`."""
    r = requests.post(server.base_url + "/v1/messages", json={**body, "stream": True},
                      timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            events.append((name, data))
    return events


@pytest.mark.slow
def test_plain_message_and_cached_usage(client, plain):
    assert plain.type == "message" and plain.role == "assistant"
    assert plain.model == "claude-local" and plain.id.startswith("msg_")
    assert plain.content[0].type == "text" and plain.content[0].text
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.stop_sequence is None
    assert 0 < plain.usage.output_tokens <= 12
    assert plain.usage.cache_creation_input_tokens == 0
    again = client.messages.create(model="claude-local", max_tokens=12, **GREEDY,
                                   system=SYSTEM, messages=QUESTION)
    # the whole prompt is in the radix cache now (up to the last, recomputed, token)
    total = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens >= total - 16 > 0
    assert again.content[0].text == plain.content[0].text


@pytest.mark.slow
def test_cache_control_breakpoint_pins_the_prompt(server, client):
    """A 1h breakpoint asks for more than the server's --max-retention-s (600 s by default):
    the pin is cut to it, not refused, and the prompt's KV is retained."""
    system = [{"type": "text", "text": "You answer questions about colours. " * 6,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    msg = client.messages.create(model="m", max_tokens=2, system=system, messages=QUESTION,
                                 extra_body={"temperature": 0, "priority": 2})
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    info = requests.get(server.base_url + "/server_info", timeout=30).json()
    assert info["memory"]["tree_retained_tokens"] >= prompt - 16  # whole pages
    with pytest.raises(anthropic.BadRequestError, match="priority"):
        client.messages.create(model="m", max_tokens=2, messages=QUESTION,
                               extra_body={"priority": "urgent"})


@pytest.mark.slow
def test_stop_sequence(client, plain):
    text = plain.content[0].text
    # a 2-character sequence that first occurs at i >= 1
    i = next(i for i in range(1, len(text) - 1) if text.find(text[i:i + 2]) == i)
    stop = text[i:i + 2]
    msg = client.messages.create(model="m", max_tokens=12, **GREEDY, system=SYSTEM,
                                 messages=QUESTION, stop_sequences=[stop, "\x07never"])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[:i]


@pytest.mark.slow
def test_stream_event_order(server, client, plain):
    events = _events(server, {"model": "m", "max_tokens": 12, "temperature": 0,
                              "system": SYSTEM, "messages": QUESTION})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == plain.stop_reason
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens
    # the client's own accumulation of the same stream
    with client.messages.stream(model="m", max_tokens=12, **GREEDY, system=SYSTEM,
                                messages=QUESTION) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text


@pytest.mark.slow
def test_tool_use_loop(server, client):
    """Forced get_weather, its result, forced get_time (streamed: input_json_delta), its
    result, then an answer without tools; each turn reads the trajectory from the cache."""
    messages = [{"role": "user", "content": "What are the weather and the time in Paris?"}]
    first = client.messages.create(model="m", max_tokens=40, **GREEDY, system=SYSTEM,
                                   tools=[WEATHER, TIME], messages=messages,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input["city"], str)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 C and sunny"}]}]

    body = {"model": "m", "max_tokens": 40, "temperature": 0, "system": SYSTEM,
            "tools": [WEATHER, TIME], "messages": messages,
            "tool_choice": {"type": "tool", "name": "get_time"}}
    events = _events(server, body)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_time"
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert isinstance(json.loads(partial)["city"], str)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[0][1]["message"]["usage"]["cache_read_input_tokens"] > 0
    messages += [{"role": "assistant", "content": [{**starts[-1], "input": json.loads(partial)}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": starts[-1]["id"],
                      "content": [{"type": "text", "text": "14:05"}]},
                     {"type": "text", "text": "Now answer in one sentence."}]}]

    last = client.messages.create(model="m", max_tokens=16, **GREEDY, system=SYSTEM,
                                  tools=[WEATHER, TIME], tool_choice={"type": "none"},
                                  messages=messages)
    assert [b.type for b in last.content] == ["text"]
    assert last.stop_reason in ("end_turn", "max_tokens")
    assert last.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens


@pytest.mark.slow
def test_tool_choice_any(client):
    msg = client.messages.create(
        model="m", max_tokens=40, **GREEDY, tools=[WEATHER, TIME],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Time in Tokyo?"}])
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name in ("get_weather", "get_time") and "city" in calls[0].input


@pytest.mark.slow
def test_count_tokens_matches_usage(client, plain):
    count = client.messages.count_tokens(model="m", system=SYSTEM, messages=QUESTION)
    assert count.input_tokens == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model="m", system=SYSTEM, messages=QUESTION,
                                              tools=[WEATHER])
    assert with_tools.input_tokens > count.input_tokens


@pytest.mark.slow
@pytest.mark.parametrize("body, status, words", [
    ({"model": "m", "messages": QUESTION}, 400, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "role"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, 400, "'document'"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION,
      "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, 400,
     "tools[0].name"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "web_search"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "any"}},
     400, "tool_choice 'any'"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION,
      "thinking": {"type": "enabled"}}, 400, "budget_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [*QUESTION, {"role": "assistant",
                                                               "content": "Red,"}]}, 400,
     "last message"),
    ({"model": "m", "max_tokens": 4, "messages": QUESTION, "temperature": -1}, 400,
     "temperature"),
    ({"model": "m", "max_tokens": 10**9, "messages": QUESTION}, 400, "max"),
])
def test_bad_input_is_an_anthropic_error(server, client, body, status, words):
    r = requests.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"], err


@pytest.mark.slow
def test_errors_through_the_client(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=QUESTION, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = requests.post(server.base_url + "/v1/messages", data="{", timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = requests.post(server.base_url + "/v1/messages", data="{}", timeout=30,
                      headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(server.base_url + "/v1/messages/nope", json={}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.slow
def test_langchain_anthropic_tool_loop(server):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"18 C and sunny in {city}"

    llm = ChatAnthropic(model="claude-local", base_url=server.base_url, api_key="x",
                        max_tokens=40, temperature=0, max_retries=0, timeout=120)
    history = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.response_metadata["stop_reason"] == "tool_use"
    call = ai.tool_calls[0]
    history += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert answer.usage_metadata["input_tokens"] > 0
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0


def test_cache_control_ttl_is_the_retention_and_priority_passes_through():
    """The longest breakpoint TTL (5m when none is named) becomes the chat request's
    retention_seconds, at most the server's maximum; `priority` reaches the chat field."""
    def chat(max_retention_s=600.0, **body):
        req = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 4, "messages": QUESTION, **body})
        return chat_request(req, None, max_retention_s)

    assert chat().retention_seconds is None and chat().priority is None
    assert chat(system=SYSTEM).retention_seconds == 300  # no ttl: 5 minutes
    hour = [{"type": "text", "text": "Be brief.",
             "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert chat(system=SYSTEM + hour).retention_seconds == 600  # bounded by the server
    assert chat(4000.0, system=hour).retention_seconds == 3600
    assert chat(cache_control={"type": "ephemeral", "ttl": "1h"},
                max_retention_s=7200.0).retention_seconds == 3600
    assert chat(priority=5).priority == 5
    with pytest.raises(RequestError, match="ttl must be one of 5m, 1h"):
        chat(system=[{"type": "text", "text": "x",
                      "cache_control": {"type": "ephemeral", "ttl": "2h"}}])


def test_stream_events_for_thinking_text_and_calls():
    """Chat chunks with reasoning, text and two calls (as a reasoning parser and a tool parser
    produce them) -> one block each, in order; the same message non-streamed."""
    def chunk(delta=None, finish=None, prompt=20, cached=8, completion=3):
        return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                             "matched_stop": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    def call(index, fragment, name=None):
        entry = {"index": index, "function": {"arguments": fragment}}
        if name:
            entry.update(id=f"call_{index}", type="function")
            entry["function"]["name"] = name
        return {"tool_calls": [entry]}

    events = MessageEvents({"id": "msg_1", "type": "message", "role": "assistant",
                            "model": "m"}, None)
    first = chunk({"role": "assistant", "content": ""}, completion=1)
    out = events.start(first) + events.feed(first)
    for delta in ({"reasoning_content": "Think"}, {"reasoning_content": " more."},
                  {"content": "Calling."}, call(0, "", "f"), call(0, '{"a": '), call(0, "1}"),
                  call(1, "{}", "g")):
        out += events.feed(chunk(delta))
    out += events.feed(chunk(finish="tool_calls", completion=9)) + events.finish()
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_delta", 2), ("content_block_stop", 2), ("content_block_start", 3),
        ("content_block_delta", 3), ("content_block_stop", 3), ("message_delta", None),
        ("message_stop", None)]
    assert out[0]["message"]["usage"] == {"input_tokens": 12, "output_tokens": 1,
                                          "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 8}
    assert [out[i]["content_block"]["type"] for i in (2, 6, 9, 13)] == \
        ["thinking", "text", "tool_use", "tool_use"]
    assert out[9]["content_block"] == {"type": "tool_use", "id": "toolu_0", "name": "f",
                                       "input": {}}
    assert [out[i]["delta"] for i in (3, 10, 11)] == [
        {"type": "thinking_delta", "thinking": "Think"},
        {"type": "input_json_delta", "partial_json": '{"a": '},
        {"type": "input_json_delta", "partial_json": "1}"}]
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"]["output_tokens"] == 9
    assert message_content({"reasoning_content": "Think more.", "content": "Calling.",
                            "tool_calls": [{"id": "call_0", "function": {
                                "name": "f", "arguments": '{"a": 1}'}}]}) == [
        {"type": "thinking", "thinking": "Think more.", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_0", "name": "f", "input": {"a": 1}}]


def test_x_api_key_is_accepted_beside_bearer():
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages() -> dict:
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return {}

    app.add_middleware(ApiKeyMiddleware, key="secret")
    http = TestClient(app)
    assert http.post("/v1/messages", headers={"x-api-key": "secret"}).status_code == 200
    assert http.post("/v1/messages",
                     headers={"Authorization": "Bearer secret"}).status_code == 200
    assert http.get("/health").status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": ""},
                    {"Authorization": "Bearer wrong", "x-api-key": "secre"}):
        r = http.post("/v1/messages", headers=headers)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid or missing API key"}}
