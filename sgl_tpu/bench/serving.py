"""Serving benchmark through HTTP: two server configurations side by side in one invocation,
reported as ratios (the machine is shared; absolute numbers drift).

    python -m sgl_tpu.bench.serving [--compare cache] [--clients 16] [--requests-per-client 2]
        [--prefix-tokens 1000] [--question-tokens 50] [--output-tokens 32]
        [--workloads shared,random] [--server-flags "..."] [--output FILE]
    python -m sgl_tpu.bench.serving --compare overlap [--concurrency 1 8 32] [--rounds 3]
        [--prompt-tokens 128] [--output-tokens 64] [--client-procs 1] [--engine]
        [--server-flags "--torch-threads 1"] [--output FILE]
    python -m sgl_tpu.bench.serving --compare restart [--prefix-tokens 4096] [--output FILE]
    python -m sgl_tpu.bench.serving --compare resume [--prefix-tokens 6000] [--rounds 2]
        [--pause-s 8] [--server-flags "--max-total-tokens 8192"] [--output FILE]
    python -m sgl_tpu.bench.serving --compare speculation [--concurrency 1 8] [--rounds 3]
        [--prompt-tokens 128] [--output-tokens 256] [--server-flags "..."] [--output FILE]
    python -m sgl_tpu.bench.serving --compare gap [--concurrency 1 8 32] [--rounds 3]
        [--prompt-tokens 128] [--output-tokens 64] [--server-flags "..."] [--output FILE]
    python -m sgl_tpu.bench.serving --compare kv-cache-dtype [--kv-cache-dtypes int8 bfloat16]
        [--concurrency 1] [--rounds 3] [--prompt-tokens 8000] [--output-tokens 64] [--output FILE]

`--compare cache` (the default): `cache` (default flags) against `nocache`
(`--disable-radix-cache`), one server after the other, each warmed with one request, then the
workloads: `shared` (every request = one common system prompt + a distinct question, as agents
send) and `random` (no sharing: the cost of the cache when it cannot help). Clients stream from
`/generate`, so time-to-first-token is measured. Ratios: throughput cache/nocache, p50 TTFT
nocache/cache.

`--compare overlap`: `overlap` (`--overlap-schedule on`) against `serial`
(`--disable-overlap-schedule`), both servers up at once and warmed with every concurrency's
batch, then `--rounds` rounds; in each, for every concurrency level, both servers get the same
streams (random prompts, greedy, fixed output length), in alternating order so drifting load
hits both alike. `--engine` instead runs one in-process `Engine` and switches its scheduler
between the two loops (the same weights and warm-up; no HTTP, detokenizer process or sockets);
it is built with overlap scheduling on, so a torch runner on CPU runs both loops' steps on its
compute thread. Summary per concurrency: each loop's median output tok/s and overlap/serial.

`--compare kv-cache-dtype`: a server per `--kv-cache-dtypes` entry (first against second), all
up at once, then `--rounds` rounds of the same random prompts of `--prompt-tokens` (long
contexts: decode reads the whole KV of each) in alternating order; each run reports its inter-
token latency after the first token (`itl_p50_ms`) and `/server_info`'s KV bytes per token.
Summary per concurrency: the ITL of each side and first/second per round.

`--compare restart`: a server with the disk KV tier (`--enable-hierarchical-cache
--hicache-storage-backend file`, a fresh folder) gets one prompt of `--prefix-tokens` tokens
(`cold`: nothing cached); it is stopped and a new server on the same folder gets the same
prompt (`warm_restart`: its prefix read from disk). Each server first runs another short prompt,
so neither measurement includes compilation. Ratio: TTFT cold / warm_restart.

`--compare resume`: an agent's resumed call whose prefix (`--prefix-tokens`) was pushed out to
the host tier during its tool pause (`--enable-hierarchical-cache --hicache-ratio 4`, no
session-hint pins), on a server with prefetch (`prefetch`) and one without
(`--disable-kv-prefetch`, `reactive`), one after the other. On each, per round: a program makes
two turns `--pause-s` apart (its expected pause), then other traffic evicts its KV; a pause
later its third turn is timed (`demoted`, TTFT of a streamed
/generate; the pause counts from the second turn's end, the other traffic included). A second
program does the same without the other traffic (`resident`), and a prompt of the third turn's
length that nothing cached is timed too (`computed`). Ratios per server: TTFT demoted /
resident and demoted / computed (medians of rounds), and `prefetch`'s demoted over
`reactive`'s. `--resume-tier disk`: a disk tier (a fresh folder) and a host tier of a quarter
of the pool, so that the demoted prefix is read back from disk.

`--compare gap`: the server against its own executor. `server` is a server of the given flags
(HTTP streams through the tokenizer and detokenizer processes); `engine` is an in-process
`Engine` of the same flags in the bench process (the same scheduler and runner, no HTTP, no
processes around it). Both are up at once (only one runs at a time) and warmed with every
concurrency's batch; the rounds are those of `--compare overlap`. Summary per concurrency: each
side's median output tok/s and server/engine (1.0: the server costs nothing).

`--compare speculation`: `auto` (the default `--speculative-algorithm auto`) against `none`
(`--speculative-algorithm none`), both servers up at once, the streams and rounds of
`--compare overlap`; the result also holds each server's `/server_info` `speculative` section
at the end (what auto resolved to, its live decision per batch-size bucket). Summary per
concurrency: each side's median output tok/s and auto/none.

`--client-procs N` spreads the streams over N client processes (where one would cap what it
measures; each run reports the clients' CPU per token and `client_busy`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from sgl_tpu.bench.http_load import Server, make_workload, run_workload
from sgl_tpu.bench.report import emit

OVERLAP_CONFIGS = {"overlap": ["--overlap-schedule", "on"],
                   "serial": ["--disable-overlap-schedule"]}
SPECULATION_CONFIGS = {"auto": [], "none": ["--speculative-algorithm", "none"]}
Workload = Callable[[int, int], list[list[list[int]]]]  # (clients, seed) -> prompts per client


def compare_cache(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """Radix cache on against off: runs per (config, workload) and the ratios."""
    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_serving_"))
    configs = {"cache": base, "nocache": base + ["--disable-radix-cache"]}
    runs: dict[str, dict] = {}
    for name, flags in configs.items():
        server = Server(flags, str(logs / f"{name}.log"))
        try:
            server.wait_ready()
            warm = make_workload("random", vocab, seed=99, clients=1,
                                 prefix_tokens=args.prefix_tokens,
                                 question_tokens=args.question_tokens)
            asyncio.run(run_workload(server.url, warm, args.output_tokens))
            for w, kind in enumerate(args.workloads.split(",")):
                clients = make_workload(kind, vocab, seed=w, clients=args.clients,
                                        prefix_tokens=args.prefix_tokens,
                                        question_tokens=args.question_tokens,
                                        requests_per_client=args.requests_per_client)
                r = asyncio.run(run_workload(server.url, clients, args.output_tokens,
                                             args.client_procs))
                runs[f"{name}/{kind}"] = r
                print(json.dumps({f"{name}/{kind}": r}), flush=True)
        finally:
            server.stop()
    ratios = {}
    for kind in args.workloads.split(","):
        a, b = runs.get(f"cache/{kind}"), runs.get(f"nocache/{kind}")
        if a and b:
            ratios[kind] = {"throughput_cache_over_nocache":
                            round(a["total_tok_per_s"] / b["total_tok_per_s"], 3),
                            "ttft_p50_nocache_over_cache":
                            round(b["ttft_p50_s"] / a["ttft_p50_s"], 3)}
    return {"runs": runs, "ratios": ratios}


def _random_streams(args: argparse.Namespace, vocab: int) -> Workload:
    """(clients, seed) -> one random prompt of --prompt-tokens per client."""
    return partial(make_workload, "random", vocab, prefix_tokens=args.prompt_tokens)


def compare_overlap(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """Overlap scheduling on against off: every run and the summary per concurrency."""
    run = _overlap_engine if args.engine else _overlap_servers
    runs = run(args, base, _random_streams(args, vocab))
    return {"runs": runs, "summary": summarize(runs, tuple(OVERLAP_CONFIGS))}


def compare_speculation(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """Speculation auto against none: every run, each server's speculative state at the end,
    and the summary per concurrency."""
    spec: dict[str, dict] = {}
    runs = _servers(args, base, _random_streams(args, vocab), SPECULATION_CONFIGS, spec)
    return {"runs": runs, "speculative": spec,
            "summary": summarize(runs, tuple(SPECULATION_CONFIGS))}


def compare_gap(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """The server against an in-process Engine of the same flags: every run and the summary
    per concurrency."""
    workload = _random_streams(args, vocab)
    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_gap_"))
    server = Server(base, str(logs / "server.log"))
    engine = None
    try:
        server.wait_ready()
        engine = _engine(args, base)
        for c in args.concurrency:  # every decode batch shape once, on both
            asyncio.run(run_workload(server.url, workload(c, 10_000 + c), 4))
            _engine_run(engine, workload(c, 10_000 + c), 4)
        sides = {"server": partial(_stream, server.url, args),
                 "engine": lambda clients: _engine_run(engine, clients, args.output_tokens)}
        runs = _rounds(args, workload, sides)
    finally:
        server.stop()
        if engine is not None:
            engine.shutdown()
    return {"runs": runs, "summary": summarize(runs, ("server", "engine"))}


def compare_kv_cache_dtype(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """Two KV cache dtypes on long contexts: every run, each server's KV memory, and the ITL
    ratio per round."""
    first, second = args.kv_cache_dtypes
    configs = {name: ["--kv-cache-dtype", name] for name in (first, second)}
    memory: dict[str, dict] = {}
    runs = _servers(args, base, _random_streams(args, vocab), configs, memory=memory)
    summary = {}
    for c in args.concurrency:
        by = {(r["round"], r["config"]): r["itl_p50_ms"] for r in runs if r["concurrency"] == c}
        rounds = sorted({rnd for rnd, _ in by})
        ratios = [by[rnd, first] / by[rnd, second] for rnd in rounds
                  if (rnd, first) in by and (rnd, second) in by]
        summary[str(c)] = {
            **{f"{name}_itl_p50_ms": statistics.median(
                [v for (_, n), v in by.items() if n == name]) for name in configs},
            f"itl_{first}_over_{second}_median": round(statistics.median(ratios), 3),
            "per_round": [round(x, 3) for x in ratios]}
    tokens_per_gb = {name: m["kv_tokens_per_gb"] for name, m in memory.items()}
    return {"runs": runs, "memory": memory, "summary": summary,
            f"kv_tokens_per_gb_{first}_over_{second}": round(
                tokens_per_gb[first] / tokens_per_gb[second], 3)}


def compare_restart(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """TTFT of one long prompt on a cold server against a restarted one that reads the
    prompt's KV from its disk tier."""
    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_restart_"))
    flags = base + ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                    "--hicache-storage-dir", str(logs / "kv")]
    prompt = make_workload("random", vocab, seed=0, clients=1, prefix_tokens=args.prefix_tokens)
    warmup = make_workload("random", vocab, seed=1, clients=1, prefix_tokens=64)
    runs: dict[str, dict] = {}
    for name in ("cold", "warm_restart"):
        server = Server(flags, str(logs / f"{name}.log"))
        try:
            server.wait_ready()
            asyncio.run(run_workload(server.url, warmup, args.output_tokens))
            r = asyncio.run(run_workload(server.url, prompt, args.output_tokens))
            runs[name] = r
            print(json.dumps({name: r}), flush=True)
            _wait_disk_written(server.url)
        finally:
            server.stop()
    return {"runs": runs, "ratios": {
        "ttft_cold_over_warm_restart": round(runs["cold"]["ttft_p50_s"]
                                             / runs["warm_restart"]["ttft_p50_s"], 3)}}


