"""Server vs executor: inter-token latency of the same decode batch in-process and through the
server (HTTP, tokenizer manager, detokenizer, streaming clients), in one invocation, and the
CPU time each server process spends per streamed token.

    python -m sgl_tpu.bench.serve_gap [--batch 8] [--shared-tokens 1300] [--own-tokens 300]
        [--output-tokens 64] [--rounds 3] [--server-flags "..."]

Each round runs the same work twice, in-process first, then through the server: pre-cache one
shared prefix (an agent fleet's system prompt), then `--batch` greedy requests of shared prefix
+ own tokens, all at once, each generating exactly `--output-tokens`. In-process the bench
drives `Scheduler.step()` of an `Engine` itself and timestamps each step's outputs; through the
server it streams native `/generate` and timestamps each SSE chunk. ITL = the time between two
consecutive updates of a request divided by the tokens they added. The in-process executor
runs with the thread count the server's scheduler process picks (`--engine-threads` to change).
Rounds alternate (the machine may be shared: compare the ratio, not absolute times); the JSON
reports each round and the medians, with `gap` = server ITL p50 / in-process ITL p50 - 1.
Each server round also reports `cpu_ms_per_token`: CPU time (user + system, from /proc) of the
launcher (`http`: HTTP and tokenizer manager) and of the scheduler's sibling processes
(`other_children`: the detokenizer and helpers) over the round's requests, per generated token:
what the processes beside the executor take from its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import tempfile
import time

import numpy as np

from sgl_tpu.bench.reliability.phases import child_pids
from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serving import Server

FIRST_ID = 17  # prompt ids avoid the special tokens


def make_prompts(args: argparse.Namespace, vocab: int, seed: int
                 ) -> tuple[list[int], list[list[int]]]:
    """(shared prefix, one prompt per request) as token ids."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(FIRST_ID, vocab, args.shared_tokens).tolist()
    prompts = [shared + rng.integers(FIRST_ID, vocab, args.own_tokens).tolist()
               for _ in range(args.batch)]
    return shared, prompts


def sampling(max_new_tokens: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def itl_stats(times: dict[str, list[tuple[float, int]]]) -> dict:
    """Per request a list of (time, completion tokens so far) -> ITL p50/mean in ms."""
    itls = []
    for updates in times.values():
        for (t0, n0), (t1, n1) in zip(updates, updates[1:], strict=False):
            if n1 > n0:
                itls += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    itls.sort()
    return {"itl_p50_ms": round(1e3 * itls[len(itls) // 2], 2),
            "itl_mean_ms": round(1e3 * statistics.mean(itls), 2), "tokens": len(itls)}


def run_in_process(engine, shared: list[int], prompts: list[list[int]], out_tokens: int) -> dict:
    """The batch through `Scheduler.step()` directly (no detokenizer, no HTTP)."""
    from sgl_tpu.messages import TokenizedGenerateReq

    sched = engine.scheduler
    sched.flush_cache()
    engine.generate(input_ids=shared, sampling_params=sampling(0))
    times: dict[str, list[tuple[float, int]]] = {}
    for i, ids in enumerate(prompts):
        rid = f"gap-{i}"
        sched.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids,
                                               sampling=sampling(out_tokens)))
        times[rid] = []
    done = 0
    while done < len(prompts):
        for out in sched.step():
            if out.new_token_ids:
                times[out.rid].append((time.perf_counter(), out.completion_tokens))
            done += out.finished
    return itl_stats(times)


async def run_server(url: str, shared: list[int], prompts: list[list[int]],
                     out_tokens: int) -> dict:
    import aiohttp

    times: dict[str, list[tuple[float, int]]] = {}

    async def one(rid: str, ids: list[int], max_new: int, stream: bool) -> None:
        body = {"input_ids": ids, "stream": stream, "sampling_params": sampling(max_new)}
        async with session.post(url + "/generate", json=body) as resp:
            resp.raise_for_status()
            if not stream:
                await resp.read()
                return
            updates = times[rid] = []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                    updates.append((time.perf_counter(), n))

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/flush_cache") as resp:
            await resp.read()
        await one("prefix", shared, 0, stream=False)
        await asyncio.gather(*(one(f"gap-{i}", ids, out_tokens, stream=True)
                               for i, ids in enumerate(prompts)))
    return itl_stats(times)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(launcher: int, scheduler: int) -> dict[str, float]:
    """CPU seconds so far of the launcher and of its children but the scheduler, together."""
    others = [p for p in child_pids(launcher) if p != scheduler]
    return {"http": cpu_seconds(launcher),
            "other_children": sum(cpu_seconds(p) for p in others)}


def run(args: argparse.Namespace) -> dict:
    import requests

    from sgl_tpu.engine import Engine

    flags = shlex.split(args.server_flags)
    engine_kwargs = _engine_kwargs(flags, args.engine_threads)
    engine = Engine(args.model_path, **engine_kwargs)
    vocab = engine.model_config.vocab_size
    log = tempfile.NamedTemporaryFile(prefix="serve_gap-", suffix=".log", delete=False).name
    model = ["--model-path", args.model_path] if args.model_path else []
    server = Server([*model, *flags], log)
    rounds = []
    try:
        server.wait_ready()
        for r in range(args.rounds + 1):  # round 0 warms both paths, not reported
            shared, prompts = make_prompts(args, vocab, seed=r)
            local = run_in_process(engine, shared, prompts, args.output_tokens)
            scheduler = requests.get(server.url + "/server_info", timeout=30).json()[
                "scheduler_pid"]
            before = server_cpu(server.proc.pid, scheduler)
            remote = asyncio.run(run_server(server.url, shared, prompts, args.output_tokens))
            after = server_cpu(server.proc.pid, scheduler)
            tokens = len(prompts) * args.output_tokens
            remote["cpu_ms_per_token"] = {k: round(1e3 * (after[k] - before[k]) / tokens, 3)
                                          for k in after}
            if r:
                rounds.append({"in_process": local, "server": remote})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        server.stop()
        engine.shutdown()
    cpu = {k: statistics.median(x["server"]["cpu_ms_per_token"][k] for x in rounds)
           for k in rounds[0]["server"]["cpu_ms_per_token"]}
    local_p50 = statistics.median(x["in_process"]["itl_p50_ms"] for x in rounds)
    server_p50 = statistics.median(x["server"]["itl_p50_ms"] for x in rounds)
    return {"args": vars(args), "server_log": log, "rounds": rounds,
            "in_process_itl_p50_ms": local_p50, "server_itl_p50_ms": server_p50,
            "gap": round(server_p50 / local_p50 - 1, 3), "server_cpu_ms_per_token": cpu}


def _engine_kwargs(flags: list[str], threads: int) -> dict:
    """Server flags -> Engine keyword arguments: the same `ServerArgs` (the same executor
    threads as the server's scheduler process), or `threads` executor threads when given."""
    import dataclasses

    from sgl_tpu.cli import parse_args

    parsed = parse_args(flags)
    if threads:
        parsed = dataclasses.replace(parsed, torch_threads=threads)
    return {k: v for k, v in dataclasses.asdict(parsed).items() if k != "model_path"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--shared-tokens", type=int, default=1300)
    p.add_argument("--own-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-flags", default="", help="flags for both the server and Engine")
    p.add_argument("--engine-threads", type=int, default=0,
                   help="in-process executor threads (default: what the server picks)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
