"""The agent-facing API end to end on the real default model (SmolLM2-135M), one server (the
session's float32 one, tests/conftest.py):
OpenAI compatibility (any model name, `--served-model-name`, `/server_info`), `stop_regex`,
SGLang's streamed log-prob chunks, the Responses API through the official `openai` client
(non-streamed, streamed, `previous_response_id` with cached tokens, 404s), and the OpenAI
Agents SDK running a function-tool agent over both its chat-completions and Responses models.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import openai
import pytest
import requests
from server_harness import SERVED_F32 as SERVED
from server_harness import ServerHandle

from sgl_tpu.loader import default_model_path

pytestmark = pytest.mark.slow

PAGE_SIZE = 16  # the server's default; cached prefixes are whole pages
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(default_model_server_f32) -> ServerHandle:
    return default_model_server_f32


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def generate(server: ServerHandle, **body) -> requests.Response:
    return requests.post(server.base_url + "/generate", json=body, timeout=120)


# ---- compatibility ---------------------------------------------------------------------------
def test_model_names_and_server_info(server, client):
    assert [m.id for m in client.models.list().data] == [SERVED]
    for route in ("/server_info", "/get_server_info"):
        info = requests.get(server.base_url + route, timeout=30).json()
        assert info["served_model_name"] == SERVED
        assert info["model_path"] == default_model_path()  # resolved, not the flag's None
    # any name is served by the one model (SGLang's docs send "default")
    resp = client.chat.completions.create(
        model="default", max_tokens=24, **GREEDY,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert resp.model == "default" and "Paris" in resp.choices[0].message.content


def test_stop_regex(server, client):
    body = {"text": "Count from 1 to 30: 1, 2, 3,", "sampling_params": {
        **GREEDY, "max_new_tokens": 48}}
    base = generate(server, **body).json()["text"]
    pattern = r"1[2-9],"
    assert re.search(pattern, base), base  # the model counts on; the test needs a match
    sp = {**body["sampling_params"], "stop_regex": pattern}
    out = generate(server, **{**body, "sampling_params": sp}).json()
    assert out["text"] == base[: re.search(pattern, base).start()]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    # streamed: the final text is trimmed the same way
    with requests.post(server.base_url + "/generate", json={**body, "sampling_params": sp,
                                                            "stream": True},
                       stream=True, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:") and line != "data: [DONE]"]
    assert events[-1]["text"] == out["text"]
    # the OpenAI routes take it too (SGLang's extension)
    comp = client.completions.create(model=SERVED, prompt=body["text"], max_tokens=48,
                                     **GREEDY, extra_body={"stop_regex": [pattern]})
    assert comp.choices[0].text == out["text"] and comp.choices[0].finish_reason == "stop"
    # an invalid pattern is a 400 naming it, and the server keeps serving
    bad = generate(server, text="x", sampling_params={"stop_regex": "1[2-"})
    assert bad.status_code == 400 and "stop_regex" in bad.json()["error"]["message"]
    assert generate(server, text="x", sampling_params={"max_new_tokens": 2}).ok


def test_streamed_logprobs_are_per_chunk(server):
    """SGLang's streamed `meta_info`: each chunk's output log-probs are its new tokens only,
    `output_token_logprobs_length` the running total (= completion_tokens)."""
    body = {"text": "Write a short poem about the sea.", "return_logprob": True,
            "top_logprobs_num": 2, "sampling_params": {**GREEDY, "max_new_tokens": 24,
                                                     "ignore_eos": True}}
    whole = generate(server, **body).json()["meta_info"]
    with requests.post(server.base_url + "/generate", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        chunks = [json.loads(line[5:])["meta_info"]
                  for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:") and line != "data: [DONE]"]
    assert len(chunks) > 1
    entries, tops, prev = [], [], 0
    for meta in chunks:
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        prev = meta["completion_tokens"]
        entries += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
    assert [e[1] for e in entries] == [e[1] for e in whole["output_token_logprobs"]]
    assert len(tops) == len(whole["output_top_logprobs"])


# ---- the Responses API -----------------------------------------------------------------------
QUESTION = "What is the capital of France?"


def test_response_non_stream_get_delete(client):
    r = client.responses.create(model="default", input=QUESTION, max_output_tokens=32, **GREEDY)
    assert r.object == "response" and r.status == "completed"
    assert "Paris" in r.output_text
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(r.id)
    # max_output_tokens cuts it short: incomplete, with the reason
    short = client.responses.create(model="default", input=QUESTION, max_output_tokens=2)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"


def test_response_stream_event_sequence(client):
    kw = dict(model="default", input=QUESTION, instructions="Answer in one sentence.",
              max_output_tokens=32, **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    final_type = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", final_type]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored


def test_previous_response_id_reuses_the_conversation_kv(client):
    """Each turn sends only its new message; the server replays the stored conversation and the
    radix cache (the conversation is the session) serves the earlier turns from KV."""
    turns = ["What is the capital of France?", "And of Germany?", "And of Italy?"]
    prev, prev_usage = None, None
    for k, text in enumerate(turns):
        r = client.responses.create(model="default", input=text, previous_response_id=prev,
                                    instructions="Answer briefly.", max_output_tokens=24,
                                    **GREEDY)
        if prev_usage is not None:
            seen = prev_usage.input_tokens + prev_usage.output_tokens
            assert r.usage.input_tokens > seen  # the earlier turns are in the prompt
            # ... and served from the cache, to the last whole page of the earlier turns
            assert r.usage.input_tokens_details.cached_tokens >= seen - PAGE_SIZE, k
        prev, prev_usage = r.id, r.usage
    assert r.previous_response_id is not None and r.output_text


def test_unknown_or_unstored_response_is_404(client, server):
    with pytest.raises(openai.NotFoundError, match="previous_response_id: no stored response"):
        client.responses.create(model="default", input="hi", previous_response_id="resp_nope")
    unstored = client.responses.create(model="default", input="hi", max_output_tokens=4,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="default", input="hi", previous_response_id=unstored.id)
    for method in ("get", "delete"):
        r = requests.request(method, server.base_url + "/v1/responses/resp_nope", timeout=30)
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]


def test_response_stream_disconnect_frees_the_request(server):
    generated_before = server.info()["stats"]["generated_tokens"]
    body = {"input": "Count from 1 to 500.", "max_output_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with requests.post(server.base_url + "/v1/responses", json=body, stream=True,
                       timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 12:
                break  # hang up mid-stream
    info = server.wait_idle()  # the abandoned request ends
    assert info["stats"]["generated_tokens"] - generated_before < 400  # aborted, not finished
    assert info.get("integrity") == "ok"


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input item type 'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input_audio"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": []}, "no input items"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_responses_input_is_400(server, body, needle):
    r = requests.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_response_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(
        model="default", input="Name the capital of France as JSON.", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}}, **GREEDY)
    assert set(json.loads(r.output_text)) == {"city"}


# ---- function tools over the Responses API ----------------------------------------------------
WEATHER_TOOL = {"type": "function", "name": "get_weather",
                "description": "Get the current weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}}


def test_response_function_call_round_trip(client):
    kw = dict(model="default", tools=[WEATHER_TOOL], max_output_tokens=64, **GREEDY)
    r = client.responses.create(input="What's the weather in Paris?", tool_choice="required",
                                **kw)
    calls = [it for it in r.output if it.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # streamed: the argument deltas assemble to the same call
    events = list(client.responses.create(input="What's the weather in Paris?",
                                          tool_choice="required", stream=True, **kw))
    args: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [args[e.item_id] for e in done] == [e.arguments for e in done]
    assert [(e.name, e.arguments) for e in done] == [(c.name, c.arguments) for c in calls]
    # a named function
    time_tool = {**WEATHER_TOOL, "name": "get_time", "description": "Local time in a city."}
    named = client.responses.create(input="What's the weather in Paris?",
                                    **{**kw, "tools": [WEATHER_TOOL, time_tool]},
                                    tool_choice={"type": "function", "name": "get_time"})
    assert {it.name for it in named.output if it.type == "function_call"} == {"get_time"}
    # the tool result goes back as the only new item
    out = client.responses.create(
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C."}
               for c in calls], previous_response_id=r.id, **kw)
    assert out.output and out.previous_response_id == r.id
    # the first turn's prompt is served from the KV cache (the conversation is the session)
    cached = out.usage.input_tokens_details.cached_tokens
    assert cached >= r.usage.input_tokens - PAGE_SIZE, (cached, r.usage.input_tokens)


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------
def test_agents_sdk_function_tool_over_chat_and_responses(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    os.environ.setdefault("OPENAI_API_KEY", "x")  # never sent anywhere but the local server
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    async def run(model_cls, stream: bool, chained: bool) -> agents.RunResult:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x",
                                    max_retries=0, timeout=120)
        # "required" for the first turn (the SDK resets it to "auto" once the tool ran), so
        # the 135M model calls the tool, then answers from its result.
        agent = agents.Agent(
            name="weather", instructions="Answer with the get_weather tool.",
            model=model_cls(model="default", openai_client=client), tools=[get_weather],
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                max_tokens=256, parallel_tool_calls=False))
        question = "What's the weather in Paris?"
        # chained: each turn sends only its new items, with the previous response's id
        kw = {"max_turns": 4, "auto_previous_response_id": chained}
        if not stream:
            return await agents.Runner.run(agent, question, **kw)
        result = agents.Runner.run_streamed(agent, question, **kw)
        async for _ in result.stream_events():
            pass
        return result

    runs = [(agents.OpenAIChatCompletionsModel, False, False),
            (agents.OpenAIResponsesModel, False, False), (agents.OpenAIResponsesModel, True, False),
            (agents.OpenAIResponsesModel, False, True)]
    for model_cls, stream, chained in runs:
        calls.clear()
        result = asyncio.run(run(model_cls, stream, chained))
        kinds = [type(it).__name__ for it in result.new_items]
        assert calls and all(calls), (model_cls.__name__, stream)  # the tool really ran
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
        assert kinds[-1] == "MessageOutputItem"
        assert "21 C" in result.final_output  # the answer used the tool's result
        if chained:  # the server stored the first turn and continued it
            ids = [r.response_id for r in result.raw_responses]
            last = requests.get(f"{server.base_url}/v1/responses/{ids[-1]}", timeout=30).json()
            assert len(ids) == 2 and last["previous_response_id"] == ids[0]


def test_a_keep_alive_connection_outlives_a_tool_pause(server):
    """An agent's pooled connection, idle for a tool call longer than uvicorn's 5 s default,
    still carries its next request (the server closing it first loses that request)."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        for pause_s in (0, 6):
            time.sleep(pause_s)
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
    finally:
        conn.close()
