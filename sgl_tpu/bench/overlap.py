"""Overlap scheduling on vs off through HTTP, in one invocation, reported as same-run ratios.

    python -m sgl_tpu.bench.overlap [--concurrency 1 8 32] [--rounds 3] [--prompt-tokens 128]
        [--output-tokens 64] [--server-flags "--torch-threads 1"] [--client-procs 1]
        [--engine] [--output overlap.json]

Launches two servers side by side, `overlap` (`--overlap-schedule on`) and `serial`
(`--disable-overlap-schedule`), warms both, then runs `rounds` rounds; in each, for every
concurrency level, both servers get the same streams (random prompts, greedy, fixed output
length), in alternating order so drifting machine load hits both alike; `--client-procs N`
spreads the streams over N client processes (where one would cap what it measures: each run
reports the clients' CPU per token). `--engine` instead runs one in-process `Engine` and
switches its scheduler between the two loops (the same weights and warm-up; no HTTP,
detokenizer process or sockets); it is built with overlap scheduling on, so a torch runner on
CPU runs both loops' steps on its compute thread.
Reports each run and, per concurrency level, the median over rounds of overlap/serial output
throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serving import Server, make_workload, run_workload

CONFIGS = {"overlap": ["--overlap-schedule", "on"], "serial": ["--disable-overlap-schedule"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--server-flags", default="", help="extra flags for both servers")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the streams are spread over (servers only)")
    p.add_argument("--engine", action="store_true",
                   help="one in-process Engine (server flags as its keyword arguments)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    from sgl_tpu.loader import load_tokenizer

    vocab = load_tokenizer(args.model_path).vocab_size
    base = args.server_flags.split() + (["--model-path", args.model_path]
                                        if args.model_path else [])

    def workload(clients: int, seed: int) -> list[list[list[int]]]:
        shape = argparse.Namespace(clients=clients, requests_per_client=1, question_tokens=0,
                                   prefix_tokens=args.prompt_tokens)
        return make_workload("random", shape, vocab, seed)

    results: dict = {"args": vars(args)}
    run = _run_engine if args.engine else _run_servers
    results["runs"] = run(args, base, workload)
    results["summary"] = summarize(results["runs"])
    emit(results, args.output)


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per concurrency level: the median output tok/s of each loop, overlap/serial of every
    round that ran both (a run cut short has fewer), their median, and the busiest client
    process's share of a core (servers only; near 1: the clients, not the server, set the
    pace). Levels and loops without a run are left out."""
    summary: dict[str, dict] = {}
    for c in dict.fromkeys(r["concurrency"] for r in runs):
        by = {(r["round"], r["config"]): r for r in runs if r["concurrency"] == c}
        rounds = sorted(dict.fromkeys(rnd for rnd, _ in by))
        row = {f"{name}_output_tok_per_s": statistics.median(tput) for name in CONFIGS
               if (tput := [by[rnd, name]["output_tok_per_s"] for rnd in rounds
                            if (rnd, name) in by])}
        ratios = [by[rnd, "overlap"]["output_tok_per_s"] / by[rnd, "serial"]["output_tok_per_s"]
                  for rnd in rounds if (rnd, "overlap") in by and (rnd, "serial") in by]
        if ratios:
            row["overlap_over_serial_median"] = round(statistics.median(ratios), 3)
            row["per_round"] = [round(x, 3) for x in ratios]
        busy = [r["client_busy"] for r in by.values() if "client_busy" in r]
        if busy:
            row["client_busy_max"] = max(busy)
        summary[str(c)] = row
    return summary


def _rounds(args, workload, send) -> list[dict]:
    """`send(config, clients) -> metrics` for every round, concurrency and config (in
    alternating order)."""
    runs = []
    for rnd in range(args.rounds):
        for c in args.concurrency:
            order = list(CONFIGS) if (rnd + c) % 2 == 0 else list(CONFIGS)[::-1]
            for name in order:
                r = {"round": rnd, "concurrency": c, "config": name,
                     **send(name, workload(c, rnd * 100 + c))}
                runs.append(r)
                print(json.dumps(r), flush=True)
    return runs


def _run_servers(args, base: list[str], workload) -> list[dict]:
    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_overlap_"))
    servers = {name: Server(base + flags, str(logs / f"{name}.log"))
               for name, flags in CONFIGS.items()}
    try:
        for server in servers.values():
            server.wait_ready()
            for c in args.concurrency:  # every decode batch shape once
                asyncio.run(run_workload(server.url, workload(c, 10_000 + c), 4))
        return _rounds(args, workload, lambda name, clients: asyncio.run(
            run_workload(servers[name].url, clients, args.output_tokens, args.client_procs)))
    finally:
        for server in servers.values():
            server.stop()


def _run_engine(args, base: list[str], workload) -> list[dict]:
    from sgl_tpu.cli import parse_args
    from sgl_tpu.engine import Engine

    kwargs = {k: v for k, v in vars(parse_args(base + CONFIGS["overlap"])).items()
              if k != "model_path"}
    engine = Engine(args.model_path, **kwargs)
    sp = {"temperature": 0, "max_new_tokens": args.output_tokens, "ignore_eos": True}

    def send(name: str, clients: list[list[list[int]]]) -> dict:
        engine.scheduler.overlap = name == "overlap"
        engine.scheduler.flush_cache()
        prompts = [p for c in clients for p in c]
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return {"requests": len(prompts), "wall_s": round(wall, 2),
                "output_tok_per_s": round(gen / wall, 1)}

    try:
        for c in args.concurrency:
            engine.generate(input_ids=[p for cl in workload(c, 10_000 + c) for p in cl],
                            sampling_params={**sp, "max_new_tokens": 4})
        return _rounds(args, workload, send)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
