"""CPU of the HTTP process per streamed token, by API, on one server in one invocation.

    python -m sgl_tpu.bench.http_cpu [--model-path M] [--streams 32] [--output-tokens 256]
        [--rounds 3] [--apis native,chat,completions] [--server-flags "..."] [--output F]

One HTTP process (uvicorn, the tokenizer manager) streams every token of every request, so
its CPU per token caps what one server streams, whatever the accelerator does. The bench
launches one server, then in each round streams `--streams` concurrent requests of exactly
`--output-tokens` tokens (`ignore_eos`) through each API in turn, the order rotated between
rounds: `native` (`/generate`), `chat` (`/v1/chat/completions`), `completions`
(`/v1/completions`). Around each batch it reads the launcher's CPU time (user + system, from
/proc) and the scheduler's generated-token count (`/server_info`): ms of HTTP-process CPU per
generated token, and the SSE events per token the clients got. Serve a `python -m
sgl_tpu.bench.random_checkpoint shape --minimal` model so the model does not set the pace (the
clients share the machine; on two cores compare APIs or code versions within one run).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import requests

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serve_gap import cpu_seconds
from sgl_tpu.bench.serving import Server

PROMPT = "Tell me a long story about a lighthouse keeper."
APIS = ("native", "chat", "completions")


def request_body(api: str, out_tokens: int) -> tuple[str, dict]:
    """(path, streamed request body) of `api`, greedy, exactly `out_tokens` tokens."""
    if api == "native":
        return "/generate", {"text": PROMPT, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True}}
    common = {"model": "default", "stream": True, "max_tokens": out_tokens, "temperature": 0,
              "ignore_eos": True}
    if api == "chat":
        return "/v1/chat/completions", {**common,
                                        "messages": [{"role": "user", "content": PROMPT}]}
    return "/v1/completions", {**common, "prompt": PROMPT}


async def stream_all(url: str, api: str, streams: int, out_tokens: int) -> int:
    """`streams` concurrent streamed requests -> the SSE data events received."""
    import aiohttp

    path, body = request_body(api, out_tokens)

    async def one(session) -> int:
        events = 0
        async with session.post(url + path, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                events += line.startswith(b"data:")
        return events

    async with aiohttp.ClientSession() as session:
        return sum(await asyncio.gather(*(one(session) for _ in range(streams))))


def generated_tokens(url: str) -> int:
    return requests.get(url + "/server_info", timeout=30).json()["stats"]["generated_tokens"]


def measure(server: Server, api: str, streams: int, out_tokens: int) -> dict:
    """One batch of streams through `api` -> HTTP CPU ms and SSE events per generated token."""
    tokens0, cpu0 = generated_tokens(server.url), cpu_seconds(server.proc.pid)
    events = asyncio.run(stream_all(server.url, api, streams, out_tokens))
    cpu1, tokens1 = cpu_seconds(server.proc.pid), generated_tokens(server.url)
    tokens = tokens1 - tokens0
    return {"api": api, "tokens": tokens, "events_per_token": round(events / tokens, 3),
            "http_cpu_ms_per_token": round(1e3 * (cpu1 - cpu0) / tokens, 4)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--apis", default=",".join(APIS))
    p.add_argument("--server-flags", default="", help="more flags for the server")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    apis = args.apis.split(",")
    unknown = set(apis) - set(APIS)
    if unknown:
        p.error(f"--apis: unknown {sorted(unknown)}; choose from {APIS}")
    flags = args.server_flags.split() + (["--model-path", args.model_path]
                                         if args.model_path else [])
    log = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_http_cpu_")) / "server.log"
    server = Server(flags, str(log))
    runs = []
    try:
        server.wait_ready()
        for api in apis:  # warm every path once
            asyncio.run(stream_all(server.url, api, 2, 4))
        for rnd in range(args.rounds):
            for api in apis[rnd % len(apis):] + apis[:rnd % len(apis)]:
                runs.append({"round": rnd, **measure(server, api, args.streams,
                                                     args.output_tokens)})
                print(runs[-1], flush=True)
    finally:
        server.stop()
    summary = {api: {"http_cpu_ms_per_token_median": statistics.median(
                         r["http_cpu_ms_per_token"] for r in runs if r["api"] == api),
                     "events_per_token": statistics.median(
                         r["events_per_token"] for r in runs if r["api"] == api)}
               for api in apis}
    emit({"args": vars(args), "runs": runs, "summary": summary}, args.output)


if __name__ == "__main__":
    main()
