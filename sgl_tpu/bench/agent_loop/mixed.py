"""Mixed traffic (`--mixed-batch N`): interactive agents beside a batch of long completions, the
measurement of priority scheduling. Per target and workload, three phases on the same server,
each after a cache flush:

    alone             the workload's agents by themselves
    without_priority  the agents, and N long completions all sent at once; no `priority` sent
    with_priority     the same, the agents at --interactive-priority, the batch at
                      --batch-priority

The server decides what `priority` does: one launched with --enable-priority-scheduling
schedules by it; without the flag the last phase differs from the middle one only in eviction
order (--radix-eviction-policy priority). Reported per phase: the agents' summary (metrics.py:
TTFT p50 / p99, ...) and the batch's (its generated tokens/s over its own wall time, first
request sent to last answer), the server's `num_priority_preemptions` during the phase, and
ratios within the run: the agents' TTFT p50 and p99 over their TTFT alone, and the batch's
tokens/s with priorities over without.
"""

from __future__ import annotations

import random
from typing import Any

from sgl_tpu.bench.agent_loop import text
from sgl_tpu.bench.agent_loop.workloads import Gen, Program

PHASES = ("alone", "without_priority", "with_priority")
BATCH_TASK = "Rewrite the notes above as a detailed report, section by section."


def batch_programs(num: int, prompt_tokens: int, output_tokens: int, seed: int
                   ) -> list[Program]:
    """`num` single requests, each its own ~`prompt_tokens`-token notes (no shared prefix)
    and `output_tokens` to generate."""
    rng = random.Random(f"batch/{seed}")
    return [Program(f"batch{i}", f"batch{i}", text.paragraph(rng, prompt_tokens),
                    (Gen(BATCH_TASK, output_tokens),)) for i in range(num)]


def phase_priorities(phase: str, interactive: int, batch: int
                     ) -> tuple[int | None, int | None]:
    """(the agents' priority, the batch's) sent in `phase` (None: no field)."""
    return (interactive, batch) if phase == "with_priority" else (None, None)


def preemptions(info: dict[str, Any] | None) -> int | None:
    """The server's count of retractions for a higher priority (sgl-tpu's /server_info)."""
    if not info:
        return None
    return info.get("stats", {}).get("num_priority_preemptions")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mixed_ratios(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Within one target: the agents' TTFT over alone per phase, the batch's tokens/s with
    priorities over without (>1: the batch ran faster with priorities)."""
    alone = phases["alone"]["interactive"]["ttft_s"]
    out: dict[str, Any] = {}
    for q in ("p50", "p99"):
        out[f"ttft_{q}_over_alone"] = {
            phase: _ratio(phases[phase]["interactive"]["ttft_s"][q], alone[q])
            for phase in PHASES[1:]}
    out["batch_gen_tok_per_s_with_over_without"] = _ratio(
        phases["with_priority"]["batch"]["gen_tok_per_s"],
        phases["without_priority"]["batch"]["gen_tok_per_s"])
    return out


def runs_rows(workload: str, phases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The agents' summaries as rows of the main table: alone, +batch, +batch+priority."""
    names = {"alone": workload, "without_priority": f"{workload}+batch",
             "with_priority": f"{workload}+batch+prio"}
    return {names[phase]: phases[phase]["interactive"] for phase in PHASES}
