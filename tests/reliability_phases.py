"""Load and fault phases of the reliability campaign, against a running server (loopback only).

Every phase is bounded (a number of clients and requests, timeouts on every call) and returns
counters; `check_invariants` then proves the server is back to a clean state:

    load        C concurrent clients x R requests, mixing native / OpenAI completions / chat /
                Anthropic messages, streaming / not, batches and n > 1, half of them turns of
                a few agents (programs named by session_id, prompt_cache_key, program_id,
                metadata.user_id or the X-SMG-Routing-Key header); every answer must be a 200
    disconnect  streams dropped after their first chunk, non-streaming calls cancelled, and
                `/abort_request` for running requests; no 5xx, nothing left running
    exhaustion  (a server with a tiny KV pool) more concurrent long generations than the pool
                holds: retraction, every request completes with its exact token count
    big_prompt  prompts of several hundred thousand characters (tokenized off the event loop,
                or refused untokenized when they cannot fit the context): a 400 each, and
                the latency probe shows whether other clients stalled meanwhile
    kill_child  (a server of its own) SIGKILL a child process mid-traffic: in-flight and new
                requests get 503, the launcher exits non-zero and leaves no process behind

While a phase runs, `LatencyProbe` times a small request every `interval_s` (the p99 is
reported: how much one client suffers from everybody else's traffic).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TIMEOUT_S = 300.0
SMALL_REQUEST = {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


@dataclass
class PhaseResult:
    name: str
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    disconnects: int = 0
    aborts: int = 0
    faults_injected: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_5xx(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def to_dict(self) -> dict[str, Any]:
        statuses = {str(k): v for k, v in sorted(self.statuses.items(), key=str)}
        return {"requests": self.requests, "statuses": statuses,
                "disconnects": self.disconnects, "aborts": self.aborts,
                "faults_injected": self.faults_injected, "wall_s": round(self.wall_s, 2),
                **self.extra}


def client_session(headers: dict[str, str]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))


async def _read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for raw in resp.content:
        line = raw.decode(errors="replace").strip()
        if line.startswith("data:") and line != "data: [DONE]":
            events.append(json.loads(line[5:]))
    return events


AGENTS = 6  # the programs the load mix's agent turns belong to
ROUTING_HEADER = "X-SMG-Routing-Key"


def _mixed_request(rng: random.Random, max_tokens: int
                   ) -> tuple[str, dict[str, Any], dict[str, str]]:
    """One request of the load mix: (route, body, extra headers). Half are an agent's turn,
    naming its program the ways the request's API offers (docs/agents-at-scale.md)."""
    kind = rng.choice(["native", "native_stream", "native_batch", "native_n", "completion",
                       "completion_stream", "chat", "chat_stream", "messages",
                       "messages_stream"])
    text = rng.choice(["Hello", "The capital of France is", "List three colours:",
                       "Write a haiku about rain."])
    agent = f"agent-{rng.randrange(AGENTS)}" if rng.random() < 0.5 else None
    headers: dict[str, str] = {}
    if agent is not None and rng.random() < 0.25:
        headers[ROUTING_HEADER] = agent
        agent = None  # named by the header alone
    stream = kind.endswith("_stream")
    greedy = {"temperature": 0, "max_new_tokens": max_tokens}
    if kind.startswith("native"):
        body: dict[str, Any] = {"text": text, "sampling_params": greedy}
        if kind == "native_stream":
            body["stream"] = True
        elif kind == "native_batch":
            body["text"] = [text, text + " Answer:"]
        elif kind == "native_n":
            body["sampling_params"] = {**greedy, "n": 2, "temperature": 0.7}
        if agent is not None:
            body["session_id"] = agent
        return "/generate", body, headers
    if kind.startswith("messages"):
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": text}]}
        if agent is not None:
            body["metadata"] = {"user_id": agent}
        return "/v1/messages", body, headers
    if kind.startswith("completion"):
        body = {"prompt": text, "max_tokens": max_tokens, "stream": stream}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "stream": stream}
    if agent is not None:
        body[rng.choice(["prompt_cache_key", "program_id", "session_id"])] = agent
    route = "/v1/completions" if kind.startswith("completion") else "/v1/chat/completions"
    return route, body, headers


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> int:
    async with session.post(url, json=body, headers=headers) as resp:
        if body.get("stream") and resp.status == 200:
            events = await _read_sse(resp)
            if any("error" in e for e in events):
                return 500  # an error inside a 200 stream counts as a server error here
        else:
            await resp.read()
        return resp.status


