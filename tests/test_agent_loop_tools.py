"""Agent-loop harness, `tool-calls` workload: bodies, streamed tool-call deltas, call checks,
the loop that feeds tool results back, and the valid-call metrics (no server needed)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sgl_tpu.bench.agent_loop.drivers import DRIVERS, DriverOptions, GenRequest, StreamState
from sgl_tpu.bench.agent_loop.metrics import summarize
from sgl_tpu.bench.agent_loop.runner import ProgramRunner, RunOptions
from sgl_tpu.bench.agent_loop.tools import (
    FUNCTION_TOOLS,
    assistant_message,
    check_call,
    tool_names,
)
from sgl_tpu.bench.agent_loop.trace import RequestRecord, Trace
from sgl_tpu.bench.agent_loop.workloads import Gen, Program, WorkloadConfig, make_workload

SMALL = WorkloadConfig(num_programs=2, turns=3, output_tokens=8, system_tokens=60,
                       observation_tokens=20)


def render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def test_workload_offers_tools_required_then_auto():
    programs = make_workload("tool-calls", SMALL, 0)
    steps = programs[0].steps
    assert len(steps) == SMALL.turns and all(s.tools == FUNCTION_TOOLS for s in steps)
    assert [s.tool_choice for s in steps] == ["required", "required", "auto"]
    assert all(s.max_tokens >= 96 for s in steps)  # room for a call's JSON to close


def test_named_variant_names_an_offered_function_each_turn():
    steps = make_workload("tool-calls-named", SMALL, 0)[0].steps
    names = tool_names(FUNCTION_TOOLS)
    assert all(s.tool_choice["type"] == "function" for s in steps)
    assert all(s.tool_choice["function"]["name"] in names for s in steps)


def test_chat_body_carries_tools_and_is_not_length_forced():
    req = GenRequest([{"role": "user", "content": "hi"}], "p", 96, tools=FUNCTION_TOOLS,
                     tool_choice="required")
    body = DRIVERS["openai-chat"].body(req, DriverOptions())
    assert body["tools"] == list(FUNCTION_TOOLS) and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False
    assert "ignore_eos" not in body and "min_tokens" not in body
    calls = [{"id": "c", "name": "search", "arguments": "{}"}]
    req.messages.append(assistant_message("", calls))
    assert DRIVERS["openai-chat"].body(req, DriverOptions())["messages"][-1]["content"] is None
    llama = DRIVERS["openai-chat"].body(req, DriverOptions(json_dialect="llamacpp"))
    assert llama["messages"][-1]["content"] == "" and llama["messages"][-1]["tool_calls"]
    for api in ("native", "openai-completions"):
        with pytest.raises(ValueError, match="openai-chat"):
            DRIVERS[api].body(req, DriverOptions())


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_name_repeated_in_every_delta_is_kept_once():
    state = StreamState()
    for frag in ('{"query": ', '"x"}'):
        DRIVERS["openai-chat"].update(state, _chunk({"tool_calls": [{
            "index": 0, "id": "c", "function": {"name": "search", "arguments": frag}}]}), 0.0)
    assert state.tool_calls == [{"id": "c", "name": "search", "arguments": '{"query": "x"}'}]


def test_streamed_tool_call_fragments_join_per_index():
    events = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me look."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "search", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"query": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Lisbon"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "finish", "arguments": '{"answer"'}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": ': "42"}'}}]}),
        _chunk({}, "tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 20,
                                  "prompt_tokens_details": {"cached_tokens": 16}}},
    ]
    state = StreamState()
    for t, e in enumerate(events):
        DRIVERS["openai-chat"].update(state, e, float(t))
    assert state.text == "Let me look." and state.finish_reason == "tool_calls"
    assert state.tool_calls == [
        {"id": "call_a", "name": "search", "arguments": '{"query": "Lisbon"}'},
        {"id": "call_b", "name": "finish", "arguments": '{"answer": "42"}'}]
    assert len(state.chunk_times) == 6  # text and every call fragment count as output
    assert state.cached_tokens == 16 and state.completion_tokens == 20


@pytest.mark.parametrize("call, problem", [
    ({"name": "search", "arguments": '{"query": "x", "max_results": 3}'}, None),
    ({"name": "convert_units", "arguments": json.dumps(
        {"quantity": {"value": 3.5, "unit": "km"}, "to_unit": "mile"})}, None),
    ({"name": "weather", "arguments": '{"places": ["Oslo"], "year": 1999}'}, None),
    ({"name": "fly", "arguments": "{}"}, "unknown function"),
    ({"name": "search", "arguments": '{"query": '}, "not JSON"),
    ({"name": "search", "arguments": "[1]"}, "not a JSON object"),
    ({"name": "search", "arguments": '{"query": "x", "max_results": 11}'}, "schema"),
    ({"name": "convert_units", "arguments": json.dumps(
        {"quantity": {"value": 1, "unit": "parsec"}, "to_unit": "km"})}, "schema"),
    ({"name": "weather", "arguments": '{"places": [], "year": 1999}'}, "schema"),
    ({"name": "finish", "arguments": '{"answer": "a", "extra": 1}'}, "schema"),
])
def test_check_call(call, problem):
    result = check_call(call, FUNCTION_TOOLS)
    if problem is None:
        assert result is None
    else:
        assert result is not None and problem in result
    assert tool_names(FUNCTION_TOOLS) == ["search", "calculator", "convert_units", "weather",
                                          "finish"]


def test_runner_feeds_tool_results_back_and_counts_valid_calls():
    sent: list[GenRequest] = []
    answers = [
        [{"id": "c1", "name": "search", "arguments": '{"query": "q"}'},
         {"id": "c2", "name": "calculator", "arguments": '{"expression": 7}'},  # invalid
         {"id": "c4", "name": "search", "arguments": '{"query": "cut off'}],  # not JSON
        [],  # a text answer: the next observation goes back as a user message
        [{"id": "c3", "name": "finish", "arguments": '{"answer": "done"}'}],
    ]

    async def send(req, program_id, step, branch):
        sent.append(req)
        calls = answers[step]
        record = RequestRecord(program_id, step, branch, 0.0, 1.0, [0.5], [1],
                               text="" if calls else "plain", tool_request=True,
                               tool_calls=calls, prompt_tokens=10, completion_tokens=5)
        record.invalid_tool_calls = sum(check_call(c, req.tools) is not None for c in calls)
        return record

    program = Program("p", "s", "SYS", (
        Gen("Q", 96, tools=FUNCTION_TOOLS, tool_choice="required"),
        Gen("OBS1", 96, tools=FUNCTION_TOOLS, tool_choice="required"),
        Gen("OBS2", 96, tools=FUNCTION_TOOLS, tool_choice="auto")))
    trace = asyncio.run(ProgramRunner(send, render, RunOptions(progress=False)).run([program]))
    second = sent[1].messages
    assert second[2]["role"] == "assistant" and second[2]["content"] is None
    assert [c["id"] for c in second[2]["tool_calls"]] == ["c1", "c2", "c4"]
    assert second[2]["tool_calls"][2]["function"]["arguments"] == "{}"  # sent back as JSON
    assert second[3] == {"role": "tool", "tool_call_id": "c1", "content": "OBS1"}
    assert second[4]["role"] == "tool" and second[4]["tool_call_id"] == "c2"
    assert "not valid JSON" in second[5]["content"]
    third = sent[2].messages
    assert third[-2] == {"role": "assistant", "content": "plain"}
    assert third[-1] == {"role": "user", "content": "OBS2"}
    assert sent[2].tool_choice == "auto" and "search" in sent[1].prompt  # calls rendered as text
    s = summarize(Trace(3.0, 1, trace.records))
    assert s["tool_requests"] == 3 and s["tool_calls"] == 4
    assert s["invalid_tool_calls"] == 2 and s["tool_requests_without_call"] == 1
    assert s["valid_tool_call_share"] == pytest.approx(2 / 4)