def compare_resume(args: argparse.Namespace, base: list[str], vocab: int) -> dict:
    """TTFT of a resumed agent call whose prefix was demoted during its pause, with prefetch
    on and off, against the same call with its prefix resident."""
    import random
    import urllib.request

    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_resume_"))
    tier = (["--hicache-ratio", "4"] if args.resume_tier == "host" else
            ["--hicache-ratio", "0.25", "--hicache-storage-backend", "file",
             "--hicache-storage-dir", str(logs / "kv")])
    flags = base + ["--enable-hierarchical-cache", *tier,
                    "--session-retention-s", "0", "--tool-pause-grace-s", "0"]
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def post(url: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())

    def turn(url: str, key: str | None, prompt: list[int]) -> tuple[list[int], float]:
        """One streamed call: the context its next turn resends, and its TTFT."""
        body = {"input_ids": prompt, "stream": True, "session_id": key,
                "sampling_params": {"max_new_tokens": args.output_tokens, "temperature": 0,
                                    "ignore_eos": True}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, ttft, out = time.perf_counter(), None, []
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    ttft = ttft or time.perf_counter() - t0
                    out = json.loads(line[6:])["output_ids"]
        return prompt + out, ttft

    runs: dict[str, dict] = {}
    for name, extra in (("prefetch", []), ("reactive", ["--disable-kv-prefetch"])):
        server = Server(flags + extra, str(logs / f"{name}.log"))
        try:
            server.wait_ready()
            turn(server.url, None, ids(64))
            rounds = []
            for rnd in range(args.rounds):
                row = {}
                for case in ("resident", "demoted"):
                    key = f"{name}-{case}-{rnd}"
                    context, _ = turn(server.url, key, ids(args.prefix_tokens))
                    time.sleep(args.pause_s)
                    context, _ = turn(server.url, key, context + ids(64))
                    paused_at = time.monotonic()
                    if case == "demoted":
                        free = post(server.url, "/server_info")["memory"]["max_total_tokens"]
                        for _ in range(2):  # other agents' calls fill the pool
                            turn(server.url, None, ids(max(free - args.prefix_tokens, 512)))
                    time.sleep(max(0.0, paused_at + args.pause_s - time.monotonic()))
                    context = context + ids(64)
                    _, row[f"ttft_{case}_s"] = turn(server.url, key, context)
                _, row["ttft_computed_s"] = turn(server.url, None, ids(len(context)))
                row["demoted_over_resident"] = round(row["ttft_demoted_s"]
                                                     / row["ttft_resident_s"], 3)
                row["demoted_over_computed"] = round(row["ttft_demoted_s"]
                                                     / row["ttft_computed_s"], 3)
                rounds.append(row)
                print(json.dumps({name: row}), flush=True)
            info = post(server.url, "/server_info")
            runs[name] = {"rounds": rounds, "programs_kv": info["programs"]["kv"],
                          "tiers": info["tiers"],
                          "demoted_over_resident_median": statistics.median(
                              r["demoted_over_resident"] for r in rounds),
                          "demoted_over_computed_median": statistics.median(
                              r["demoted_over_computed"] for r in rounds)}
        finally:
            server.stop()
    demoted = {name: statistics.median(r["ttft_demoted_s"] for r in run["rounds"])
               for name, run in runs.items()}
    return {"runs": runs, "ratios": {
        "prefetch_demoted_over_resident": runs["prefetch"]["demoted_over_resident_median"],
        "reactive_demoted_over_resident": runs["reactive"]["demoted_over_resident_median"],
        "prefetch_demoted_over_computed": runs["prefetch"]["demoted_over_computed_median"],
        "reactive_demoted_over_computed": runs["reactive"]["demoted_over_computed_median"],
        "prefetch_over_reactive_demoted": round(demoted["prefetch"] / demoted["reactive"], 3)}}


def _wait_disk_written(url: str, timeout: float = 120.0) -> None:
    """Until the server's disk tier has written every queued page."""
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/server_info", timeout=30) as resp:
            if not json.loads(resp.read())["tiers"]["disk"]["queued_pages"]:
                return
        time.sleep(0.2)
    raise TimeoutError("the disk tier still has queued pages")


def summarize(runs: list[dict], names: tuple[str, str]) -> dict[str, dict]:
    """Per concurrency level: the median output tok/s of each side, first/second of every
    round that ran both (a run cut short has fewer), their median, and the busiest client
    process's share of a core (servers only; near 1: the clients, not the server, set the
    pace). Levels and sides without a run are left out."""
    first, second = names
    summary: dict[str, dict] = {}
    for c in dict.fromkeys(r["concurrency"] for r in runs):
        by = {(r["round"], r["config"]): r for r in runs if r["concurrency"] == c}
        rounds = sorted(dict.fromkeys(rnd for rnd, _ in by))
        row = {f"{name}_output_tok_per_s": statistics.median(tput) for name in names
               if (tput := [by[rnd, name]["output_tok_per_s"] for rnd in rounds
                            if (rnd, name) in by])}
        ratios = [by[rnd, first]["output_tok_per_s"] / by[rnd, second]["output_tok_per_s"]
                  for rnd in rounds if (rnd, first) in by and (rnd, second) in by]
        if ratios:
            row[f"{first}_over_{second}_median"] = round(statistics.median(ratios), 3)
            row["per_round"] = [round(x, 3) for x in ratios]
        busy = [r["client_busy"] for r in by.values() if "client_busy" in r]
        if busy:
            row["client_busy_max"] = max(busy)
        summary[str(c)] = row
    return summary


def _rounds(args: argparse.Namespace, workload: Workload,
            sides: dict[str, Callable[[list], dict]]) -> list[dict]:
    """`sides[name](clients) -> metrics` for every round, concurrency and side (in
    alternating order)."""
    runs = []
    for rnd in range(args.rounds):
        for c in args.concurrency:
            order = list(sides)
            if (rnd + c) % 2:
                order.reverse()
            for name in order:
                r = {"round": rnd, "concurrency": c, "config": name,
                     **sides[name](workload(c, rnd * 100 + c))}
                runs.append(r)
                print(json.dumps(r), flush=True)
    return runs


def _overlap_servers(args: argparse.Namespace, base: list[str], workload: Workload
                     ) -> list[dict]:
    return _servers(args, base, workload, OVERLAP_CONFIGS)


def _servers(args: argparse.Namespace, base: list[str], workload: Workload,
             configs: dict[str, list[str]], speculative: dict[str, dict] | None = None,
             memory: dict[str, dict] | None = None) -> list[dict]:
    """A server per config, all up at once, warmed, then `_rounds` over them;
    `speculative[name]` / `memory[name]`: each server's /server_info `speculative` / `memory`
    section at the end."""
    import urllib.request

    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_servers_"))
    servers = {name: Server(base + flags, str(logs / f"{name}.log"))
               for name, flags in configs.items()}
    try:
        for server in servers.values():
            server.wait_ready()
            for c in args.concurrency:  # every decode batch shape once
                asyncio.run(run_workload(server.url, workload(c, 10_000 + c), 4))
        runs = _rounds(args, workload, {name: partial(_stream, servers[name].url, args)
                                        for name in servers})
        for name, server in servers.items():
            if speculative is not None or memory is not None:
                with urllib.request.urlopen(server.url + "/server_info", timeout=60) as resp:
                    info = json.loads(resp.read())
                if speculative is not None:
                    speculative[name] = info.get("speculative", {})
                if memory is not None:
                    memory[name] = info["memory"]
        return runs
    finally:
        for server in servers.values():
            server.stop()


def _stream(url: str, args: argparse.Namespace, clients: list[list[list[int]]]) -> dict:
    return asyncio.run(run_workload(url, clients, args.output_tokens, args.client_procs))


def _engine(args: argparse.Namespace, flags: list[str]):
    """An in-process Engine of the server flags `flags`."""
    from sgl_tpu.cli import parse_args
    from sgl_tpu.engine import Engine

    kwargs = {k: v for k, v in vars(parse_args(flags)).items() if k != "model_path"}
    return Engine(args.model_path, **kwargs)


def _engine_run(engine, clients: list[list[list[int]]], output_tokens: int) -> dict:
    """Every client's prompts at once through `engine` (greedy, fixed length)."""
    sp = {"temperature": 0, "max_new_tokens": output_tokens, "ignore_eos": True}
    prompts = [p for c in clients for p in c]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    wall = time.perf_counter() - t0
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"requests": len(prompts), "wall_s": round(wall, 2),
            "output_tok_per_s": round(gen / wall, 1)}


