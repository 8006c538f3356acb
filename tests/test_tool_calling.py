"""Tool calling and reasoning on `/v1/chat/completions`, end to end: a real server with the
default model (SmolLM2-135M, whose template ignores tools: the hermes block is injected), the
official `openai` client, and LangChain's `bind_tools` agent loop.

The tiny random checkpoint with `--reasoning-parser qwen3` also serves the Responses API's
`reasoning` output items.

`tool_choice` required / named decode under a grammar, so every call validates against its
schema even at temperature 1 on a 135M model; `auto` lets the model talk and constrains a call
once it opens one.

The tests that compare two answers (streamed and not, with and without tools offered: the
second is a radix-cache hit) run on the session's float32 server (`f32_client`): equal tokens
across a cache hit are promised in float32, not in bfloat16, which `--dtype auto` is on CPUs
with AMX. The others run on the default-dtype server.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from checkpoints import make_tiny_hf_checkpoint
from server_harness import launch_server

pytestmark = pytest.mark.slow

FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "minLength": 3, "maxLength": 20},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "business", "first"]},
        "dates": {"type": "object", "properties": {
            "depart": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
            "flexible": {"type": "boolean"}}, "required": ["depart", "flexible"]},
        "meals": {"type": "array", "items": {"enum": ["veg", "halal", "kosher"]},
                  "maxItems": 2}},
        "required": ["origin", "passengers", "cabin", "dates"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TOOLS = [FLIGHT, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
ASK_FLIGHT = [{"role": "user", "content": "Book me a business flight from Oslo on 2026-05-03 "
                                          "for two people."}]


@pytest.fixture(scope="module")
def server(default_model_server):
    """The session's default-model server (tests/conftest.py)."""
    return default_model_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def f32_client(default_model_server_f32) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_model_server_f32.base_url + "/v1", api_key="x",
                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def f32_model(f32_client) -> str:
    return f32_client.models.list().data[0].id


def _check_calls(calls, names: set[str]) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _assemble(stream, fragments: list | None = None
              ) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) from streamed chunks; `fragments` gets
    every non-empty arguments fragment."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
                if fragments is not None and tc.function.arguments:
                    fragments.append(tc.function.arguments)
            reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_valid_over_seeds(client, model, choice):
    """Temperature 1, 16 seeds: every response carries calls valid against the schema."""
    tool_choice = {"type": "function", "function": {"name": "book_flight"}} \
        if choice == "named" else "required"
    names = {"book_flight"} if choice == "named" else set(SCHEMAS)
    for seed in (0, 100):
        resp = client.chat.completions.create(
            model=model, messages=ASK_FLIGHT, tools=TOOLS, tool_choice=tool_choice,
            temperature=1, seed=seed, n=8, max_tokens=200)
        for c in resp.choices:
            assert c.message.tool_calls, c
            assert c.message.content is None
            assert c.finish_reason in ("tool_calls", "length")
            calls = _check_calls(c.message.tool_calls, names)
            if choice == "named":
                assert len(calls) == 1 and c.finish_reason == "tool_calls"


@pytest.mark.isa_invariance
@pytest.mark.parametrize("choice", ["required", "named"])
def test_stream_assembles_the_same_calls(f32_client, f32_model, choice):
    client, model = f32_client, f32_model
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} \
        if choice == "named" else "required"
    for seed in range(3):
        kw = dict(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                  temperature=1, seed=seed, max_tokens=120, parallel_tool_calls=False)
        resp = client.chat.completions.create(**kw)
        want = [(c.function.name, c.function.arguments) for c in resp.choices[0].message.tool_calls]
        _check_calls(resp.choices[0].message.tool_calls, set(SCHEMAS))
        fragments: list[str] = []
        content, got, reason = _assemble(client.chat.completions.create(**kw, stream=True),
                                         fragments)
        assert got == want and content == "" and reason == "tool_calls"
        assert len(fragments) > 1  # the arguments stream as the model writes them


