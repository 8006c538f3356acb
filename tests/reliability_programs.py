"""Program phases of the reliability campaign: admission control and the disk tier under agents,
against a running server (loopback only; issue 66, item 9). Each phase starts from an empty
program table (`/flush_cache`), bounds every call, and returns a `PhaseResult` whose `extra`
holds the figures its test asserts on:

    newcomer    an agent taking turns with 0.5 s pauses, and a newcomer whose first turn is
                ~10% larger arriving 3 s later, when the two cannot both fit the capacity: the
                newcomer is held, and its first turn ends within the hold bound (+ margin)
                while the agent still works; a request of no program beside them is not held
    flood       N distinct session ids (a 1-token request each), then a short agent workload:
                its throughput against the same workload before the flood
    shared_key  P parallel requests under one key beside a few agents with keys of their own:
                the agents' mean program time against their time alone
    disk_load   (a server with the disk tier) a long prompt pushed out of the pool and the
                host tier, sent again while a stream decodes: it is read back from disk, and
                the stream's inter-token gaps against its gaps alone

Prompts are sized in tokens by the server's own count (`/generate` meta_info), so the phases
run on any model whose context holds them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import aiohttp
from reliability_phases import PhaseResult, client_session, percentile

AGENT_PAUSE_S = 0.5
NEWCOMER_DELAY_S = 3.0
NEWCOMER_GROWTH = 1.1  # the newcomer's first turn against the agent's
KEYLESS_DELAY_S = 4.0  # after the agent's start: while the newcomer is held


def words(tag: str, num_words: int) -> str:
    """Distinct words of one width (no prefix shared with another tag): a text's tokens grow
    with its words at the rate `tokens_per_word` measures."""
    return " ".join(f"{tag}{i:04d}" for i in range(num_words))


async def tokens_per_word(session: aiohttp.ClientSession, base_url: str, tag: str) -> float:
    """Of `words(tag, ...)`, by the server's count (50 words: the phases' smallest pool holds
    them)."""
    body = {"text": words(tag, 50), "sampling_params": {"max_new_tokens": 1}}
    async with session.post(base_url + "/generate", json=body) as resp:
        data = await resp.json()
    return data["meta_info"]["prompt_tokens"] / 50


async def server_info(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    async with session.get(base_url + "/server_info") as resp:
        return await resp.json()


async def flush(session: aiohttp.ClientSession, base_url: str) -> None:
    """Empty the caches and the program table (the server must be idle)."""
    for _ in range(100):
        async with session.post(base_url + "/flush_cache") as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError("/flush_cache refused for 10 s: requests still running")


async def turn(session: aiohttp.ClientSession, base_url: str, result: PhaseResult, text: str,
               key: str | None, max_tokens: int) -> tuple[float, dict[str, Any]]:
    """One request: (seconds, its answer); counts its status in `result`."""
    body: dict[str, Any] = {"text": text, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}
    if key is not None:
        body["session_id"] = key
    t0 = time.perf_counter()
    async with session.post(base_url + "/generate", json=body) as resp:
        data = await resp.json(content_type=None)
        result.statuses[resp.status] += 1
    result.requests += 1
    return time.perf_counter() - t0, data


async def agent(session: aiohttp.ClientSession, base_url: str, result: PhaseResult, key: str,
                first_words: int, *, max_tokens: int, pause_s: float, turns: int | None = None,
                until: asyncio.Event | None = None) -> list[tuple[float, float]]:
    """A program's turns: its context grows by each answer and a tool result; `turns` of them,
    or until `until` is set. Returns (start, end) per turn, perf_counter seconds."""
    context = words(key, first_words)
    spans = []
    while (turns is None or len(spans) < turns) and not (until and until.is_set()):
        t0 = time.perf_counter()
        _, data = await turn(session, base_url, result, context, key, max_tokens)
        spans.append((t0, time.perf_counter()))
        context += data.get("text", "") + f" tool{len(spans)} ok."
        await asyncio.sleep(pause_s)
    return spans


async def newcomer_phase(base_url: str, headers: dict[str, str], *, margin_s: float = 5.0
                         ) -> PhaseResult:
    """The agent's first turn is sized so that twice it (the working set admission control
    expects of a first turn) plus twice the newcomer's exceeds the capacity."""
    result = PhaseResult("newcomer")
    t0 = time.perf_counter()
    async with client_session(headers) as session:
        await flush(session, base_url)
        before = (await server_info(session, base_url))["programs"]
        per_word = await tokens_per_word(session, base_url, "agentA")
        max_tokens = 16
        # 5% over the least first turn for which the two do not fit
        first_tokens = int(1.05 * before["capacity_tokens"] / (2 + 2 * NEWCOMER_GROWTH))
        first_words = int((first_tokens - max_tokens) / per_word)
        stop = asyncio.Event()
        running = asyncio.ensure_future(agent(session, base_url, result, "agentA", first_words,
                                              max_tokens=max_tokens, pause_s=AGENT_PAUSE_S,
                                              until=stop))

        async def later(delay_s: float, text: str, key: str | None) -> tuple[float, float]:
            await asyncio.sleep(delay_s)
            latency_s, _ = await turn(session, base_url, result, text, key, max_tokens)
            return latency_s, time.perf_counter()

        newcomer = later(NEWCOMER_DELAY_S, words("agentB", int(first_words * NEWCOMER_GROWTH)),
                         "agentB")
        keyless = later(KEYLESS_DELAY_S, "Hello", None)
        (newcomer_s, newcomer_end), (keyless_s, _) = await asyncio.gather(newcomer, keyless)
        await asyncio.sleep(2 * AGENT_PAUSE_S)  # the agent's turns after the newcomer's
        stop.set()
        spans = await running
        after = (await server_info(session, base_url))["programs"]
    result.wall_s = time.perf_counter() - t0
    result.extra.update(
        capacity_tokens=before["capacity_tokens"], first_turn_tokens=first_tokens,
        hold_bound_s=after["hold_bound_s"], margin_s=margin_s,
        newcomer_s=round(newcomer_s, 2), keyless_s=round(keyless_s, 2),
        programs_held=after["num_programs_held"] - before["num_programs_held"],
        held_s=round(after["program_held_s"] - before["program_held_s"], 2),
        agent_turns=len(spans),
        agent_turns_after_newcomer=sum(1 for start, _ in spans if start > newcomer_end),
        num_held_after=after["num_held"])
    return result