def _overlap_engine(args: argparse.Namespace, base: list[str], workload: Workload
                    ) -> list[dict]:
    engine = _engine(args, base + OVERLAP_CONFIGS["overlap"])

    def side(overlap: bool, clients: list[list[list[int]]]) -> dict:
        engine.scheduler.overlap = overlap
        engine.scheduler.flush_cache()
        return _engine_run(engine, clients, args.output_tokens)

    try:
        for c in args.concurrency:
            _engine_run(engine, workload(c, 10_000 + c), 4)
        return _rounds(args, workload, {"overlap": partial(side, True),
                                        "serial": partial(side, False)})
    finally:
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=tuple(COMPARES), default="cache")
    p.add_argument("--model-path", default=None)
    p.add_argument("--output-tokens", type=int, default=None,
                   help="tokens per request (default: 32 for cache, 64 for overlap)")
    p.add_argument("--server-flags", default="", help="extra flags for both servers")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the streams are spread over (servers only)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    cache = p.add_argument_group("--compare cache (--prefix-tokens also: --compare restart)")
    cache.add_argument("--clients", type=int, default=16)
    cache.add_argument("--requests-per-client", type=int, default=2)
    cache.add_argument("--prefix-tokens", type=int, default=1000)
    cache.add_argument("--pause-s", type=float, default=8.0,
                       help="--compare resume: the agent's tool pause (the other traffic runs "
                            "in its first half)")
    cache.add_argument("--question-tokens", type=int, default=50)
    cache.add_argument("--resume-tier", choices=("host", "disk"), default="host",
                       help="--compare resume: the tier the demoted prefix comes back from")
    cache.add_argument("--workloads", default="shared,random")
    overlap = p.add_argument_group("--compare overlap, speculation, gap and kv-cache-dtype")
    overlap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    overlap.add_argument("--rounds", type=int, default=3)
    overlap.add_argument("--prompt-tokens", type=int, default=128)
    overlap.add_argument("--kv-cache-dtypes", nargs=2, default=["int8", "bfloat16"],
                         help="--compare kv-cache-dtype: the two --kv-cache-dtype values")
    overlap.add_argument("--engine", action="store_true",
                         help="one in-process Engine (server flags as its keyword arguments)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.output_tokens is None:
        args.output_tokens = 32 if args.compare == "cache" else 64
    from sgl_tpu.loader import load_tokenizer

    vocab = load_tokenizer(args.model_path).vocab_size
    base = args.server_flags.split() + (["--model-path", args.model_path]
                                        if args.model_path else [])
    compare = COMPARES[args.compare]
    emit({"args": vars(args), **compare(args, base, vocab)}, args.output)


COMPARES = {"cache": compare_cache, "overlap": compare_overlap, "restart": compare_restart,
            "resume": compare_resume,
            "gap": compare_gap, "speculation": compare_speculation,
            "kv-cache-dtype": compare_kv_cache_dtype}

if __name__ == "__main__":
    main()