def test_auto_calls_valid_and_text_is_content(client, model):
    """`auto`: any call the model opens is constrained (valid); prose comes back as content."""
    calls = texts = 0
    # The 135M model seldom opens a call on its own; asked to echo the opener, it often does,
    # and the grammar then has to carry the call to a valid end.
    echo = 'Repeat after me: <tool_call>\n{"name": "get_weather"'
    for messages, n, max_tokens in (([{"role": "user", "content": echo}], 16, 80),
                                    (ASK_WEATHER, 4, 40),
                                    ([{"role": "user", "content": "Tell me a joke."}], 4, 40)):
        resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                              temperature=1, seed=3, n=n, max_tokens=max_tokens)
        for c in resp.choices:
            if c.message.tool_calls:
                calls += 1
                _check_calls(c.message.tool_calls, set(SCHEMAS))
                assert c.finish_reason in ("tool_calls", "length")
            elif c.message.content:
                texts += 1
                assert "<tool_call>" not in c.message.content
            else:  # a call cut off by max_tokens is dropped, never shown as content
                assert c.finish_reason == "length"
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                temperature=1, seed=7, max_tokens=max_tokens,
                                                stream=True)
        content, got, _ = _assemble(stream)
        assert "<tool_call>" not in content and (got or content)
    assert calls and texts  # both kinds of answer happen, and both come back well-formed


@pytest.mark.isa_invariance
def test_tool_choice_none_and_no_tools_unchanged(f32_client, f32_model):
    client, model = f32_client, f32_model
    resp = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=24)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content
    plain = client.chat.completions.create(model=model, messages=ASK_WEATHER, temperature=0,
                                           max_tokens=24)
    assert plain.choices[0].message.content == resp.choices[0].message.content


@pytest.mark.isa_invariance
def test_multi_turn_with_tool_results(f32_client, f32_model):
    """The official client's loop: call, run the tool, send the result, get the answer."""
    client, model = f32_client, f32_model
    messages = list(ASK_WEATHER)
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice={"type": "function",
                                                        "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
              max_tokens=40)
    second = client.chat.completions.create(**kw)
    assert second.choices[0].message.content and second.choices[0].finish_reason
    # the earlier turns (call and result included) are in the prompt
    alone = client.chat.completions.create(**{**kw, "messages": ASK_WEATHER, "max_tokens": 1})
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    content, calls, _ = _assemble(client.chat.completions.create(**kw, stream=True))
    assert content == second.choices[0].message.content and not calls


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]}, "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}}]},
     "does not resolve"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among"),
    ({"tool_choice": "required"}, "at least one tool"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]},
     "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{no"}}]}]},
     "arguments"),
]


@pytest.mark.parametrize("extra, needle", BAD)
def test_bad_input_is_400(server, model, extra, needle):
    body = {"model": model, "messages": ASK_WEATHER, "max_tokens": 4, **extra}
    for stream in (False, True):
        r = requests.post(server.base_url + "/v1/chat/completions",
                          json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    ok = requests.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": model, "messages": ASK_WEATHER, "max_tokens": 2})
    assert ok.status_code == 200


def test_langchain_bind_tools_agent_loop(server, model, tmp_path, monkeypatch):
    """LangChain's ChatOpenAI.bind_tools: the model calls the tool, the tool really runs, its
    result goes back, and the model answers. No network: nothing but the local server."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # never fetch encodings
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls = []

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city (unit: celsius or fahrenheit)."""
        calls.append((city, unit))
        return f"22 degrees {unit} and sunny in {city}"

    llm = ChatOpenAI(model=model, base_url=server.base_url + "/v1", api_key="x",
                     temperature=0, max_tokens=80, max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    messages.append(ai)
    for tc in ai.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(tc["args"]), tool_call_id=tc["id"]))
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert calls and isinstance(final.content, str) and final.content
    assert not final.tool_calls


