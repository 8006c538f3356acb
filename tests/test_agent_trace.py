"""The agent-trace workload (generator, subagents, compaction) and the reuse oracle.

Fast tests drive the generator, the runner (with a fake send) and the oracle (with a
character tokenizer); the slow one runs a tiny trace through the CLI against the default model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics

import pytest

from sgl_tpu.bench.agent_loop.__main__ import main, parse_workload, warmup_config
from sgl_tpu.bench.agent_loop.agent_trace import (
    HEAD_MESSAGES,
    TraceConfig,
    bounded_pareto,
    compact,
    compaction_summary,
)
from sgl_tpu.bench.agent_loop.oracle import oracle_report, oracle_tokens, page_hashes
from sgl_tpu.bench.agent_loop.runner import ProgramRunner, RunOptions
from sgl_tpu.bench.agent_loop.trace import RequestRecord
from sgl_tpu.bench.agent_loop.workloads import (
    Gen,
    Subagent,
    WorkloadConfig,
    describe,
    make_workload,
)

TRACE = WorkloadConfig(num_programs=40)


def trace(cfg: WorkloadConfig = TRACE, seed: int = 0):
    return make_workload("agent-trace", cfg, seed)


def parent_calls(program) -> int:
    return len(program.steps)


def gens(program) -> list[Gen]:
    out: list[Gen] = []
    for s in program.steps:
        out += [s] if isinstance(s, Gen) else [*s.calls, s.summary, s.report]
    return out


# ---- generator ----------------------------------------------------------------------------------
def test_same_seed_same_trace():
    assert trace() == trace()
    assert trace() != trace(seed=1)


def test_bounds_and_heavy_tails():
    programs = trace()
    calls = [parent_calls(p) for p in programs]
    assert min(calls) >= 20 and max(calls) <= 60
    assert statistics.median(calls) < 40  # most agents near the lower bound
    pauses = [g.pause_s for p in programs for g in gens(p) if g.pause_s]
    assert min(pauses) >= 0.2 and max(pauses) <= 30.0
    assert statistics.median(pauses) < 1.0 and max(pauses) > 5.0
    for p in programs:  # no tool runs after an agent's last answer
        last = p.steps[-1]
        assert (last.pause_s if isinstance(last, Gen) else last.report.pause_s) == 0.0
    rng = random.Random(0)
    draws = [bounded_pareto(rng, 200, 2000, 1.0) for _ in range(2000)]
    assert 200 <= min(draws) and max(draws) <= 2000
    assert statistics.median(draws) < 500 and max(draws) > 1500
    # tool outputs: text of about the drawn tokens (text.CHARS_PER_TOKEN chars each)
    outputs = [len(g.user) / 3.2 for p in programs for g in gens(p)
               if g.user.startswith("Tool output:")]
    assert 180 < min(outputs) and max(outputs) < 2100


def test_subagents_fork_with_their_shape():
    programs = trace()
    subs = [s for p in programs for s in p.steps if isinstance(s, Subagent)]
    assert subs and any(not any(isinstance(s, Subagent) for s in p.steps) for p in programs)
    for s in subs:
        assert 5 <= len(s.calls) <= 15
        assert s.task.startswith("Delegate") and s.summary.pause_s == 0.0
        assert s.report.user.startswith("Subagent report")
    for p in programs:  # a subagent's calls, its summary and the parent's report call
        assert p.num_requests == sum(1 if isinstance(s, Gen) else len(s.calls) + 2
                                     for s in p.steps)
    counted = describe(programs, lambda t: len(t) // 4)
    assert counted["subagents"] == len(subs) and counted["distinct_system_prompts"] == 1


def test_scale_knobs_and_overrides():
    name, cfg = parse_workload(
        "agent-trace:num_programs=3,calls_scale=0.1,tool_tokens_scale=0.1,pause_scale=0,"
        "context_tokens=1024", TRACE)
    assert name == "agent-trace" and cfg.num_programs == 3
    assert cfg.trace.scaled() == {"calls": (2, 6), "subagent_calls": (1, 2),
                                  "tool_tokens": (20, 200), "pause_s": (0.0, 0.0)}
    programs = trace(cfg)
    assert len(programs) == 3 and all(2 <= parent_calls(p) <= 6 for p in programs)
    assert all(g.pause_s == 0 for p in programs for g in gens(p))
    assert all(p.compaction.context_tokens == 1024 for p in programs)
    warm = warmup_config(cfg, None)
    assert all(len(p.steps) == 2 for p in trace(warm))
    with pytest.raises(ValueError):
        parse_workload("agent-trace:calls_alpha=0", TRACE)
    with pytest.raises(ValueError):
        TraceConfig(calls_min=30, calls_max=20)


# ---- compaction ---------------------------------------------------------------------------------
def exchange(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "task"},
            {"role": "assistant", "content": "a0"}]
    for i in range(1, n + 1):
        msgs += [{"role": "user", "content": f"out{i}" * 10},
                 {"role": "assistant", "content": f"a{i}"}]
    return msgs + [{"role": "user", "content": "new"}]


def test_compact_replaces_the_oldest_outputs_after_the_head():
    msgs = exchange(5)
    size = lambda m: sum(len(x["content"]) for x in m)  # noqa: E731
    out = compact(msgs, "SUMMARY", lambda m: size(m) <= size(msgs) - 100)
    assert out[:HEAD_MESSAGES] == msgs[:HEAD_MESSAGES]  # the cached prefix up to the cut
    assert out[HEAD_MESSAGES] == {"role": "user", "content": "SUMMARY"}
    # the fewest exchanges that fit (each is 40-41 characters): three, keeping answer 3
    assert out[HEAD_MESSAGES + 1]["content"] == "a3" and out[-1]["content"] == "new"
    assert [m["content"] for m in out[HEAD_MESSAGES + 2:-1]] == ["out4" * 10, "a4",
                                                                 "out5" * 10, "a5"]
    roles = [m["role"] for m in out[1:]]
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    # nothing fits: every exchange goes; no exchange: nothing to compact
    assert len(compact(msgs, "S2", lambda m: False)) == HEAD_MESSAGES + 3
    assert compact(exchange(0), "S3", lambda m: True) is None
    assert compaction_summary("p", 1, 20) == compaction_summary("p", 1, 20)
    assert compaction_summary("p", 1, 20) != compaction_summary("p", 2, 20)


def render(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def test_runner_forks_subagents_and_compacts():
    cfg = WorkloadConfig(num_programs=2, output_tokens=4, system_tokens=20)
    tc = TraceConfig(calls_scale=0.3, tool_tokens_scale=0.2, pause_scale=0,
                     subagent_share=0.5, context_tokens=600)
    programs = trace(dataclasses.replace(cfg, trace=tc), seed=3)
    assert any(isinstance(s, Subagent) for p in programs for s in p.steps)
    clock = iter(range(10**6))

    async def send(req, program_id, step, branch):
        t = next(clock)
        return RequestRecord(program_id, step, branch, t, t + 0.5, [t + 0.25], [1],
                             prompt_tokens=len(req.prompt) // 4, completion_tokens=1,
                             text=f"answer {program_id} {step} {branch}")

    runner = ProgramRunner(send, render, RunOptions(progress=False), count_tokens=lambda t:
                           len(t) // 4)
    records = asyncio.run(runner.run(programs)).records
    assert len(records) == sum(p.num_requests for p in programs)
    by_key = {(r.program_id, r.step, r.branch): r for r in records}
    forked = [r for r in records if r.forked]
    assert forked and all(r.branch == 0 for r in forked)
    for r in forked:  # forked from the parent's context: its last answer is in the prompt
        parent = max((p for p in records if p.program_id == r.program_id and p.branch == -1
                      and p.step < r.step), key=lambda p: p.step)
        assert parent.text in r.prompt and "Subagent task" in r.prompt
        report = by_key[(r.program_id, r.step, -1)]
        summary = max((p for p in records if p.program_id == r.program_id
                       and p.step == r.step), key=lambda p: p.branch)
        assert summary.text in report.prompt and summary.text not in r.prompt
    compacted = [r for r in records if r.compacted]
    assert compacted and sum(runner.compactions.values()) == len(compacted)
    for r in compacted:  # every prompt stays under the limit; the head stays in front
        assert "Summary of the earlier tool outputs" in r.prompt
        assert r.prompt.startswith(render([{"role": "system", "content": programs[0].system}])
                                   .removesuffix("<assistant>"))
    assert max(len(r.prompt) // 4 + 4 for r in records) <= 600


# ---- oracle -------------------------------------------------------------------------------------
def encode(text: str, special: bool) -> list[int]:
    return ([0] if special else []) + [ord(c) for c in text]


def rec(start: float, end: float, prompt: str, answer: str, cached: int | None = 0,
        **kw) -> RequestRecord:
    return RequestRecord("p", 0, -1, start, end, prompt=prompt, text=answer,
                         cached_tokens=cached, prompt_tokens=len(prompt) + 1, **kw)


def test_page_hashes_chain_whole_pages():
    assert len(page_hashes(list(range(10)), 4)) == 2
    a, b = page_hashes([1, 2, 3, 4, 5, 6], 2), page_hashes([9, 2, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1]  # a page's hash covers everything before it


def test_oracle_counts_prompts_sent_and_answers_finished_before():
    first = rec(0, 10, "abcdefgh", "XYZW")
    # sent before `first` ended: reuses its prompt ([0] + 8 chars), not its answer
    during = rec(1, 2, "abcdefghXY-during", "")
    # after it ended: its answer too, less the last token ("XYZ"), longer than `during`'s "XY"
    after = rec(11, 12, "abcdefghXYZWmore", "")
    records = [first, during, after]
    prompts = [encode(r.prompt, True) for r in records]
    assert oracle_tokens(records, prompts, encode, 1) == [0, 9, 12]
    assert oracle_tokens(records, prompts, encode, 4) == [0, 8, 12]  # whole pages of 4
    # never more than the prompt less one token, even for a repeat
    again = [rec(0, 1, "abc", "d"), rec(2, 3, "abc", "")]
    assert oracle_tokens(again, [encode(r.prompt, True) for r in again], encode, 1) == [0, 3]


def test_oracle_report_parts():
    records = [rec(0, 1, "system one", "ans", cached=0),
               rec(2, 3, "system oneans+next", "x", cached=12, compacted=True),
               rec(4, 5, "system two", "y", cached=None, forked=True),
               rec(6, 7, "failed", "", error="boom")]
    report = oracle_report(records, encode, 1)
    assert report["requests"] == 3 and report["oracle_tokens"] == 13 + 8
    assert report["reused_tokens"] == 12
    assert report["reused_over_oracle"] == pytest.approx(12 / 21)
    assert report["after_compaction"] == {"requests": 1, "reused_tokens": 12,
                                          "oracle_tokens": 13,
                                          "reused_over_oracle": pytest.approx(12 / 13)}
    assert report["subagent_first_call"]["oracle_tokens"] == 8
    assert report["requests_over_oracle"] == 0 and report["prompt_token_mismatches"] == 0
    assert oracle_report([rec(0, 1, "a", "b", cached=None)], encode, 1) is None


# ---- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_trace_against_the_default_model(default_model_server, tmp_path):
    out = tmp_path / "trace.json"
    # seed 1: 24 requests, 5 subagents, 3 compactions (a 1,024-token limit)
    workload = ("agent-trace:num_programs=2,output_tokens=8,system_tokens=200,calls_scale=0.2,"
                "tool_tokens_scale=0.25,pause_scale=0.01,subagent_share=0.4,"
                "context_tokens=1024")
    main(["--base-url", default_model_server.base_url, "--workloads", workload,
          "--warmup-programs", "0", "--no-progress", "--seed", "1", "--output", str(out)])
    result = json.loads(out.read_text())
    run = result["runs"]["server"]["agent-trace"]
    assert run["requests_failed"] == 0, run["errors"]
    assert run["subagents"] >= 1 and run["compactions"] >= 1
    assert run["context_tokens"] == 1024
    oracle = run["oracle"]
    assert oracle["page_size"] == default_model_server.info()["page_size"]
    assert oracle["prompt_token_mismatches"] == 0
    assert 0 < oracle["reused_tokens"] <= oracle["oracle_tokens"]
    assert oracle["requests_over_oracle"] == 0
    assert oracle["reused_over_oracle"] > 0.9  # a cache that loses prefixes falls below
    for part in ("after_compaction", "subagent_first_call"):
        assert oracle[part]["reused_over_oracle"] > 0.9, part
    generator = result["workloads"]["agent-trace"]["config"]["trace"]
    assert generator["calls_scale"] == 0.2 and generator["calls_min"] == 20
