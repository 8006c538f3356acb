"""Trace -> summary metrics (what the table, the JSON file and the plot show).

Definitions:
  wall_s            the run's wall time (first request sent -> last answer done)
  programs_per_s    programs whose every request succeeded, per second of wall time
  *_tok_per_s       prompt / generated / both tokens of successful requests per second
  ttft_s            per request: first chunk carrying output - request sent
  itl_s             per generated token after the first: the gap between two chunks divided
                    by the tokens the later chunk carried (one sample per token, so a chunk of
                    n tokens after a gap g gives n samples of g / n)
  latency_s         per request: last byte - request sent
  program_s         per program whose every request succeeded: its last answer done - its
                    first request sent (program completion time, tool pauses included)
  trajectory_tokens sum over programs of their longest request (prompt + output): what the
                    KV pool would hold to keep every agent's trajectory at once
  cache_hit_rate    sum(cached_tokens) / sum(prompt_tokens) over requests whose server reported
                    cached_tokens (None when none did)
  valid_tool_call_share  calls whose name is offered and whose arguments validate against its
                    schema, over all calls made (None when no request offered tools)
  compactions       requests sent right after their program compacted its context
  subagents         subagents started (their first requests)
  by_turn           per program step (an agent's turn), over its successful one-answer requests:
                    requests, mean prompt tokens, cache_hit_rate, ttft_s and itl_s p50 (how a
                    growing context's turns fare: the later turns' cached share, ITL at 20k
                    tokens against 1k)
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from typing import Any

from sgl_tpu.bench.agent_loop.trace import RequestRecord, Trace

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = q / 100 * (len(sorted_values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (None for no values)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    s = sorted(values)
    return {"mean": sum(s) / len(s), **{f"p{q}": percentile(s, q) for q in PERCENTILES}}


def itl_samples(record: RequestRecord) -> list[float]:
    samples: list[float] = []
    times, tokens = record.chunk_times, record.chunk_tokens
    for i in range(1, len(times)):
        num_tokens = max(1, tokens[i] - tokens[i - 1])
        samples += [(times[i] - times[i - 1]) / num_tokens] * num_tokens
    return samples


def trajectory_tokens(records: list[RequestRecord]) -> int:
    longest: dict[str, int] = {}
    for r in records:
        longest[r.program_id] = max(longest.get(r.program_id, 0),
                                    r.prompt_tokens + r.completion_tokens)
    return sum(longest.values())


def program_times(records: list[RequestRecord], failed: set[str]) -> list[float]:
    spans: dict[str, tuple[float, float]] = {}
    for r in records:
        lo, hi = spans.get(r.program_id, (r.start_s, r.end_s))
        spans[r.program_id] = (min(lo, r.start_s), max(hi, r.end_s))
    return [hi - lo for p, (lo, hi) in spans.items() if p not in failed]


def _hit_rate(records: list[RequestRecord]) -> float | None:
    """sum(cached_tokens) / sum(prompt_tokens) over the records whose server reported it."""
    reported = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None


def by_turn(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """The `by_turn` rows (module doc), in step order."""
    steps: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.ok and r.branch == -1:
            steps.setdefault(r.step, []).append(r)
    rows = []
    for step, rs in sorted(steps.items()):
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        rows.append({"turn": step, "requests": len(rs),
                     "prompt_tokens_mean": sum(r.prompt_tokens for r in rs) / len(rs),
                     "cache_hit_rate": _hit_rate(rs),
                     "ttft_s_p50": distribution(ttft)["p50"],
                     "itl_s_p50": distribution([x for r in rs for x in itl_samples(r)])["p50"]})
    return rows


def summarize(trace: Trace) -> dict[str, Any]:
    ok = [r for r in trace.records if r.ok]
    failed_programs = {r.program_id for r in trace.records if not r.ok}
    programs_ok = trace.num_programs - len(failed_programs)
    wall = trace.wall_s
    prompt = sum(r.prompt_tokens for r in ok)
    generated = sum(r.completion_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    constrained = [r for r in ok if r.constrained]
    tool_requests = [r for r in ok if r.tool_request]
    num_calls = sum(len(r.tool_calls) for r in tool_requests)
    invalid_calls = sum(r.invalid_tool_calls for r in tool_requests)

    def per_s(x: float) -> float:
        return x / wall if wall > 0 else 0.0

    return {
        "wall_s": wall,
        "programs": trace.num_programs,
        "programs_ok": programs_ok,
        "programs_failed": len(failed_programs),
        "requests": len(trace.records),
        "requests_failed": len(trace.records) - len(ok),
        "errors": sorted({r.error for r in trace.records if r.error})[:5],
        "programs_per_s": per_s(programs_ok),
        "requests_per_s": per_s(len(ok)),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "prompt_tok_per_s": per_s(prompt),
        "gen_tok_per_s": per_s(generated),
        "total_tok_per_s": per_s(prompt + generated),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([x for r in ok for x in itl_samples(r)]),
        "latency_s": distribution([r.end_s - r.start_s for r in ok]),
        "program_s": distribution(program_times(trace.records, failed_programs)),
        "trajectory_tokens": trajectory_tokens(ok),
        "cached_tokens": cached if reported else None,
        "cache_hit_rate": _hit_rate(ok),
        "cache_reported_requests": len(reported),
        "constrained_requests": len(constrained),
        "invalid_json": sum(1 for r in constrained if r.valid_json is False),
        "tool_requests": len(tool_requests),
        "tool_calls": num_calls,
        "tool_requests_without_call": sum(1 for r in tool_requests if not r.tool_calls),
        "invalid_tool_calls": invalid_calls,
        "valid_tool_call_share": ((num_calls - invalid_calls) / num_calls if num_calls
                                  else None),
        "token_counts_from": sorted({r.prompt_tokens_source for r in ok}
                                    | {r.completion_tokens_source for r in ok}),
        "compactions": sum(r.compacted for r in trace.records),
        "subagents": sum(r.forked for r in trace.records),
        "by_turn": by_turn(ok),
    }
