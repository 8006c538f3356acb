"""The `agent-trace` workload's parameters, its heavy-tailed draws, and context compaction.

    TraceConfig --workloads.agent_trace(cfg, seed)--> Programs of Gen and Subagent steps
    runner: before each call of a program with `compaction`, compact() when the prompt nears
            the context limit

Draws are bounded Pareto (`bounded_pareto`): most values near the lower bound, a long tail up
to the upper one. A scale knob multiplies both bounds of its quantity, so a test runs a tiny
trace with the same shapes.

Compaction (what coding agents do when their context fills):

    before  [system, task, answer_0, out_1, answer_1, ..., out_k, answer_k, ..., out_n]
    after   [system, task, answer_0, summary, answer_k, out_k+1, ..., out_n]
                                    ^ the cut: the prefix before it stays cached

The oldest tool outputs and the answers to them (an earlier summary counts as one) are replaced
by one short summary, keeping the last replaced answer so that the roles still alternate.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_tpu.bench.agent_loop import text

Messages = list[dict[str, Any]]
HEAD_MESSAGES = 3  # system, the task, the first answer: never compacted


@dataclass(frozen=True)
class TraceConfig:
    """Generator parameters (bounds before scaling; `scaled()` gives the ones used)."""

    calls_min: int = 20  # an agent's calls (its subagents' calls not counted)
    calls_max: int = 60
    calls_alpha: float = 1.0  # Pareto shape of every draw below: smaller, heavier tail
    tool_tokens_min: int = 200  # one tool output
    tool_tokens_max: int = 2000
    tool_tokens_alpha: float = 1.0
    pause_min_s: float = 0.2  # the tool's run time after a call
    pause_max_s: float = 30.0
    pause_alpha: float = 1.0
    subagent_share: float = 0.03  # chance that a parent call spawns a subagent
    subagent_calls_min: int = 5
    subagent_calls_max: int = 15
    summary_tokens: int = 96  # a subagent's summary (generated)
    compaction_summary_tokens: int = 200  # the summary a compaction writes (synthetic)
    context_tokens: int = 0  # the context limit compaction keeps to (0: the server's)
    compact_at: float = 0.85  # compact when prompt + answer would pass this share of it
    compact_to: float = 0.5  # down to this share
    calls_scale: float = 1.0  # scale knobs: both bounds of calls, tool outputs, pauses
    tool_tokens_scale: float = 1.0
    pause_scale: float = 1.0

    def __post_init__(self) -> None:
        for lo, hi in (("calls_min", "calls_max"), ("tool_tokens_min", "tool_tokens_max"),
                       ("pause_min_s", "pause_max_s"),
                       ("subagent_calls_min", "subagent_calls_max")):
            if not 0 < getattr(self, lo) <= getattr(self, hi):
                raise ValueError(f"need 0 < {lo} <= {hi}")
        for name in ("calls_alpha", "tool_tokens_alpha", "pause_alpha", "calls_scale",
                     "tool_tokens_scale", "summary_tokens", "compaction_summary_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.pause_scale < 0 or self.context_tokens < 0:
            raise ValueError("pause_scale and context_tokens must be >= 0")
        if not 0 <= self.subagent_share <= 1:
            raise ValueError("subagent_share must be in [0, 1]")
        if not 0 < self.compact_to < self.compact_at <= 1:
            raise ValueError("need 0 < compact_to < compact_at <= 1")

    def scaled(self) -> dict[str, Any]:
        """The bounds the generator draws from, after the scale knobs."""
        def ints(lo: int, hi: int, scale: float) -> tuple[int, int]:
            return max(1, round(lo * scale)), max(1, round(hi * scale))

        return {"calls": ints(self.calls_min, self.calls_max, self.calls_scale),
                "subagent_calls": ints(self.subagent_calls_min, self.subagent_calls_max,
                                       self.calls_scale),
                "tool_tokens": ints(self.tool_tokens_min, self.tool_tokens_max,
                                    self.tool_tokens_scale),
                "pause_s": (self.pause_min_s * self.pause_scale,
                            self.pause_max_s * self.pause_scale)}

    def for_warmup(self, max_calls: int) -> TraceConfig:
        """At most `max_calls` calls per agent, no subagents, no pauses (the harness's warm-up
        compiles batch shapes; it does not replay the trace)."""
        calls = max(1, min(max_calls, self.calls_min))
        return dataclasses.replace(self, calls_min=calls, calls_max=calls, calls_scale=1.0,
                                   subagent_share=0.0, pause_scale=0.0)

    def with_overrides(self, changes: dict[str, str]) -> TraceConfig:
        """Fields replaced from text values (`agent-trace:pause_scale=0.05,...`)."""
        types = {f.name: f.type for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{
            k: (int(v) if types[k] == "int" else float(v)) for k, v in changes.items()})


@dataclass(frozen=True)
class Compaction:
    """A program's compaction policy (TraceConfig's part the runner needs)."""

    context_tokens: int  # 0: the server's context length
    compact_at: float
    compact_to: float
    summary_tokens: int


def bounded_pareto(rng: random.Random, lo: float, hi: float, alpha: float) -> float:
    """A draw in [lo, hi] with density ~ x^-(alpha+1) (inverse CDF of the bounded Pareto)."""
    if lo == hi:
        return lo
    u = rng.random()
    return lo / (1 - u * (1 - (lo / hi) ** alpha)) ** (1 / alpha)


def draw_int(rng: random.Random, bounds: tuple[int, int], alpha: float) -> int:
    lo, hi = bounds
    return min(hi, max(lo, round(bounded_pareto(rng, lo, hi, alpha))))


def compaction_summary(program_id: str, num: int, approx_tokens: int) -> str:
    """The synthetic summary of compaction `num` of a program (seeded by both)."""
    rng = random.Random(f"compaction/{program_id}/{num}")
    return (f"Summary of the earlier tool outputs (compaction {num}): "
            f"{text.paragraph(rng, approx_tokens)}")


def compact(messages: Messages, summary: str, fits: Callable[[Messages], bool]
            ) -> Messages | None:
    """`messages` (ending in the new user message) with the fewest oldest exchanges after
    HEAD_MESSAGES replaced by `summary` such that `fits(result)`; all of them when nothing
    fits; None when there is no exchange to replace (module doc's diagram)."""
    head, body, new = messages[:HEAD_MESSAGES], messages[HEAD_MESSAGES:-1], messages[-1]
    num_pairs = len(body) // 2
    if len(messages) <= HEAD_MESSAGES or num_pairs == 0:
        return None
    result: Messages = []
    for k in range(1, num_pairs + 1):
        kept_answer = body[2 * k - 1]
        result = [*head, {"role": "user", "content": summary}, kept_answer,
                  *body[2 * k:], new]
        if fits(result):
            break
    return result
