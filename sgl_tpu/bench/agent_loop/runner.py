"""Run programs as concurrent coroutines against one server -> Trace.

    programs --arrivals (request_rate, Poisson)--> semaphore (concurrency) --> run_program
    run_program: for each step, the messages so far + the step's user message -> send -> append

With function tools, an answer that made calls goes back as an assistant message carrying them,
and the next step's text becomes the first call's `tool` result (the others get a short note).
A Subagent step runs its calls on a copy of the context (the fork), then the parent's report call
on the parent's context. A program with `compaction` (agent-trace) compacts its context before a
call whose prompt and answer would pass its share of the context limit (agent_trace.compact);
that limit is the workload's, else `RunOptions.context_tokens` (the server's).

`send(req, program_id, step, branch)` is Client.send (or a fake in tests); its records are stamped
with `time.perf_counter()` and shifted to the run's start at the end. Within a program the
requests are a closed loop: each waits for the previous answer, because the next prompt
contains it. A failed request ends its program (its later prompts would not exist).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sgl_tpu.bench.agent_loop.agent_trace import compact, compaction_summary
from sgl_tpu.bench.agent_loop.drivers import GenRequest
from sgl_tpu.bench.agent_loop.tools import assistant_message, renderable, tool_messages
from sgl_tpu.bench.agent_loop.trace import RequestRecord, Trace
from sgl_tpu.bench.agent_loop.workloads import Fork, Gen, Program, Subagent

Messages = list[dict[str, Any]]
SendFn = Callable[[GenRequest, str, int, int], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class RunOptions:
    concurrency: int = 0  # programs in flight at once; 0: no limit
    request_rate: float = float("inf")  # program arrivals per second (Poisson); inf: all at once
    seed: int = 0  # arrivals and per-request sampling seeds
    session_hint: bool = False  # send each program's session id
    progress: bool = True
    # an agent's wait between its turns (the tool call): uniform in [lo, hi], seeded per call
    tool_latency_s: tuple[float, float] = (0.0, 0.0)
    priority: int | None = None  # every request's `priority` (None: not sent)
    context_tokens: int = 0  # the server's context length, for compaction (0: unknown)

    def __post_init__(self) -> None:
        if self.concurrency < 0:
            raise ValueError("concurrency must be >= 0")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        lo, hi = self.tool_latency_s
        if not 0 <= lo <= hi:
            raise ValueError(f"tool latency range must be 0 <= lo <= hi, got {lo}:{hi}")


def tool_latency(opts: RunOptions, program_id: str, step: int) -> float:
    """The seeded wait after `step` of a program (the same for every target of a run)."""
    lo, hi = opts.tool_latency_s
    if hi == lo:
        return lo
    return random.Random(f"tool/{opts.seed}/{program_id}/{step}").uniform(lo, hi)


def request_seed(seed: int, program_id: str, step: int, branch: int) -> int:
    return zlib.crc32(f"{seed}/{program_id}/{step}/{branch}".encode())


def arrival_times(num_programs: int, request_rate: float, seed: int) -> list[float]:
    if request_rate == float("inf"):
        return [0.0] * num_programs
    rng = random.Random(f"arrivals/{seed}")
    t, out = 0.0, []
    for _ in range(num_programs):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


class _Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.done, self.bar = total, desc, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr,
                                mininterval=1.0, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (self.done * 10 // self.total > (self.done - 1) * 10 // self.total):
            print(f"{self.desc}: {self.done}/{self.total} requests", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ProgramRunner:
    def __init__(self, send: SendFn, render: Callable[[Messages], str], opts: RunOptions,
                 desc: str = "run", count_tokens: Callable[[str], int] | None = None) -> None:
        self.send = send
        self.render = render  # messages -> prompt text (chat template + generation prompt)
        self.opts = opts
        self.desc = desc
        self.count_tokens = count_tokens  # prompt text -> tokens (compaction needs it)
        self.records: list[RequestRecord] = []
        self.progress: _Progress | None = None
        self.compactions: dict[str, int] = {}  # per program

    async def _call(self, program: Program, step: int, branch: int, messages: Messages,
                    max_tokens: int, stop: tuple[str, ...] = (),
                    json_schema: dict | None = None, tools: tuple[dict[str, Any], ...] = (),
                    tool_choice: str | dict[str, Any] | None = None, compacted: bool = False,
                    forked: bool = False) -> RequestRecord:
        req = GenRequest(messages, self.render(renderable(messages)), max_tokens, stop,
                         json_schema,
                         request_seed(self.opts.seed, program.program_id, step, branch),
                         program.session if self.opts.session_hint else None, tools, tool_choice,
                         self.opts.priority)
        record = await self.send(req, program.program_id, step, branch)
        record.prompt, record.compacted, record.forked = req.prompt, compacted, forked
        self.records.append(record)
        if self.progress is not None:
            self.progress.update()
        return record

    def _compacted(self, program: Program, asked: Messages, max_tokens: int
                   ) -> Messages | None:
        """`asked` compacted when its prompt and answer would pass the program's limit."""
        policy = program.compaction
        limit = (policy.context_tokens or self.opts.context_tokens) if policy else 0
        if policy is None or not limit or self.count_tokens is None:
            return None

        def size(messages: Messages) -> int:
            return self.count_tokens(self.render(renderable(messages))) + max_tokens

        total = size(asked)
        if total <= policy.compact_at * limit:
            return None
        num = self.compactions[program.program_id] = self.compactions.get(
            program.program_id, 0) + 1
        summary = compaction_summary(program.program_id, num, policy.summary_tokens)
        # A candidate's size without rendering it: its messages' own tokens plus all of the
        # template's (an overestimate: removed messages' template tokens still count).
        own = {id(m): self.count_tokens(m.get("content") or "") for m in asked}
        overhead = total - sum(own.values())
        summary_size = self.count_tokens(summary)

        def fits(messages: Messages) -> bool:
            kept = sum(own.get(id(m), summary_size) for m in messages)
            return overhead + kept <= policy.compact_to * limit

        return compact(asked, summary, fits)

    async def _turn(self, program: Program, step: int, branch: int, messages: Messages,
                    new: Messages, gen: Gen, forked: bool = False
                    ) -> tuple[RequestRecord, Messages]:
        """One call: `messages + new` (compacted if due) -> the answer; the context after it."""
        asked = messages + new
        compacted = self._compacted(program, asked, gen.max_tokens)
        r = await self._call(program, step, branch, compacted or asked, gen.max_tokens,
                             gen.stop, gen.json_schema, gen.tools, gen.tool_choice,
                             compacted=compacted is not None, forked=forked)
        answer = (assistant_message(r.text, r.tool_calls) if r.tool_calls
                  else {"role": "assistant", "content": r.text})
        return r, (compacted or asked) + [answer]

    async def _pause(self, program: Program, step: int, gen: Gen) -> None:
        """The tool runs: the step's own pause, else the run's --tool-latency."""
        if wait := gen.pause_s or tool_latency(self.opts, program.program_id, step):
            await asyncio.sleep(wait)

    async def _subagent(self, program: Program, i: int, step: Subagent, messages: Messages
                        ) -> str | None:
        """Run the subagent on a fork of `messages`; its summary (None if a call failed)."""
        sub, new = messages, [{"role": "user", "content": step.task}]
        for j, gen in enumerate(step.calls):
            if j:
                new = [{"role": "user", "content": gen.user}]
            r, sub = await self._turn(program, i, j, sub, new, gen, forked=j == 0)
            if not r.ok:
                return None
            await self._pause(program, i, gen)
        ask = [{"role": "user", "content": step.summary.user}]
        r, _ = await self._turn(program, i, len(step.calls), sub, ask, step.summary)
        return r.text.strip() if r.ok else None

    async def run_program(self, program: Program) -> None:
        messages: Messages = [{"role": "system", "content": program.system}]
        calls: list[dict[str, str]] = []  # the previous answer's tool calls
        for i, step in enumerate(program.steps):
            last = i + 1 == len(program.steps)
            if isinstance(step, Subagent):
                summary = await self._subagent(program, i, step, messages)
                if summary is None:
                    return
                new = [{"role": "user", "content": step.report.user + summary}]
                r, messages = await self._turn(program, i, -1, messages, new, step.report)
                if not r.ok:
                    return
                if not last:
                    await self._pause(program, i, step.report)
                continue
            if isinstance(step, Gen):
                new = (tool_messages(calls, step.user) if calls
                       else [{"role": "user", "content": step.user}])
                r, messages = await self._turn(program, i, -1, messages, new, step)
                if not r.ok:
                    return
                calls = r.tool_calls
                if not last:
                    await self._pause(program, i, step)
                continue
            assert isinstance(step, Fork)
            asks = [messages + [{"role": "user", "content": b}] for b in step.branches]
            branches = await asyncio.gather(*(
                self._call(program, i, k, a, step.max_tokens) for k, a in enumerate(asks)))
            if not all(r.ok for r in branches):
                return
            candidates = "\n".join(f"{k + 1}. {r.text.strip()}" for k, r in enumerate(branches))
            judge = step.judge.replace("{candidates}", candidates)
            r = await self._call(program, i, len(asks),
                                 messages + [{"role": "user", "content": judge}],
                                 step.judge_max_tokens)
            if not r.ok:
                return
            kept = branches[step.chosen]
            messages = asks[step.chosen] + [{"role": "assistant", "content": kept.text}]

    async def run(self, programs: list[Program]) -> Trace:
        self.records, self.compactions = [], {}
        total = sum(p.num_requests for p in programs)
        self.progress = _Progress(total, self.desc, self.opts.progress)
        limit = asyncio.Semaphore(self.opts.concurrency or max(1, len(programs)))
        arrivals = arrival_times(len(programs), self.opts.request_rate, self.opts.seed)
        t0 = time.perf_counter()

        async def start(program: Program, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with limit:
                await self.run_program(program)

        try:
            await asyncio.gather(*(start(p, a) for p, a in zip(programs, arrivals, strict=True)))
        finally:
            self.progress.close()
        wall = time.perf_counter() - t0
        for r in self.records:  # the client stamps perf_counter(); the trace counts from t0
            r.start_s -= t0
            r.end_s -= t0
            r.chunk_times = [t - t0 for t in r.chunk_times]
        return Trace(wall, len(programs), sorted(self.records, key=lambda r: r.start_s))
