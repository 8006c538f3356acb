"""Agent-loop benchmark harness: workloads, drivers, runner, client, metrics, target specs.

Fast tests use recorded stream bytes and a tiny aiohttp server written here; the one slow test
runs the harness's CLI against a real sgl-tpu server (tiny random-weight model).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time

import aiohttp
import pytest
from aiohttp import web

from sgl_tpu.bench.agent_loop.__main__ import (
    main,
    parse_latency,
    parse_workload,
    program_counters,
    ratios,
    spec_counters,
    sweep,
    warmup_config,
)
from sgl_tpu.bench.agent_loop.client import Client
from sgl_tpu.bench.agent_loop.drivers import (
    DONE,
    DRIVERS,
    DriverOptions,
    GenRequest,
    StreamError,
    StreamState,
    parse_sse_line,
)
from sgl_tpu.bench.agent_loop.gbnf import schema_to_gbnf
from sgl_tpu.bench.agent_loop.metrics import percentile, summarize
from sgl_tpu.bench.agent_loop.runner import (
    ProgramRunner,
    RunOptions,
    arrival_times,
    tool_latency,
)
from sgl_tpu.bench.agent_loop.table import format_table
from sgl_tpu.bench.agent_loop.targets import parse_target
from sgl_tpu.bench.agent_loop.trace import RequestRecord, Trace
from sgl_tpu.bench.agent_loop.workloads import (
    WORKLOADS,
    Fork,
    Gen,
    Program,
    WorkloadConfig,
    describe,
    make_workload,
    tool_call_schema,
)

SMALL = WorkloadConfig(num_programs=3, turns=2, output_tokens=8, system_tokens=60,
                       observation_tokens=20, branches=2, groups=2)


def render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def count_words(text: str) -> int:
    return len(text.split())


# ---- workloads --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_deterministic_under_seed(name):
    a, b = make_workload(name, SMALL, 7), make_workload(name, SMALL, 7)
    assert a == b
    assert make_workload(name, SMALL, 8) != a
    assert len(a) == SMALL.num_programs
    d = describe(a, count_words)
    assert d["requests"] == sum(p.num_requests for p in a) > 0
    assert d["user_message_tokens"] > 0 and d["max_new_tokens"] > 0


def test_workload_shapes():
    react = make_workload("react", SMALL, 0)
    assert len({p.system for p in react}) == 1  # one shared tool prompt
    assert all(len(p.steps) == SMALL.turns for p in react)
    assert react[0].steps[1].user.startswith("Observation:")
    assert react[0].steps[0].stop == ("Observation:",)
    tool = make_workload("tool-json", SMALL, 0)
    assert tool[0].steps[0].json_schema == tool_call_schema()
    tot = make_workload("tree-of-thought", SMALL, 0)
    forks = [s for s in tot[0].steps if isinstance(s, Fork)]
    assert len(forks) == SMALL.turns and all(len(f.branches) == SMALL.branches for f in forks)
    assert tot[0].num_requests == 1 + SMALL.turns * (SMALL.branches + 1)
    shared = make_workload("shared-prefix", SMALL, 0)
    assert len({p.system for p in shared}) == SMALL.groups
    with pytest.raises(ValueError):
        WorkloadConfig(turns=0)
    with pytest.raises(ValueError):
        make_workload("nope", SMALL, 0)


def test_long_react_observations_grow_the_context():
    """Observations of observation_tokens to twice that, drawn per turn: the context of turn t
    holds t of them."""
    cfg = dataclasses.replace(SMALL, turns=6, observation_tokens=200)
    long = make_workload("long-react", cfg, 0)
    short = make_workload("react", cfg, 0)
    assert len({p.system for p in long}) == 1 and all(len(p.steps) == 6 for p in long)
    sizes = [len(s.user) for p in long for s in p.steps[1:]]
    base = [len(s.user) for p in short for s in p.steps[1:]]
    assert min(sizes) >= min(base) * 0.8 and max(sizes) > 1.4 * max(base)
    assert len(set(sizes)) > 1


def test_private_agents_and_the_agent_sweep():
    private = make_workload("private-react", SMALL, 0)
    assert len({p.system for p in private}) == SMALL.num_programs  # nothing shared
    assert all(len(p.steps) == SMALL.turns for p in private)
    runs = sweep([("private-react", SMALL)], [2, 5, 2, 2])
    assert [(label, cfg.num_programs) for label, _, cfg in runs] == [
        ("private-react@2", 2), ("private-react@5", 5), ("private-react@2#2", 2),
        ("private-react@2#3", 2)]
    assert sweep([("react", SMALL)], None) == [("react", "react", SMALL)]
    with pytest.raises(SystemExit):
        sweep([("react", SMALL)], [0])
    before = {"programs": {"num_programs_held": 2, "program_held_s": 1.5}}
    after = {"programs": {"num_programs_held": 5, "program_held_s": 4.0}}
    assert program_counters(before, after) == {
        "server_programs": {"num_programs_held": 3, "program_held_s": 2.5}}
    assert program_counters(None, {}) == {}


def test_merge_keeps_runs_per_target_and_label(tmp_path):
    from sgl_tpu.bench.agent_loop.merge import main as merge_main

    def result(target: str, label: str, pps: float) -> dict:
        run = summarize(Trace(wall_s=2.0, num_programs=1,
                              records=[RequestRecord("a", 0, -1, 0.0, 2.0)]))
        return {"args": {"seed": 0}, "targets": {target: {}}, "workloads": {label: {}},
                "runs": {target: {label: {**run, "programs_per_s": pps}}},
                "target_errors": {}}

    paths = []
    for i, (target, label, pps) in enumerate([("p", "w@8", 1.0), ("p", "w@16", 2.0),
                                              ("l", "w@8", 0.5)]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(result(target, label, pps)))
    out = tmp_path / "merged.json"
    merge_main([str(out), *map(str, paths), "--note", "side by side"])
    merged = json.loads(out.read_text())
    assert {t: sorted(r) for t, r in merged["runs"].items()} == {"p": ["w@16", "w@8"],
                                                                 "l": ["w@8"]}
    assert merged["ratios"]["w@8"]["p_vs_l"]["throughput_x"] == 2.0
    assert merged["note"] == "side by side" and "l/w@8" in merged["args"]


def test_program_completion_times():
    records = [RequestRecord("a", 0, -1, 0.0, 2.0), RequestRecord("a", 1, -1, 3.0, 5.0),
               RequestRecord("b", 0, -1, 1.0, 2.0),
               RequestRecord("c", 0, -1, 0.0, 9.0, error="boom")]
    s = summarize(Trace(wall_s=9.0, num_programs=3, records=records))
    assert s["program_s"]["mean"] == (5.0 + 1.0) / 2  # the failed program is left out
    assert s["program_s"]["p99"] <= 5.0


def test_workload_overrides():
    name, cfg = parse_workload("tree-of-thought:turns=1,num-programs=2", SMALL)
    assert name == "tree-of-thought" and cfg.turns == 1 and cfg.num_programs == 2
    assert cfg.branches == SMALL.branches
    with pytest.raises(ValueError):
        parse_workload("react:bogus=1", SMALL)


def test_warmup_keeps_concurrency_and_caps_turns():
    cfg = WorkloadConfig(num_programs=8, turns=6)
    warm = warmup_config(cfg, None)
    assert dataclasses.replace(warm, trace=cfg.trace) == WorkloadConfig(num_programs=8, turns=2)
    assert warm.trace.calls_min == warm.trace.calls_max == 2  # agent-trace: two calls
    assert warmup_config(cfg, 3).num_programs == 3
    assert warmup_config(cfg, 0) is None


# ---- drivers: request bodies --------------------------------------------------------------------
REQ = GenRequest([{"role": "user", "content": "hi"}], "<user>hi\n<assistant>", 16,
                 stop=("Observation:",), seed=5)


def test_native_body_fixed_and_natural():
    native = DRIVERS["native"]
    body = native.body(REQ, DriverOptions())
    sp = body["sampling_params"]
    assert body["text"] == REQ.prompt and body["stream"] is True and "session_id" not in body
    assert sp["ignore_eos"] is True and sp["min_new_tokens"] == 16 and "stop" not in sp
    assert sp["temperature"] == 0.0 and sp["sampling_seed"] == 5
    sp = native.body(REQ, DriverOptions(output_mode="natural"))["sampling_params"]
    assert sp["stop"] == ["Observation:"] and "ignore_eos" not in sp


def test_structured_bodies_per_dialect():
    schema = tool_call_schema()
    req = GenRequest(REQ.messages, REQ.prompt, 96, json_schema=schema, session_id="agent-1")
    native = DRIVERS["native"].body(req, DriverOptions())
    assert json.loads(native["sampling_params"]["json_schema"]) == schema
    assert "ignore_eos" not in native["sampling_params"]  # the grammar ends the answer
    assert native["session_id"] == "agent-1"
    chat = DRIVERS["openai-chat"].body(req, DriverOptions())
    assert chat["response_format"]["type"] == "json_schema"
    assert chat["response_format"]["json_schema"]["schema"] == schema
    assert chat["session_id"] == "agent-1" and chat["messages"] == REQ.messages
    llama_chat = DRIVERS["openai-chat"].body(req, DriverOptions(json_dialect="llamacpp"))
    assert llama_chat["response_format"] == {"type": "json_object", "schema": schema}
    llama_cmpl = DRIVERS["openai-completions"].body(req, DriverOptions(json_dialect="llamacpp"))
    assert llama_cmpl["grammar"] == schema_to_gbnf(schema) and "json_schema" not in llama_cmpl
    cmpl = DRIVERS["openai-completions"].body(req, DriverOptions())
    assert json.loads(cmpl["json_schema"]) == schema
    assert cmpl["stream_options"] == {"include_usage": True}


def test_gbnf_for_tool_schema():
    g = schema_to_gbnf(tool_call_schema())
    assert g.startswith("root ::= value\n")
    assert '"\\"search\\""' in g and "{0,100}" in g and "{0,40}" in g
    with pytest.raises(ValueError):
        schema_to_gbnf({"type": "array"})


# ---- drivers: recorded streams ------------------------------------------------------------------
NATIVE_STREAM = (
    b'data: {"text": "The", "meta_info": {"id": "a", "prompt_tokens": 12, '
    b'"completion_tokens": 1, "cached_tokens": 8, "finish_reason": null}}\n\n'
    b'data: {"text": "The cat sat", "meta_info": {"id": "a", "prompt_tokens": 12, '
    b'"completion_tokens": 3, "cached_tokens": 8, "finish_reason": null}}\n\n'
    b'data: {"text": "The cat sat", "meta_info": {"id": "a", "prompt_tokens": 12, '
    b'"completion_tokens": 3, "cached_tokens": 8, '
    b'"finish_reason": {"type": "length", "length": 3}}}\n\n'
    b"data: [DONE]\n\n"
)
# sgl-tpu /v1/completions with stream_options.include_usage: deltas, then a usage chunk
OPENAI_STREAM = (
    b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "The",'
    b' "finish_reason": null}]}\n\n'
    b'data: {"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n'
    b'data: {"id": "c", "choices": [{"index": 0, "text": " cat", "finish_reason": "length"}]}'
    b"\n\n"
    b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, '
    b'"total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 8}}}\n\n'
    b"data: [DONE]\n\n"
)
# llama.cpp chat: CRLF, a role-only first delta, no usage at all
LLAMACPP_CHAT_STREAM = (
    b'data: {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, '
    b'"finish_reason": null}]}\r\n\r\n'
    b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}, '
    b'"finish_reason": null}]}\r\n\r\n'
    b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "lo"}, '
    b'"finish_reason": null}]}\r\n\r\n'
    b'data: {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}'
    b"\r\n\r\n"
    b"data: [DONE]\r\n\r\n"
)


def feed(api: str, raw: bytes) -> StreamState:
    state = StreamState()
    driver = DRIVERS[api]
    for t, line in enumerate(raw.splitlines()):
        data = parse_sse_line(line)
        if data is DONE:
            break
        if data is not None:
            driver.update(state, data, float(t))
    return state


def test_native_stream_parsing():
    s = feed("native", NATIVE_STREAM)
    assert s.text == "The cat sat" and s.finish_reason == "length"
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (12, 3, 8)
    assert s.chunk_tokens == [1, 3] and len(s.chunk_times) == 2  # the final event adds none


def test_openai_completions_stream_parsing():
    s = feed("openai-completions", OPENAI_STREAM)
    assert s.text == "The cat" and s.finish_reason == "length"
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (12, 2, 8)
    assert s.chunk_tokens == [1, 2]  # the empty delta is no chunk


def test_llamacpp_chat_stream_parsing():
    s = feed("openai-chat", LLAMACPP_CHAT_STREAM)
    assert s.text == "Hello" and s.finish_reason == "length"
    assert s.prompt_tokens is None and s.completion_tokens is None and s.cached_tokens is None
    assert s.chunk_tokens == [1, 2]


def test_stream_error_events():
    assert parse_sse_line(b": ping") is None and parse_sse_line(b"") is None
    with pytest.raises(StreamError, match="boom"):
        parse_sse_line(b'data: {"error": {"message": "boom"}}')
    with pytest.raises(StreamError, match="out of memory"):
        DRIVERS["native"].update(StreamState(), {"text": "", "meta_info": {
            "finish_reason": {"type": "abort", "message": "out of memory"}}}, 0.0)


# ---- runner -------------------------------------------------------------------------------------
def test_runner_loops_context_and_forks():
    sent: list[GenRequest] = []

    async def send(req, program_id, step, branch):
        sent.append(req)
        return RequestRecord(program_id, step, branch, 0.0, 0.0, text=f"A{step}.{branch}")

    program = Program("p", "sess-p", "SYS", (
        Gen("Q", 4), Gen("OBS", 4), Fork(("b0", "b1"), 4, "judge: {candidates}", 2, chosen=1),
        Gen("last", 4)))
    trace = asyncio.run(ProgramRunner(send, render, RunOptions(progress=False, session_hint=True))
                        .run([program]))
    assert len(trace.records) == program.num_requests == 6
    second = sent[1].messages
    assert [m["content"] for m in second] == ["SYS", "Q", "A0.-1", "OBS"]  # the loop carries
    assert sent[1].prompt == render(second)
    judge = sent[4].messages[-1]["content"]
    assert "1. A2.0" in judge and "2. A2.1" in judge
    last = [m["content"] for m in sent[5].messages]
    assert last == ["SYS", "Q", "A0.-1", "OBS", "A1.-1", "b1", "A2.1", "last"]
    assert {r.session_id for r in sent} == {"sess-p"}
    assert len({r.seed for r in sent}) == len(sent)


def test_runner_tool_latency_between_turns_only():
    times: list[float] = []

    async def send(req, program_id, step, branch):
        times.append(time.perf_counter())
        return RequestRecord(program_id, step, branch, 0.0, 0.0, text="x")

    program = Program("p", "s", "SYS", (Gen("Q", 4), Gen("OBS", 4), Gen("OBS2", 4)))
    t0 = time.perf_counter()
    asyncio.run(ProgramRunner(send, render, RunOptions(progress=False,
                                                       tool_latency_s=(0.05, 0.05)))
                .run([program]))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) == 3 and all(g >= 0.05 for g in gaps)  # after each turn but the last
    assert time.perf_counter() - t0 < 0.05 * 2 + 2.0
    with pytest.raises(ValueError, match="tool latency"):
        RunOptions(tool_latency_s=(-1, 0))
    with pytest.raises(ValueError, match="tool latency"):
        RunOptions(tool_latency_s=(2, 1))


def test_tool_latency_range_is_seeded_per_call():
    opts = RunOptions(seed=3, tool_latency_s=(1.0, 10.0))
    waits = [tool_latency(opts, f"p{i}", step) for i in range(4) for step in range(3)]
    assert all(1.0 <= w <= 10.0 for w in waits) and len(set(waits)) == len(waits)
    assert waits == [tool_latency(opts, f"p{i}", step) for i in range(4) for step in range(3)]
    assert tool_latency(RunOptions(seed=4, tool_latency_s=(1.0, 10.0)), "p0", 0) != waits[0]
    assert parse_latency("2.5") == (2.5, 2.5) and parse_latency("1:10") == (1.0, 10.0)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_latency("10:1")


def test_runner_failed_request_ends_program():
    async def send(req, program_id, step, branch):
        return RequestRecord(program_id, step, branch, 0.0, 0.0, error="HTTP 500: x")

    programs = make_workload("react", SMALL, 0)
    trace = asyncio.run(ProgramRunner(send, render, RunOptions(progress=False)).run(programs))
    assert len(trace.records) == len(programs)  # one failed first turn each, nothing after
    s = summarize(trace)
    assert s["programs_ok"] == 0 and s["requests_failed"] == len(programs)
    assert s["errors"] == ["HTTP 500: x"]


def test_arrivals():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    a = arrival_times(50, 10.0, 1)
    assert a == arrival_times(50, 10.0, 1) and a[0] == 0.0 and a == sorted(a)
    assert 2.0 < a[-1] < 10.0  # about 49 / 10 s


# ---- client against a tiny local server ---------------------------------------------------------
async def _native_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = body["sampling_params"]["max_new_tokens"]
    if "fail" in body["text"]:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(1, n + 1):
        meta = {"prompt_tokens": 10, "completion_tokens": i, "cached_tokens": 4,
                "finish_reason": {"type": "length"} if i == n else None}
        data = {"text": "x" * i, "meta_info": meta}
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _llamacpp_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        reason = "length" if i == body["max_tokens"] - 1 else None
        chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": reason}]}
        await resp.write(f"data: {json.dumps(chunk)}\r\n\r\n".encode())
    await resp.write(b"data: [DONE]\r\n\r\n")
    return resp


async def _with_server(fn):
    app = web.Application()
    app.router.add_post("/generate", _native_handler)
    app.router.add_post("/v1/completions", _llamacpp_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await fn(session, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_client_native_and_llamacpp_style_streams():
    async def go(session, url):
        native = Client(session, url, DRIVERS["native"], DriverOptions(), count_words)
        ok = await native.send(GenRequest([], "hello there", 3), "p", 0, -1)
        bad = await native.send(GenRequest([], "please fail", 3), "q", 0, -1)
        llama = Client(session, url, DRIVERS["openai-completions"],
                       DriverOptions(json_dialect="llamacpp"), count_words)
        peer = await llama.send(GenRequest([], "one two three", 4), "r", 0, -1)
        return ok, bad, peer

    ok, bad, peer = asyncio.run(_with_server(go))
    assert ok.ok and ok.text == "xxx" and ok.chunk_tokens == [1, 2, 3]
    assert (ok.prompt_tokens, ok.completion_tokens, ok.cached_tokens) == (10, 3, 4)
    assert ok.prompt_tokens_source == "server" and ok.ttft_s is not None
    assert not bad.ok and bad.error.startswith("HTTP 400") and "bad prompt" in bad.error
    assert peer.ok and peer.text == " w0 w1 w2 w3" and peer.cached_tokens is None
    assert peer.prompt_tokens == 3 and peer.prompt_tokens_source == "tokenizer"
    assert peer.completion_tokens == 4 and peer.completion_tokens_source == "tokenizer"


# ---- metrics ------------------------------------------------------------------------------------
def recorded_trace() -> Trace:
    return Trace(wall_s=2.0, num_programs=2, records=[
        RequestRecord("a", 0, -1, start_s=0.0, end_s=1.4, chunk_times=[0.5, 0.7, 1.3],
                      chunk_tokens=[1, 2, 4], prompt_tokens=100, completion_tokens=4,
                      cached_tokens=60),
        RequestRecord("a", 1, -1, start_s=1.2, end_s=1.6, chunk_times=[1.5, 1.6],
                      chunk_tokens=[1, 2], prompt_tokens=150, completion_tokens=2,
                      cached_tokens=140),
        RequestRecord("b", 0, -1, start_s=0.0, end_s=0.3, error="HTTP 503: down"),
    ])


def test_metrics_from_recorded_trace():
    s = summarize(recorded_trace())
    assert (s["programs_ok"], s["programs_failed"]) == (1, 1)
    assert (s["requests"], s["requests_failed"]) == (3, 1)
    assert s["programs_per_s"] == pytest.approx(0.5)
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert (s["prompt_tokens"], s["generated_tokens"]) == (250, 6)
    assert s["prompt_tok_per_s"] == pytest.approx(125.0)
    assert s["gen_tok_per_s"] == pytest.approx(3.0)
    assert s["total_tok_per_s"] == pytest.approx(128.0)
    # TTFT: 0.5 and 0.3 (the failed request has none)
    assert s["ttft_s"]["mean"] == pytest.approx(0.4)
    assert s["ttft_s"]["p50"] == pytest.approx(0.4)
    assert s["ttft_s"]["p90"] == pytest.approx(0.48)
    assert s["ttft_s"]["p99"] == pytest.approx(0.498)
    # ITL samples: 0.2 (1 token), 0.6 / 2 twice, 0.1 -> [0.1, 0.2, 0.3, 0.3]
    assert s["itl_s"]["mean"] == pytest.approx(0.225)
    assert s["itl_s"]["p50"] == pytest.approx(0.25)
    assert s["itl_s"]["p90"] == pytest.approx(0.3)
    assert s["latency_s"]["mean"] == pytest.approx(0.9)
    assert s["cached_tokens"] == 200 and s["cache_hit_rate"] == pytest.approx(0.8)
    assert s["errors"] == ["HTTP 503: down"]
    # per turn: program a's two turns (b's failed request counts nowhere)
    first, second = s["by_turn"]
    assert (first["turn"], first["requests"], first["prompt_tokens_mean"]) == (0, 1, 100)
    assert first["cache_hit_rate"] == pytest.approx(0.6)
    assert second["cache_hit_rate"] == pytest.approx(140 / 150)
    assert first["ttft_s_p50"] == pytest.approx(0.5) and second["ttft_s_p50"] == pytest.approx(0.3)
    assert first["itl_s_p50"] == pytest.approx(0.3)  # [0.2, 0.3, 0.3]
    assert second["itl_s_p50"] == pytest.approx(0.1)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_metrics_without_cache_reports_and_roundtrip():
    trace = recorded_trace()
    for r in trace.records:
        r.cached_tokens = None
    s = summarize(trace)
    assert s["cache_hit_rate"] is None and s["cached_tokens"] is None
    again = Trace.from_dict(json.loads(json.dumps(trace.to_dict(with_text=True))))
    assert again == trace
    table = format_table({"sgl-tpu": {"react": s}, "peer": {"react": s}})
    assert table.count("react") == 2
    r = ratios({"x": {"react": s}, "y": {"react": {**s, "programs_per_s": 0.25}}})
    assert r["react"]["x_vs_y"]["throughput_x"] == pytest.approx(2.0)


def test_spec_counters_are_the_runs_delta():
    before = {"stats": {"num_decode_steps": 10, "spec_verify_reqs": 2, "spec_draft_tokens": 5,
                        "spec_accepted_tokens": 4, "generated_tokens": 99}}
    after = {"stats": {"num_decode_steps": 30, "spec_verify_reqs": 7, "spec_draft_tokens": 25,
                       "spec_accepted_tokens": 20, "generated_tokens": 150}}
    assert spec_counters(before, after) == {"server_stats": {
        "num_decode_steps": 20, "spec_verify_reqs": 5, "spec_draft_tokens": 20,
        "spec_accepted_tokens": 16}}
    assert spec_counters(None, after) == {} and spec_counters({"memory": {}}, after) == {}


# ---- target specs -------------------------------------------------------------------------------
def test_target_specs():
    t = parse_target("sgl-tpu=launch:")
    assert (t.kind, t.value, t.api, t.json_dialect) == ("launch", "", "native", "openai")
    t = parse_target("nocache=launch:--disable-radix-cache --foo a,b")
    assert t.value == "--disable-radix-cache --foo a,b"
    t = parse_target("llamacpp=url:http://127.0.0.1:8091,api:openai-completions,json:llamacpp")
    assert (t.kind, t.value, t.api, t.json_dialect) == (
        "url", "http://127.0.0.1:8091", "openai-completions", "llamacpp")
    t = parse_target("peer=llamacpp:/venv/bin/python,args:--cache True")
    assert (t.api, t.json_dialect, t.args) == ("openai-completions", "llamacpp", "--cache True")
    t = parse_target("peer=llama-server:/opt/bin/llama-server,args:-np 4 --cache-ram 2048")
    assert (t.kind, t.value, t.api, t.args) == (
        "llama-server", "/opt/bin/llama-server", "openai-completions", "-np 4 --cache-ram 2048")
    for bad in ("noequals", "x=url:", "x=launch:,url:http://h", "x=url:http://h,api:grpc",
                "x=bogus:1"):
        with pytest.raises(ValueError):
            parse_target(bad)


# ---- end to end against a real server -----------------------------------------------------------
@pytest.mark.slow
def test_cli_against_real_server(tiny_model, tmp_path):
    from server_harness import TINY_F32, launch_server

    # its own server: the session hints leave retained KV behind
    with launch_server(*TINY_F32, model_path=tiny_model) as server:
        out = tmp_path / "result.json"
        main(["--base-url", server.base_url, "--model-path", tiny_model, "--workloads",
              "multi-turn-chat", "shared-prefix", "--num-programs", "2",
              "--turns", "2", "--output-tokens", "4", "--system-tokens", "30",
              "--observation-tokens", "10", "--warmup-programs", "0", "--no-progress",
              "--session-hint", "--chat-template", "chatml", "--output", str(out)])
        result = json.loads(out.read_text())
    chat = result["runs"]["server"]["multi-turn-chat"]
    assert chat["requests"] == 4 and chat["requests_failed"] == 0, chat["errors"]
    # fixed output mode: every request generates exactly its max tokens
    assert chat["generated_tokens"] == result["workloads"]["multi-turn-chat"]["tokens"][
        "max_new_tokens"]
    assert chat["cache_hit_rate"] > 0  # turn 2 reuses turn 1's prefix
    assert chat["ttft_s"]["p50"] is not None
    assert result["runs"]["server"]["shared-prefix"]["programs_ok"] == 2
    # per turn (rendered with the chatml template): each user's second turn resends the first
    first, second = chat["by_turn"]
    assert (first["requests"], second["requests"]) == (2, 2)
    assert second["prompt_tokens_mean"] > first["prompt_tokens_mean"]
    assert second["cache_hit_rate"] > 0
    assert result["server_compute"]["server"]["backend"] in ("jax", "torch")