async def agent_workload(session: aiohttp.ClientSession, base_url: str, result: PhaseResult,
                         tag: str, *, num_agents: int, turns: int, first_words: int,
                         max_tokens: int, pause_s: float) -> tuple[float, list[float]]:
    """`num_agents` agents at once: (wall seconds, each agent's program time)."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(
        agent(session, base_url, result, f"{tag}{i}x", first_words, max_tokens=max_tokens,
              pause_s=pause_s, turns=turns) for i in range(num_agents)))
    return time.perf_counter() - t0, [spans[-1][1] - spans[0][0] for spans in runs]


async def flood_phase(base_url: str, headers: dict[str, str], *, num_programs: int,
                      batch: int = 64, concurrency: int = 8, num_agents: int = 4,
                      turns: int = 4) -> PhaseResult:
    """`num_programs` session ids, `batch` prompts to an HTTP request, then the agents."""
    result = PhaseResult("flood")
    t0 = time.perf_counter()
    workload = dict(num_agents=num_agents, turns=turns, first_words=40, max_tokens=16,
                    pause_s=0.05)
    async with client_session(headers) as session:
        await flush(session, base_url)
        base_wall_s, _ = await agent_workload(session, base_url, result, "before", **workload)
        before = (await server_info(session, base_url))["programs"]
        sent = 0
        lock = asyncio.Lock()

        async def sender() -> None:
            nonlocal sent
            while True:
                async with lock:
                    start, sent = sent, min(sent + batch, num_programs)
                if start >= num_programs:
                    return
                n = min(batch, num_programs - start)
                body = {"text": ["Hi"] * n,
                        "session_id": [f"flood-{start + j}" for j in range(n)],
                        "sampling_params": {"max_new_tokens": 1}}
                async with session.post(base_url + "/generate", json=body) as resp:
                    await resp.read()
                    result.statuses[resp.status] += n
                result.requests += n

        t_flood = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        flood_s = time.perf_counter() - t_flood
        after_wall_s, _ = await agent_workload(session, base_url, result, "after", **workload)
        after = (await server_info(session, base_url))["programs"]
    num_turns = num_agents * turns
    result.wall_s = time.perf_counter() - t0
    result.extra.update(
        num_programs=num_programs, flood_s=round(flood_s, 2),
        programs_seen=after["num_programs_seen"] - before["num_programs_seen"],
        table_size=after["num_programs"],
        programs_held=after["num_programs_held"] - before["num_programs_held"],
        held_s=round(after["program_held_s"] - before["program_held_s"], 2),
        hold_bound_s=after["hold_bound_s"],
        baseline_turns_per_s=round(num_turns / base_wall_s, 2),
        after_turns_per_s=round(num_turns / after_wall_s, 2),
        throughput_ratio=round(base_wall_s / after_wall_s, 3))
    return result


async def all_idle(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """The "programs" of /server_info once none is active or paused (past its pause window)."""
    for _ in range(300):
        programs = (await server_info(session, base_url))["programs"]
        if not programs["num_active"] and not programs["num_paused"]:
            return programs
        await asyncio.sleep(0.1)
    raise AssertionError(f"programs still active or paused after 30 s: {programs}")


async def shared_key_phase(base_url: str, headers: dict[str, str], *, parallel: int = 48,
                           num_agents: int = 3, turns: int = 3, max_tokens: int = 24
                           ) -> PhaseResult:
    """The agents alone, then again beside `parallel` requests of one key (sent at once, again
    as each ends, until the agents are done). The key's and the agents' expected working sets
    fit the capacity together, so admission control holds nobody: what is measured is the
    order (one share for the key, not `parallel` of them)."""
    result = PhaseResult("shared_key")
    t0 = time.perf_counter()
    async with client_session(headers) as session:
        await flush(session, base_url)
        capacity = (await server_info(session, base_url))["programs"]["capacity_tokens"]
        per_word = await tokens_per_word(session, base_url, "alone0x")
        shared_tokens = parallel * (8 + max_tokens)  # "Shared question N:" and its answer
        # each agent is expected at twice its first turn, and grows by turns
        first_tokens = (0.8 * capacity - shared_tokens) / (2 * num_agents)
        workload = dict(num_agents=num_agents, turns=turns, max_tokens=max_tokens,
                        first_words=max(1, int((first_tokens - max_tokens) / per_word)),
                        pause_s=0.1)
        _, alone = await agent_workload(session, base_url, result, "alone", **workload)
        before = await all_idle(session, base_url)
        done = asyncio.Event()

        async def shared(i: int) -> None:
            while not done.is_set():
                await turn(session, base_url, result, f"Shared question {i}:", "shared-key",
                           max_tokens)

        flood = [asyncio.ensure_future(shared(i)) for i in range(parallel)]
        await asyncio.sleep(0.5)  # all of them in the server first
        _, beside = await agent_workload(session, base_url, result, "beside", **workload)
        done.set()
        await asyncio.gather(*flood)
        after = (await server_info(session, base_url))["programs"]
    mean_alone, mean_beside = sum(alone) / len(alone), sum(beside) / len(beside)
    result.wall_s = time.perf_counter() - t0
    result.extra.update(parallel=parallel, agents=num_agents,
                        first_words=workload["first_words"],
                        programs_held=after["num_programs_held"] - before["num_programs_held"],
                        agent_program_s_alone=round(mean_alone, 3),
                        agent_program_s_beside=round(mean_beside, 3),
                        ratio=round(mean_beside / mean_alone, 2))
    return result


async def stream_stamps(session: aiohttp.ClientSession, base_url: str, result: PhaseResult,
                        max_tokens: int, started: asyncio.Event | None = None) -> list[float]:
    """A greedy stream's token events (perf_counter seconds); sets `started` at 8 tokens."""
    body = {"text": "Tell me a long story:", "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}
    stamps = []
    async with session.post(base_url + "/generate", json=body) as resp:
        result.statuses[resp.status] += 1
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if "error" in json.loads(line[5:]):
                result.statuses[500] += 1  # an error inside a 200 stream
            stamps.append(time.perf_counter())
            if started is not None and len(stamps) == 8:
                started.set()
    result.requests += 1
    return stamps


def gaps(stamps: list[float], start: float = 0.0, end: float = float("inf")) -> list[float]:
    """Gaps between consecutive stamps that overlap [start, end]."""
    return [b - a for a, b in itertools.pairwise(stamps) if b >= start and a <= end]


async def _written(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """/server_info once the disk tier's write queue is empty."""
    for _ in range(300):
        info = await server_info(session, base_url)
        if info["tiers"]["disk"]["queued_pages"] == 0:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError("the disk tier's queue did not drain in 30 s")


async def beside_stream(session: aiohttp.ClientSession, base_url: str, result: PhaseResult,
                        text: str, stream_tokens: int
                        ) -> tuple[float, dict[str, Any], list[float], list[float]]:
    """`text` sent once a stream has 8 tokens: (its seconds, its answer, the stream's gaps
    that overlap it, all the stream's gaps)."""
    started = asyncio.Event()
    stream = asyncio.ensure_future(stream_stamps(session, base_url, result, stream_tokens,
                                                 started))
    await started.wait()
    sent = time.perf_counter()
    latency_s, answer = await turn(session, base_url, result, text, None, 1)
    stamps = await stream
    return latency_s, answer, gaps(stamps, sent, sent + latency_s), gaps(stamps)


async def disk_load_phase(base_url: str, headers: dict[str, str], *, stream_tokens: int = 256,
                          fill_prompts: int = 4) -> PhaseResult:
    """The long prompt takes most of the pool; `fill_prompts` others as long push it out of
    the pool and the host tier (a server with `--hicache-ratio 1`), so the disk holds it alone.
    For reference, the stream's gaps beside a prompt as long that nothing holds (computed)."""
    result = PhaseResult("disk_load")
    t0 = time.perf_counter()
    async with client_session(headers) as session:
        await flush(session, base_url)
        info = await server_info(session, base_url)
        pool_tokens = info["memory"]["max_total_tokens"]
        num_words = int(0.75 * pool_tokens / await tokens_per_word(session, base_url, "long"))
        fill_words = int(0.75 * pool_tokens / await tokens_per_word(session, base_url, "fill0x"))
        idle = gaps(await stream_stamps(session, base_url, result, stream_tokens))
        long_prompt = words("long", num_words)
        await turn(session, base_url, result, long_prompt, None, 1)
        for i in range(fill_prompts):
            await turn(session, base_url, result, words(f"fill{i}x", fill_words), None, 1)
        before = (await _written(session, base_url))["tiers"]
        again_s, again, during, loaded = await beside_stream(session, base_url, result,
                                                             long_prompt, stream_tokens)
        after = (await server_info(session, base_url))["tiers"]
        cold_s, _, during_cold, _ = await beside_stream(
            session, base_url, result, words("cold", num_words), stream_tokens)
    meta = again.get("meta_info", {})
    result.wall_s = time.perf_counter() - t0
    result.extra.update(
        prompt_tokens=meta.get("prompt_tokens"), cached_tokens=meta.get("cached_tokens"),
        disk_hit_tokens=after["disk"]["hit_tokens"] - before["disk"]["hit_tokens"],
        host_hit_tokens=after["host"]["hit_tokens"] - before["host"]["hit_tokens"],
        from_disk_s=round(again_s, 3), computed_s=round(cold_s, 3),
        idle_itl_p50_s=round(percentile(idle, 50), 4),
        idle_itl_p99_s=round(percentile(idle, 99), 4),
        loaded_itl_p50_s=round(percentile(loaded, 50), 4),
        loaded_itl_p99_s=round(percentile(loaded, 99), 4),
        gaps_during_load=len(during),
        during_load_max_gap_s=round(max(during, default=0.0), 4),
        during_compute_max_gap_s=round(max(during_cold, default=0.0), 4))
    return result
