"""The HTTP side of the serving benches: a server launched as a child process (`Server`), token-id
workloads, and streaming clients that time them.

    Server(flags, log) ──► python -m sgl_tpu.launch_server --port <free> <flags>
    make_workload ──► per client, a list of prompts (token ids)
    run_workload(url, clients, out_tokens, procs)
        procs client processes ──► each: its clients concurrently on one event loop,
        each client's prompts in turn, streamed from /generate ──► throughput, TTFT,
        cache hits, the clients' own CPU per token
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sgl_tpu.server.ready import ready_line

# How often a launched server's /health and log are polled until it is ready (a poll costs a
# millisecond or two; a coarser one leaves half a period idle per launch on average)
READY_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        # (the environment as it is: JAX_PLATFORMS unset lets JAX find an accelerator)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgl_tpu.launch_server", "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900) -> None:
        import requests

        ready = ready_line(self.port)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if (requests.get(self.url + "/health", timeout=2).status_code == 200
                        and ready.search(open(self.log.name, errors="replace").read())):
                    return
            except requests.RequestException:
                pass
            time.sleep(READY_POLL_S)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def make_workload(kind: str, vocab: int, clients: int, seed: int, prefix_tokens: int,
                  question_tokens: int = 0, requests_per_client: int = 1
                  ) -> list[list[list[int]]]:
    """Per client, a list of prompts (token ids): `prefix_tokens` then `question_tokens`, the
    prefix the same in every prompt when `kind` is "shared", else random too. Ids avoid the
    special tokens 0..16."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(17, vocab, prefix_tokens).tolist()
    out = []
    for _ in range(clients):
        prompts = []
        for _ in range(requests_per_client):
            question = rng.integers(17, vocab, question_tokens).tolist()
            if kind == "shared":
                prompts.append(prefix + question)
            else:
                prompts.append(rng.integers(17, vocab, prefix_tokens).tolist() + question)
        out.append(prompts)
    return out


async def one_request(session, url: str, ids: list[int], out_tokens: int) -> dict:
    """One streamed `/generate` request -> its latency, TTFT and token counts.

    Only the events up to the first token and the last event are parsed: at many streams the
    client is one Python process like the server's HTTP process, and JSON-decoding every
    cumulative chunk would make it the bottleneck the benchmark measures."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": out_tokens,
                                "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    last = None
    async with session.post(url + "/generate", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            if not raw.startswith(b"data:") or raw.startswith(b"data: [DONE]"):
                continue
            last = raw
            if ttft is None and json.loads(raw[5:])["meta_info"]["completion_tokens"] > 0:
                ttft = time.perf_counter() - t0
    if last is None:
        raise RuntimeError(f"{url}/generate streamed no data event")
    meta = json.loads(last[5:])["meta_info"]
    return {"latency": time.perf_counter() - t0, "ttft": ttft,
            "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
            "completion_tokens": meta["completion_tokens"]}


async def _run_clients(url: str, clients: list[list[list[int]]], out_tokens: int,
                       ready: Callable[[], None] | None = None
                       ) -> tuple[list[dict], float, float, float]:
    """Every client's prompts in turn, the clients concurrently, on one event loop ->
    (per-request results, wall-clock start, end, this process's CPU seconds in between).
    `ready()` (blocking) is called once the HTTP session exists, right before the first
    request."""
    import aiohttp

    async def client(prompts):
        return [await one_request(session, url, ids, out_tokens) for ids in prompts]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if ready is not None:
            await asyncio.get_running_loop().run_in_executor(None, ready)
        cpu0, t0 = os.times(), time.time()
        per_client = await asyncio.gather(*(client(p) for p in clients))
        cpu1, t1 = os.times(), time.time()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return [r for c in per_client for r in c], t0, t1, cpu


def _client_process(url: str, clients: list[list[list[int]]], out_tokens: int,
                    start: Any, results: Any) -> None:
    """One client process: its clients' requests after every process is ready (`start`, a
    barrier shared with the parent); what `_run_clients` returns into `results`."""
    results.put(asyncio.run(_run_clients(url, clients, out_tokens, ready=start.wait)))


async def run_workload(url: str, clients: list[list[list[int]]], out_tokens: int,
                       procs: int = 1) -> dict:
    """Stream every client's prompts (clients concurrently) -> throughput, TTFT, cache hits,
    and the client side's CPU: per generated token, and `client_busy`, the share of one core
    each client process used on average (near 1: the clients set the pace, not the server).

    `procs` > 1 splits the clients over that many processes, started together: one Python
    process parses ~25k streamed chunks/s at most (aiohttp, one core), near what a server on
    an accelerator is asked to stream, so one client process would measure itself. They are
    spawned (they import the caller's main module again: a script that calls this needs the
    `if __name__ == "__main__":` guard; the bench modules have it)."""
    procs = max(1, min(procs, len(clients)))
    if procs == 1:
        rs, t0, t1, cpu = await _run_clients(url, clients, out_tokens)
    else:
        rs, t0, t1, cpu = await asyncio.get_running_loop().run_in_executor(
            None, _spread_clients, url, clients, out_tokens, procs)
    wall = t1 - t0
    prompt = sum(r["prompt_tokens"] for r in rs)
    cached = sum(r["cached_tokens"] for r in rs)
    gen = sum(r["completion_tokens"] for r in rs)
    ttfts = sorted(r["ttft"] for r in rs if r["ttft"] is not None)
    # inter-token latency: each request's time after its first token over its later tokens
    itls = sorted((r["latency"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in rs
                  if r["ttft"] is not None and r["completion_tokens"] > 1)
    return {"requests": len(rs), "wall_s": round(wall, 2),
            "req_per_s": round(len(rs) / wall, 3),
            "output_tok_per_s": round(gen / wall, 1),
            "total_tok_per_s": round((prompt + gen) / wall, 1),
            "cache_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
            "ttft_mean_s": round(statistics.mean(ttfts), 3),
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
            "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 3),
            "itl_p50_ms": round(1000 * itls[len(itls) // 2], 2) if itls else None,
            "client_procs": procs,
            "client_cpu_ms_per_token": round(1000 * cpu / max(gen, 1), 4),
            "client_busy": round(cpu / procs / wall, 3)}


def _spread_clients(url: str, clients: list[list[list[int]]], out_tokens: int, procs: int
                    ) -> tuple[list[dict], float, float, float]:
    """The clients dealt round-robin over `procs` processes that start their requests
    together -> (all results, first start, last end, the processes' CPU seconds)."""
    ctx = mp.get_context("spawn")  # no fork of a parent that may hold threads
    start, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(url, clients[i::procs], out_tokens, start, results))
               for i in range(procs)]
    for w in workers:
        w.start()
    try:
        try:
            start.wait(timeout=300)
        except threading.BrokenBarrierError:
            codes = [w.exitcode for w in workers]
            raise RuntimeError(f"client processes not ready after 300 s (exit codes {codes})"
                               ) from None
        parts = []
        while len(parts) < procs:
            try:
                parts.append(results.get(timeout=1))
            except queue.Empty:
                failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a client process exited with {failed[0]}") from None
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    return ([r for p in parts for r in p[0]], min(p[1] for p in parts),
            max(p[2] for p in parts), sum(p[3] for p in parts))