class LatencyProbe:
    """Times `SMALL_REQUEST` every `interval_s` while a phase runs."""

    def __init__(self, base_url: str, headers: dict[str, str], interval_s: float = 0.5) -> None:
        self.base_url, self.headers, self.interval_s = base_url, headers, interval_s
        self.latencies_s: list[float] = []
        self.by_phase: dict[str, list[float]] = {}
        self.phase = "start"  # set by the campaign as it moves on
        self.statuses: Counter = Counter()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LatencyProbe:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        async with client_session(self.headers) as session:
            while True:
                t0 = time.perf_counter()
                status = await _post(session, self.base_url + "/generate", SMALL_REQUEST)
                self.statuses[status] += 1
                self.latencies_s.append(time.perf_counter() - t0)
                self.by_phase.setdefault(self.phase, []).append(self.latencies_s[-1])
                await asyncio.sleep(self.interval_s)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def load_phase(base_url: str, headers: dict[str, str], *, clients: int,
                     requests_per_client: int, max_tokens: int = 8, seed: int = 0
                     ) -> PhaseResult:
    result = PhaseResult("load")
    t0 = time.perf_counter()

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 100_003 + i)
        for _ in range(requests_per_client):
            route, body, extra = _mixed_request(rng, max_tokens)
            result.statuses[await _post(session, base_url + route, body, extra)] += 1
            result.requests += 1

    async with client_session(headers) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    result.wall_s = time.perf_counter() - t0
    result.extra["clients"] = clients
    return result


async def disconnect_phase(base_url: str, headers: dict[str, str], *, clients: int,
                           seed: int = 0) -> PhaseResult:
    """Each client: a stream dropped after its first chunk, a non-streaming call cancelled
    mid-way, and a running request aborted with `/abort_request`."""
    result = PhaseResult("disconnect")
    t0 = time.perf_counter()
    long = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}

    async def dropped_stream(session: aiohttp.ClientSession) -> None:
        body = {"text": "Tell me a story.", "stream": True, "sampling_params": long}
        async with session.post(base_url + "/generate", json=body) as resp:
            result.statuses[resp.status] += 1
            await resp.content.readline()
        result.disconnects += 1  # leaving the block closes the connection mid-stream

    async def cancelled_call(session: aiohttp.ClientSession, delay_s: float) -> None:
        body = {"text": "Count to one hundred.", "sampling_params": long}
        try:
            await asyncio.wait_for(_post(session, base_url + "/generate", body), delay_s)
            result.statuses[200] += 1
        except asyncio.TimeoutError:
            result.disconnects += 1

    async def aborted(session: aiohttp.ClientSession, rid: str, delay_s: float) -> None:
        body = {"text": "Describe the sea.", "rid": rid, "sampling_params": long}
        call = asyncio.ensure_future(_post(session, base_url + "/generate", body))
        await asyncio.sleep(delay_s)
        status = await _post(session, base_url + "/abort_request", {"rid": rid})
        result.statuses[status] += 1
        result.statuses[await call] += 1
        result.aborts += 1

    rng = random.Random(seed)
    async with client_session(headers) as session:
        jobs = []
        for i in range(clients):
            jobs += [dropped_stream(session), cancelled_call(session, rng.uniform(0.05, 0.5)),
                     aborted(session, f"abort-{seed}-{i}", rng.uniform(0.05, 0.5))]
        await asyncio.gather(*jobs)
    result.requests = 3 * clients
    result.wall_s = time.perf_counter() - t0
    return result