# ---- a tiny random checkpoint whose template renders tools (Qwen2.5-style), with reasoning ---
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight model (gibberish unless constrained) with the template above, started
    with --reasoning-parser qwen3 and no --tool-call-parser (the template picks qwen25)."""
    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_tools"), "llama")
    cfg_path = f"{ckpt}/tokenizer_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    srv = launch_server("--skip-warmup", "--max-total-tokens", "2048", "--reasoning-parser",
                        "qwen3", model_path=ckpt)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    yield srv, client, client.models.list().data[0].id
    srv.stop()


def test_template_tools_on_a_random_model(tiny):
    """The template renders the tools; the grammar makes even random weights call validly."""
    srv, c, model = tiny
    assert "tool-call parser: qwen25 (the chat template writes '<tool_call>')" in srv.log_tail()
    small = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"]}}}
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in range(4):
        resp = c.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[small],
                                         tool_choice="required", temperature=1, seed=seed,
                                         max_tokens=150, extra_body=no_think,
                                         parallel_tool_calls=False)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments),
                                small["function"]["parameters"])
    # history rendered by the template: the call and its result
    messages = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                 "content": "sunny"}]
    later = c.chat.completions.create(model=model, messages=messages, tools=[small],
                                      max_tokens=1, extra_body=no_think)
    first = c.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[small],
                                      max_tokens=1, extra_body=no_think)
    assert later.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_reasoning_parser_end_to_end(tiny):
    _, c, model = tiny
    forced = 'start: "<think>\\nAdd 2 and 2.\\n</think>\\n\\nThe answer is 4."'
    kw = dict(model=model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=60,
              temperature=0, extra_body={"ebnf": forced})
    msg = c.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content == "Add 2 and 2." and msg.content == "The answer is 4."
    reasoning = content = ""
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == ("Add 2 and 2.", "The answer is 4.")
    kw["extra_body"] = {"ebnf": forced, "separate_reasoning": False}
    msg = c.chat.completions.create(**kw).choices[0].message
    assert msg.content.startswith("<think>") and "The answer is 4." in msg.content
    # a plain answer (no block) stays content
    plain = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, extra_body={"ebnf": 'start: "hello"'})
    assert plain.choices[0].message.content == "hello"
    assert plain.choices[0].message.reasoning_content is None
    # with thinking on, a forced call may come after a reasoning block: the grammar lets the
    # block through first, and the call is still parsed out of what follows
    tool = {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}}}}
    resp = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                     tools=[tool], tool_choice="required", max_tokens=200,
                                     temperature=0, parallel_tool_calls=False)
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert [t.function.name for t in choice.message.tool_calls] == ["noop"]
    else:  # the random model stayed in its reasoning block until max_tokens
        assert choice.finish_reason == "length" and choice.message.reasoning_content


def test_responses_reasoning_items(tiny):
    """The Responses API on the reasoning parser: a reasoning block is a `reasoning` output
    item before the message (streamed as reasoning_text deltas), counted in reasoning_tokens;
    the text's log-probs leave the block out; `reasoning.effort: "none"` turns thinking off."""
    _, c, model = tiny
    forced = 'start: "<think>\\nAdd 2 and 2.\\n</think>\\n\\nThe answer is 4."'
    kw = dict(model=model, input="2+2?", max_output_tokens=60, temperature=0,
              include=["message.output_text.logprobs"], extra_body={"ebnf": forced})
    r = c.responses.create(**kw)
    assert [it.type for it in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Add 2 and 2."
    assert r.output_text == "The answer is 4."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    tokens = "".join(lp.token for lp in r.output[1].content[0].logprobs)
    assert "The answer is 4." in tokens and "Add" not in tokens
    events = list(c.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == "Add 2 and 2."
    final = events[-1].response
    assert [it.type for it in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == \
        r.usage.output_tokens_details.reasoning_tokens
    # the next turn replays the answer without its reasoning
    nxt = c.responses.create(model=model, input="And 3+3?", previous_response_id=r.id,
                             max_output_tokens=2)
    items = c.responses.input_items.list(nxt.id, order="asc").data
    assert [it.type for it in items] == ["message", "reasoning", "message", "message"]
    off = c.responses.create(model=model, input="x", max_output_tokens=8, temperature=0,
                             reasoning={"effort": "none"}, extra_body={"ignore_eos": True})
    assert [it.type for it in off.output] == ["message"] and off.reasoning.effort == "none"
