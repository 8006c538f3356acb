"""Agent workloads as data: programs of steps, generated offline and deterministic under a seed.

    Program(system, steps)          one agent / conversation / tree, run as one coroutine
      Gen(user, max_tokens, ...)    append `user`, generate one answer, append it to the context
      Fork(branches, judge, ...)    K answers from the same context in parallel, one judge request
                                    that sees all of them, then keep branch `chosen` as context
      Subagent(task, calls, ...)    a subagent forked from the context: the task, its calls, a
                                    summary request; the summary goes back to the parent, whose
                                    next call reads it

The runner (runner.py) turns steps into requests; each request carries everything generated
before it in that program, which is what makes prefix caching matter. Nothing here depends on
what a server answers, so two servers get the same programs (their generated text, and so the
later prompts, can still differ: token counts are reported per server).

Workloads (modelled on the agentic programs of the SGLang paper):
  react            N agents x T turns: long shared tool prompt; Thought/Action, then Observation
  tool-json        react with a JSON tool call constrained by a JSON schema each turn
  private-react    react where every agent has its own system prompt (nothing shared): the
                   agents-at-scale workload, whose KV working sets add up past the pool
  long-react       react whose observations are long tool outputs (observation_tokens to twice
                   that, drawn per turn): with turns=20, observation_tokens=700 the contexts
                   grow past 20k tokens (a long-context model such as Gemma 3)
  tree-of-thought  per tree, D levels: fork K branches from the state, judge, keep one
  tool-calls       react through OpenAI function tools: each turn is a `tools` request (tool
                   choice "required", the last turn "auto"), results go back as `tool` messages
  tool-calls-named the same loop, each turn naming its function (drawn from the seed): the form
                   servers without "required" (the llama.cpp server) can stream
  multi-turn-chat  M users x C turns, short and long answers alternating at random
  shared-prefix    single requests in G groups, each group sharing a long system prompt
  agent-trace      agents shaped like production traces (agent_trace.py has the parameters):
                   heavy-tailed calls, tool outputs and pauses, subagents, and compaction when
                   a context nears the limit
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgl_tpu.bench.agent_loop import text
from sgl_tpu.bench.agent_loop.agent_trace import (
    Compaction,
    TraceConfig,
    bounded_pareto,
    draw_int,
)
from sgl_tpu.bench.agent_loop.tools import FUNCTION_TOOLS, tool_names


@dataclass(frozen=True)
class Gen:
    user: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    json_schema: dict[str, Any] | None = None
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools (openai-chat API only)
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "required" | a named function
    pause_s: float = 0.0  # the tool's run time after this call (agent-trace)


@dataclass(frozen=True)
class Fork:
    branches: tuple[str, ...]  # the user message of each branch
    max_tokens: int
    judge: str  # judge instruction, with "{candidates}" where the branch answers go
    judge_max_tokens: int
    chosen: int  # the branch whose exchange is kept as context (drawn from the seed)


@dataclass(frozen=True)
class Subagent:
    task: str  # the user message that forks it from the parent's context
    calls: tuple[Gen, ...]  # its first call answers `task`: calls[0].user is unused
    summary: Gen  # the request for its summary
    report: Gen  # the parent's call that reads the summary (its user text comes first)


Step = Gen | Fork | Subagent


@dataclass(frozen=True)
class Program:
    program_id: str
    session: str  # what the `--session-hint` option sends as session_id
    system: str
    steps: tuple[Step, ...]
    compaction: Compaction | None = None  # compact the context near the limit (runner.py)

    @property
    def num_requests(self) -> int:
        return sum(1 if isinstance(s, Gen) else len(s.calls) + 2 if isinstance(s, Subagent)
                   else len(s.branches) + 1 for s in self.steps)


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes shared by all workloads; token sizes are approximate (see text.CHARS_PER_TOKEN)."""

    num_programs: int = 8  # agents, users, trees, or shared-prefix requests
    turns: int = 6  # agent turns, chat turns, or tree depth
    output_tokens: int = 64  # max new tokens per generation (chat: x0.5 short, x2 long)
    system_tokens: int = 1200  # the shared system prompt (react, tool-json, shared-prefix)
    observation_tokens: int = 70  # a tool observation, a pasted chat context, a question
    branches: int = 3  # tree-of-thought fork width
    groups: int = 4  # shared-prefix groups
    trace: TraceConfig = field(default_factory=TraceConfig)  # agent-trace's generator

    def __post_init__(self) -> None:
        for name in ("num_programs", "turns", "output_tokens", "branches", "groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "observation_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


# ---- react / tool-json ----------------------------------------------------------------------
TOOLS = (
    ("search", "Search an encyclopedia index. Input: a short query. Returns numbered snippets."),
    ("lookup", "Look up a keyword inside the last page returned by search."),
    ("calculator", "Evaluate an arithmetic expression. Input: the expression."),
    ("convert_units", "Convert a quantity between units. Input: value, from unit, to unit."),
    ("weather", "Historical weather for a place and year. Input: place, year."),
    ("finish", "Give the final answer. Input: the answer text."),
)
REACT_STOP = ("Observation:",)


def _tool_section(rng: random.Random) -> str:
    lines = ["You can use these tools:"]
    for name, desc in TOOLS:
        lines.append(f"- {name}: {desc} {text.sentence(rng)}")
    return "\n".join(lines)


def _react_example(rng: random.Random) -> str:
    q = text.question(rng)
    steps = [f"Question: {q}"]
    for i in range(3):
        tool = rng.choice(TOOLS[:-1])[0]
        steps += [f"Thought {i + 1}: I should use {tool} to find {text.search_query(rng)}.",
                  f"Action {i + 1}: {tool}[{text.search_query(rng)}]",
                  f"Observation {i + 1}: {text.sentence(rng)} {text.sentence(rng)}"]
    steps.append(f"Action 4: finish[{text.sentence(rng)}]")
    return "\n".join(steps)


def _agent_system(rng: random.Random, approx_tokens: int, json_calls: bool,
                  function_tools: bool = False) -> str:
    head = ("You are a research agent. Solve the task by interleaving Thought, Action and "
            "Observation steps. After each Action, wait for the Observation.")
    if function_tools:
        head = ("You are a research agent. Solve the task by calling the functions you are "
                "given, one step at a time; each result comes back in the next message. Call "
                "finish with the answer when you know it.")
    elif json_calls:
        head += (' Reply with one JSON object: {"thought": ..., "tool": ..., "query": ...}; '
                 "the tool result comes back in the next message.")
    parts = [head] if function_tools else [head, _tool_section(rng)]
    parts.append("Here are solved examples.")
    size = sum(len(p) for p in parts)
    while size < approx_tokens * text.CHARS_PER_TOKEN:
        example = _react_example(rng)
        parts.append(example)
        size += len(example)
    return "\n\n".join(parts)


def tool_call_schema() -> dict[str, Any]:
    """The JSON schema of one tool call (bounded lengths keep the output short)."""
    return {
        "type": "object",
        "properties": {
            "thought": {"type": "string", "maxLength": 100},
            "tool": {"enum": [name for name, _ in TOOLS]},
            "query": {"type": "string", "maxLength": 40},
        },
        "required": ["thought", "tool", "query"],
        "additionalProperties": False,
    }


def _agents(cfg: WorkloadConfig, seed: int, name: str, json_calls: bool,
            private: bool = False, long_observations: bool = False) -> list[Program]:
    rng = random.Random(f"{name}/{seed}")
    system = _agent_system(rng, cfg.system_tokens, json_calls)
    schema = tool_call_schema() if json_calls else None
    # a JSON call must close its braces: room for the bounded strings plus the syntax
    max_tokens = max(cfg.output_tokens, 96) if json_calls else cfg.output_tokens
    stop = () if json_calls else REACT_STOP
    programs = []
    for a in range(cfg.num_programs):
        steps = [Gen(f"Question: {text.question(rng)}", max_tokens, stop, schema)]
        for _ in range(cfg.turns - 1):
            size = cfg.observation_tokens
            if long_observations:
                size = rng.randint(size, 2 * size)
            obs = text.observation(rng, size)
            label = "Tool result" if json_calls else "Observation"
            steps.append(Gen(f"{label}:\n{obs}", max_tokens, stop, schema))
        own = f"Agent {a}. {_agent_system(rng, cfg.system_tokens, json_calls)}" if private \
            else system
        programs.append(Program(f"{name}-{a}", f"{name}-{seed}-agent-{a}", own, tuple(steps)))
    return programs


def react(cfg: WorkloadConfig, seed: int) -> list[Program]:
    return _agents(cfg, seed, "react", json_calls=False)


def private_react(cfg: WorkloadConfig, seed: int) -> list[Program]:
    return _agents(cfg, seed, "private-react", json_calls=False, private=True)


def long_react(cfg: WorkloadConfig, seed: int) -> list[Program]:
    return _agents(cfg, seed, "long-react", json_calls=False, long_observations=True)


def tool_json(cfg: WorkloadConfig, seed: int) -> list[Program]:
    return _agents(cfg, seed, "tool-json", json_calls=True)


def tool_calls(cfg: WorkloadConfig, seed: int, named: bool = False) -> list[Program]:
    """Agents whose turns are OpenAI tool calls; the last turn may answer in text ("auto"), or
    with `named` every turn names the function to call."""
    name = "tool-calls-named" if named else "tool-calls"
    rng = random.Random(f"{name}/{seed}")
    system = _agent_system(rng, cfg.system_tokens, json_calls=False, function_tools=True)
    max_tokens = max(cfg.output_tokens, 96)  # a call's JSON must close within the budget
    programs = []
    for a in range(cfg.num_programs):
        users = [f"Question: {text.question(rng)}"]
        users += [text.observation(rng, cfg.observation_tokens) for _ in range(cfg.turns - 1)]
        choices = [_named_choice(rng) if named else "auto" if t == cfg.turns - 1
                   else "required" for t in range(cfg.turns)]
        steps = tuple(Gen(u, max_tokens, tools=FUNCTION_TOOLS, tool_choice=c)
                      for u, c in zip(users, choices, strict=True))
        programs.append(Program(f"{name}-{a}", f"{name}-{seed}-agent-{a}", system, steps))
    return programs


def _named_choice(rng: random.Random) -> dict[str, Any]:
    return {"type": "function", "function": {"name": rng.choice(tool_names(FUNCTION_TOOLS))}}


def tool_calls_named(cfg: WorkloadConfig, seed: int) -> list[Program]:
    return tool_calls(cfg, seed, named=True)


# ---- tree-of-thought --------------------------------------------------------------------------
STYLES = ("work backwards from the goal", "estimate first, then refine",
          "split the problem into cases", "look for a similar solved problem",
          "check the units and magnitudes", "list the facts, then combine them")
TOT_SYSTEM = ("You are a careful problem solver. Think step by step, propose approaches, and "
              "judge them honestly.")


def tree_of_thought(cfg: WorkloadConfig, seed: int) -> list[Program]:
    rng = random.Random(f"tree-of-thought/{seed}")
    programs = []
    for t in range(cfg.num_programs):
        problem = (f"Problem: {text.question(rng)}\nKnown facts: "
                   f"{text.paragraph(rng, cfg.observation_tokens * 3)}")
        steps: list[Step] = [Gen(problem, cfg.output_tokens)]
        for level in range(cfg.turns):
            branches = tuple(
                f"Step {level + 1}, approach {k + 1}: {rng.choice(STYLES)}. Continue the solution."
                for k in range(cfg.branches))
            judge = (f"Step {level + 1}: these candidate continuations were proposed:\n"
                     "{candidates}\nWhich candidate is most promising? Give its number and one "
                     "sentence of reasons.")
            steps.append(Fork(branches, cfg.output_tokens, judge, max(8, cfg.output_tokens // 4),
                              rng.randrange(cfg.branches)))
        programs.append(Program(f"tree-of-thought-{t}", f"tot-{seed}-tree-{t}", TOT_SYSTEM,
                                tuple(steps)))
    return programs


# ---- multi-turn chat --------------------------------------------------------------------------
CHAT_SYSTEM = "You are a helpful, concise assistant."


def multi_turn_chat(cfg: WorkloadConfig, seed: int) -> list[Program]:
    rng = random.Random(f"multi-turn-chat/{seed}")
    short, long = max(1, cfg.output_tokens // 2), cfg.output_tokens * 2
    programs = []
    for u in range(cfg.num_programs):
        steps = []
        for _ in range(cfg.turns):
            msg = text.question(rng)
            if rng.random() < 0.5:
                msg = f"Here are my notes:\n{text.paragraph(rng, cfg.observation_tokens)}\n{msg}"
            steps.append(Gen(msg, long if rng.random() < 0.5 else short))
        programs.append(Program(f"multi-turn-chat-{u}", f"chat-{seed}-user-{u}", CHAT_SYSTEM,
                                tuple(steps)))
    return programs


# ---- shared prefix ----------------------------------------------------------------------------
def shared_prefix(cfg: WorkloadConfig, seed: int) -> list[Program]:
    rng = random.Random(f"shared-prefix/{seed}")
    systems = [f"You are assistant #{g} for this document collection.\n"
               f"{text.paragraph(rng, cfg.system_tokens)}" for g in range(cfg.groups)]
    programs = []
    for i in range(cfg.num_programs):
        g = i % cfg.groups
        user = f"{text.paragraph(rng, cfg.observation_tokens)}\nQuestion: {text.question(rng)}"
        programs.append(Program(f"shared-prefix-{i}", f"shared-prefix-{seed}-group-{g}",
                                systems[g], (Gen(user, cfg.output_tokens),)))
    return programs


# ---- agent trace ------------------------------------------------------------------------------
TRACE_SYSTEM = ("You are a coding agent working in a large repository. Use the tools to read "
                "files, search and run commands; each tool output comes back in the next "
                "message. Think briefly, then name your next action.")
SUBAGENT_TASK = ("Delegate: a subagent takes over from here. Subagent task: {task} Work through "
                 "the tool outputs that follow, then summarise what you found.")
SUMMARY_REQUEST = "Summarise your findings for the parent agent in a few sentences."
REPORT = "Subagent report:\n"


def agent_trace(cfg: WorkloadConfig, seed: int) -> list[Program]:
    """`num_programs` agents drawn from `cfg.trace` (agent_trace.py) under `seed`; all share
    one system prompt of about `system_tokens`; every answer is `output_tokens` long."""
    tc = cfg.trace
    bounds = tc.scaled()
    rng = random.Random(f"agent-trace/{seed}")
    system = f"{TRACE_SYSTEM}\n\n{text.paragraph(rng, cfg.system_tokens)}"
    compaction = Compaction(tc.context_tokens, tc.compact_at, tc.compact_to,
                            tc.compaction_summary_tokens)

    def call(user: str) -> Gen:
        pause = bounded_pareto(rng, *bounds["pause_s"], tc.pause_alpha)
        return Gen(user, cfg.output_tokens, pause_s=pause)

    def tool_output() -> Gen:
        size = draw_int(rng, bounds["tool_tokens"], tc.tool_tokens_alpha)
        return call(f"Tool output:\n{text.observation(rng, size)}")

    programs = []
    for a in range(cfg.num_programs):
        num_calls = draw_int(rng, bounds["calls"], tc.calls_alpha)
        steps: list[Step] = [call(f"Task: {text.question(rng)}")]
        while len(steps) < num_calls:
            if len(steps) < num_calls - 1 and rng.random() < tc.subagent_share:
                num_sub = draw_int(rng, bounds["subagent_calls"], tc.calls_alpha)
                task = SUBAGENT_TASK.format(task=text.question(rng))
                calls = (call(""), *(tool_output() for _ in range(num_sub - 1)))
                summary = Gen(SUMMARY_REQUEST, tc.summary_tokens, pause_s=0.0)
                steps.append(Subagent(task, calls, summary, call(REPORT)))
            else:
                steps.append(tool_output())
        last = steps[-1]
        if isinstance(last, Gen):  # no tool runs after the last answer
            steps[-1] = Gen(last.user, last.max_tokens)
        programs.append(Program(f"agent-trace-{a}", f"agent-trace-{seed}-agent-{a}", system,
                                tuple(steps), compaction))
    return programs


WORKLOADS: dict[str, Callable[[WorkloadConfig, int], list[Program]]] = {
    "react": react,
    "private-react": private_react,
    "long-react": long_react,
    "tool-json": tool_json,
    "tool-calls": tool_calls,
    "tool-calls-named": tool_calls_named,
    "tree-of-thought": tree_of_thought,
    "multi-turn-chat": multi_turn_chat,
    "shared-prefix": shared_prefix,
    "agent-trace": agent_trace,
}


def make_workload(name: str, cfg: WorkloadConfig, seed: int) -> list[Program]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](cfg, seed)


def describe(programs: list[Program], count_tokens: Callable[[str], int]) -> dict[str, Any]:
    """Token counts of the programs' fixed text (what the harness sends besides model output)."""
    systems = {p.system for p in programs}
    user_tokens = 0
    max_new = 0
    pauses: list[float] = []
    subagents = 0
    for p in programs:
        for s in p.steps:
            if isinstance(s, Gen):
                user_tokens += count_tokens(s.user)
                max_new += s.max_tokens
                pauses.append(s.pause_s)
            elif isinstance(s, Subagent):
                subagents += 1
                gens = (*s.calls[1:], s.summary, s.report)
                user_tokens += count_tokens(s.task) + sum(count_tokens(g.user) for g in gens)
                max_new += sum(g.max_tokens for g in (*s.calls, s.summary, s.report))
                pauses += [g.pause_s for g in (*s.calls, s.report)]
            else:
                user_tokens += sum(count_tokens(b) for b in s.branches) + count_tokens(s.judge)
                max_new += s.max_tokens * len(s.branches) + s.judge_max_tokens
    return {
        "programs": len(programs),
        "requests": sum(p.num_requests for p in programs),
        "distinct_system_prompts": len(systems),
        "system_prompt_tokens": sorted(count_tokens(s) for s in systems),
        "user_message_tokens": user_tokens,
        "max_new_tokens": max_new,
        "subagents": subagents,
        "tool_pause_s": sum(pauses),
    }