async def exhaustion_phase(base_url: str, headers: dict[str, str], *, capacity_tokens: int,
                           clients: int, seed: int = 0) -> PhaseResult:
    """More concurrent generations than the KV pool holds (each fits alone): every request must
    finish with exactly its max_new_tokens; one that can never fit must be a 400."""
    result = PhaseResult("exhaustion")
    t0 = time.perf_counter()
    out_tokens = max(8, 2 * capacity_tokens // clients)
    wrong = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal wrong
        body = {"text": f"Story number {seed}-{i}:", "sampling_params": {
            "temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True}}
        async with session.post(base_url + "/generate", json=body) as resp:
            result.statuses[resp.status] += 1
            data = await resp.json()
            if resp.status == 200 and data["meta_info"]["completion_tokens"] != out_tokens:
                wrong += 1

    async with client_session(headers) as session:
        await asyncio.gather(*(one(session, i) for i in range(clients)))
        too_big = {"text": "x", "sampling_params": {"max_new_tokens": capacity_tokens + 1}}
        result.statuses[await _post(session, base_url + "/generate", too_big)] += 1
    result.requests = clients + 1
    result.wall_s = time.perf_counter() - t0
    result.extra.update(out_tokens=out_tokens, wrong_token_counts=wrong)
    return result


async def big_prompt_phase(base_url: str, headers: dict[str, str], *, num_prompts: int,
                           num_chars: int) -> PhaseResult:
    """`num_prompts` prompts of `num_chars` characters, one after another."""
    result = PhaseResult("big_prompt")
    t0 = time.perf_counter()
    text = ("The quick brown fox jumps over the lazy dog. " * (num_chars // 45 + 1))[:num_chars]
    async with client_session(headers) as session:
        for _ in range(num_prompts):
            body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
            result.statuses[await _post(session, base_url + "/generate", body)] += 1
    result.requests = num_prompts
    result.wall_s = time.perf_counter() - t0
    result.extra["prompt_chars"] = num_chars
    return result


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


CHILD_EXIT_GRACE_S = 5.0  # after the server's exit, for children to notice it


async def kill_child_phase(base_url: str, headers: dict[str, str], server_pid: int, *,
                           victim: int, clients: int = 4, exit_timeout_s: float = 30.0
                           ) -> PhaseResult:
    """SIGKILL `victim` (a child of the server) as soon as `clients` streams are running.
    Every stream must end with an error event or a closed connection (never a normal end),
    a request sent after the kill must get 503 (or a refused connection once the server is
    gone), and the server must exit non-zero within `exit_timeout_s`, leaving none of its
    processes behind. `statuses` counts outcomes: "error_event", "cut", "completed", and the
    HTTP status of the later request (0: connection refused)."""
    result = PhaseResult("kill_child")
    t0 = time.perf_counter()
    body = {"text": "Go on:", "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 256, "ignore_eos": True}}
    children = child_pids(server_pid)
    started = asyncio.Event()
    num_started = 0

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal num_started
        outcome = "completed"
        try:
            async with session.post(base_url + "/generate", json=body) as resp:
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        event = json.loads(line[5:])
                        if "error" in event:
                            outcome = "error_event"
                        elif num_started < clients:
                            num_started += 1
                            if num_started == clients:
                                started.set()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            outcome = "cut"
        result.statuses[outcome] += 1

    async with client_session(headers) as session:
        calls = [asyncio.ensure_future(stream(session)) for _ in range(clients)]
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        os.kill(victim, signal.SIGKILL)
        result.faults_injected += 1
        await asyncio.gather(*calls)
        try:
            after = await _post(session, base_url + "/generate", SMALL_REQUEST)
        except aiohttp.ClientError:
            after = 0
        result.statuses[after] += 1
    deadline = time.monotonic() + exit_timeout_s
    exited = False
    while time.monotonic() < deadline:
        if not _alive(server_pid):
            exited = True
            break
        await asyncio.sleep(0.2)
    # Children that watch the server (e.g. multiprocessing's resource tracker) notice its exit
    # on their own, a moment later: they get a short grace period before counting as leftovers.
    grace = time.monotonic() + CHILD_EXIT_GRACE_S
    while exited and any(_alive(p) for p in children) and time.monotonic() < grace:
        await asyncio.sleep(0.1)
    result.requests = clients + 1
    result.wall_s = time.perf_counter() - t0
    result.extra.update(server_exited=exited,
                        leftover_processes=[p for p in children if _alive(p)])
    return result


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
