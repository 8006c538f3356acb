"""Summaries -> a fixed-width text table (one row per workload x target)."""

from __future__ import annotations

from typing import Any

COLUMNS = (
    ("workload", 16), ("target", 18), ("wall s", 8), ("prog/s", 8), ("prompt t/s", 10),
    ("gen t/s", 8), ("TTFT p50", 9), ("TTFT p90", 9), ("ITL p50 ms", 10), ("hit rate", 8),
    ("gen tok", 8), ("reuse/orc", 9), ("fail", 5),
)


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def row_values(workload: str, target: str, s: dict[str, Any]) -> list[str]:
    itl = s["itl_s"]["p50"]
    return [workload, target, _fmt(s["wall_s"], 1), _fmt(s["programs_per_s"], 3),
            _fmt(s["prompt_tok_per_s"], 1), _fmt(s["gen_tok_per_s"], 1),
            _fmt(s["ttft_s"]["p50"], 3), _fmt(s["ttft_s"]["p90"], 3),
            _fmt(None if itl is None else itl * 1000, 1), _fmt(s["cache_hit_rate"], 3),
            str(s["generated_tokens"]),
            _fmt((s.get("oracle") or {}).get("reused_over_oracle"), 3),
            f"{s['requests_failed']}/{s['requests']}"]


def format_table(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """`runs[target][workload]` -> table text, grouped by workload."""
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    lines.append("-" * len(lines[0]))
    workloads = list(dict.fromkeys(w for per_target in runs.values() for w in per_target))
    for w in workloads:
        for target, per_target in runs.items():
            if w in per_target:
                cells = zip(row_values(w, target, per_target[w]), COLUMNS, strict=True)
                lines.append("  ".join(c.rjust(width) for c, (_, width) in cells))
    return "\n".join(lines)
