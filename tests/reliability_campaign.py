"""The long reliability campaign: load, disconnects and aborts, KV exhaustion, prompts of
hundreds of thousands of characters, property-based fuzzing of every route's body and a killed
child process, each followed by the invariants of `reliability_invariants.py`. The tests
(`tests/test_reliability*.py`) run its phases at CI size; this runs them at full size:

    .venv/bin/python tests/reliability_campaign.py [--clients 128] [--requests-per-client 4]
        [--exhaustion-clients 32] [--fuzz-examples 100] [--big-prompts 8]
        [--big-prompt-chars 500000] [--max-total-tokens 1024] [--flood-programs 65536]
        [--shared-key-parallel 48] [--programs-max-total-tokens 4096]
        [--phases base,kill,programs] [--seed 0] [--output FILE]

Starts a server on loopback (a small KV pool, so load also exhausts it), runs the phases load,
disconnect, exhaustion, big_prompt and fuzz with a latency probe alongside
(`reliability_phases.py`, `reliability_fuzz.py`), checks the invariants after each, then starts
a second server and kills one of its children, then runs the program phases
(`reliability_programs.py`: a held newcomer beside a long-lived agent, a flood of
`--flood-programs` session ids, one key's `--shared-key-parallel` requests beside agents) on a
server with a `--programs-max-total-tokens` pool, and a prompt read back from the disk tier on
one more, of `--max-total-tokens`. `--phases` picks among base (load to fuzz), kill, programs
(all four of those), and newcomer, flood, shared_key or disk_load alone. Prints the figures as
JSON: clients and requests held, disconnects and aborts survived, bad inputs tried per class,
faults injected, 5xx count, leaked KV pages, p50/p99 latency of a small request during the
campaign, and each program phase's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections import Counter
from typing import Any

import requests
from reliability_fuzz import CLASSES, ROUTES, URL_ROUTES, run_fuzz, run_url_fuzz
from reliability_invariants import check_invariants
from reliability_phases import (
    LatencyProbe,
    big_prompt_phase,
    disconnect_phase,
    exhaustion_phase,
    kill_child_phase,
    load_phase,
    percentile,
)
from reliability_programs import (
    disk_load_phase,
    flood_phase,
    newcomer_phase,
    shared_key_phase,
)

from sgl_tpu.bench.http_load import Server
from sgl_tpu.bench.report import emit

API_KEY = "campaign-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def make_sender(base_url: str, headers: dict[str, str]):
    session = requests.Session()

    def send(route: str, data: bytes, content_type: str) -> int:
        h = dict(headers)
        if content_type:
            h["Content-Type"] = content_type
        return session.post(base_url + route, data=data, headers=h, timeout=120).status_code

    return send


def url_fuzz(base_url: str, headers: dict[str, str], num_examples: int,
             seed: int | None) -> Counter:
    """Every `URL_ROUTES` entry, with one stored response's id among the generated ones."""
    session = requests.Session()
    stored = session.post(base_url + "/v1/responses", headers=headers, timeout=120,
                          json={"input": "Hi", "max_output_tokens": 2}).json()["id"]

    def send(method: str, url: str) -> int:
        return session.request(method, base_url + url, headers=headers,
                               timeout=120).status_code

    statuses: Counter = Counter()
    for method, path, params in URL_ROUTES:
        statuses += run_url_fuzz(send, method, path, params, [stored], num_examples, seed)
    return statuses


async def campaign(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    headers = HEADERS
    phases: dict[str, Any] = {}
    fuzz_counts: dict[str, int] = Counter()
    fuzz_statuses: Counter = Counter()
    async with LatencyProbe(base_url, headers) as probe:
        for name, run in (
            ("load", lambda: load_phase(base_url, headers, clients=args.clients,
                                        requests_per_client=args.requests_per_client,
                                        seed=args.seed)),
            ("disconnect", lambda: disconnect_phase(base_url, headers,
                                                    clients=args.clients // 2,
                                                    seed=args.seed)),
            ("exhaustion", lambda: exhaustion_phase(base_url, headers,
                                                    capacity_tokens=args.max_total_tokens,
                                                    clients=args.exhaustion_clients,
                                                    seed=args.seed)),
            ("big_prompt", lambda: big_prompt_phase(base_url, headers,
                                                    num_prompts=args.big_prompts,
                                                    num_chars=args.big_prompt_chars)),
        ):
            probe.phase = name
            result = await run()
            check_invariants(base_url, headers)
            phases[name] = {**result.to_dict(), "num_5xx": result.num_5xx, "invariants": "ok"}
        probe.phase = "fuzz"
        send = make_sender(base_url, headers)
        t0 = time.perf_counter()
        for route in ROUTES:
            for kind in CLASSES:
                statuses = await asyncio.to_thread(run_fuzz, send, route, kind,
                                                   args.fuzz_examples, args.seed)
                fuzz_counts[kind] += sum(statuses.values())
                fuzz_statuses.update(statuses)
        statuses = await asyncio.to_thread(url_fuzz, base_url, headers, args.fuzz_examples,
                                           args.seed)
        fuzz_counts["url"] += sum(statuses.values())
        fuzz_statuses.update(statuses)
        info = check_invariants(base_url, headers)
        phases["fuzz"] = {"bodies": sum(fuzz_counts.values()),
                          "statuses": dict(fuzz_statuses), "wall_s":
                          round(time.perf_counter() - t0, 2), "invariants": "ok"}
    return {"phases": phases, "bad_inputs_per_class": dict(fuzz_counts),
            "probe": {"requests": len(probe.latencies_s),
                      "statuses": dict(probe.statuses),
                      "p50_s": percentile(probe.latencies_s, 50),
                      "p99_s": percentile(probe.latencies_s, 99),
                      "p99_s_by_phase": {k: percentile(v, 99)
                                         for k, v in probe.by_phase.items()}},
            "leaked_pages": info["memory"]["num_pages_requests"],
            "requests_failed_by_faults": info["stats"].get("num_requests_failed")}


def serve(flags: list[str], log_name: str):
    """A started server (stopped by the caller)."""
    server = Server(flags, os.path.join(tempfile.gettempdir(), log_name))
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


PROGRAM_PHASES = ("newcomer", "flood", "shared_key")


def program_campaign(common: list[str], args: argparse.Namespace, chosen: set[str]
                     ) -> dict[str, Any]:
    """The `chosen` program phases, in PROGRAM_PHASES order, on a `--programs-max-total-tokens`
    pool."""
    phases: dict[str, Any] = {}
    server = serve(common + ["--max-total-tokens", str(args.programs_max_total_tokens)],
                   "reliability_programs.log")
    runs = {
        "newcomer": lambda: newcomer_phase(server.url, HEADERS),
        "flood": lambda: flood_phase(server.url, HEADERS, num_programs=args.flood_programs),
        "shared_key": lambda: shared_key_phase(server.url, HEADERS,
                                               parallel=args.shared_key_parallel,
                                               num_agents=args.shared_key_agents)}
    try:
        for name in PROGRAM_PHASES:
            if name in chosen:
                record_phase(phases, server.url, asyncio.run(runs[name]()))
    finally:
        server.stop()
    return phases


def disk_campaign(common: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The disk tier's phase on a `--max-total-tokens` pool with a host tier as large and the
    disk tier in a temporary folder."""
    phases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="reliability-hicache-") as folder:
        server = serve(common + ["--max-total-tokens", str(args.max_total_tokens),
                                 "--enable-hierarchical-cache", "--hicache-ratio", "1",
                                 "--hicache-storage-backend", "file",
                                 "--hicache-storage-dir", folder], "reliability_disk.log")
        try:
            record_phase(phases, server.url, asyncio.run(disk_load_phase(server.url, HEADERS)))
        finally:
            server.stop()
    return phases


def record_phase(phases: dict[str, Any], url: str, result) -> None:
    check_invariants(url, HEADERS)
    phases[result.name] = {**result.to_dict(), "num_5xx": result.num_5xx, "invariants": "ok"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--exhaustion-clients", type=int, default=32)
    p.add_argument("--fuzz-examples", type=int, default=100,
                   help="generated bodies per route and input class")
    p.add_argument("--big-prompts", type=int, default=8)
    p.add_argument("--big-prompt-chars", type=int, default=500_000)
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--flood-programs", type=int, default=65_536,
                   help="distinct session ids of the flood phase")
    p.add_argument("--shared-key-parallel", type=int, default=48,
                   help="parallel requests of one key in the shared_key phase")
    p.add_argument("--programs-max-total-tokens", type=int, default=4096,
                   help="the KV pool of the program phases' server")
    p.add_argument("--shared-key-agents", type=int, default=3,
                   help="the agents beside the shared key's parallel requests")
    p.add_argument("--phases", default="base,kill,programs",
                   help="comma-separated: base (load to fuzz), kill, programs (newcomer, flood, "
                        "shared_key and disk_load), or any of those four alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    chosen = set(args.phases.split(","))
    known = {"base", "kill", "programs", *PROGRAM_PHASES, "disk_load"}
    if not chosen or chosen - known:
        p.error(f"--phases: some of {sorted(known)}, not {args.phases!r}")
    common = ["--api-key", API_KEY, "--max-running-requests", "32", "--dtype", "float32"]
    if args.model_path:
        common += ["--model-path", args.model_path]
    flags = common + ["--max-total-tokens", str(args.max_total_tokens)]
    results: dict[str, Any] = {"phases": {}, "probe": {"requests": 0, "statuses": {},
                                                        "p99_s": None}, "leaked_pages": 0}
    if "base" in chosen:
        server = serve(flags, "reliability_server.log")
        try:
            results = asyncio.run(campaign(server.url, args))
        finally:
            server.stop()
    kill = None
    if "kill" in chosen:
        victim_server = serve(flags, "reliability_kill.log")
        try:
            headers = HEADERS
            victim = requests.get(victim_server.url + "/server_info", headers=headers,
                                  timeout=30).json()["scheduler_pid"]
            kill = asyncio.run(kill_child_phase(victim_server.url, headers,
                                                victim_server.proc.pid, victim=victim))
            victim_server.proc.wait(30)
            kill.extra["server_exit_code"] = victim_server.proc.returncode
        finally:
            if victim_server.proc.poll() is None:
                victim_server.stop()
        results["phases"]["kill_child"] = kill.to_dict()
    if "programs" in chosen:
        chosen |= set(PROGRAM_PHASES)
    if chosen & set(PROGRAM_PHASES):
        results["phases"].update(program_campaign(common, args, chosen))
    if "programs" in chosen or "disk_load" in chosen:
        results["phases"].update(disk_campaign(common, args))
    phases = results["phases"]
    results["totals"] = {
        "clients": args.clients,
        "requests": sum(ph.get("requests", ph.get("bodies", 0)) for ph in phases.values())
                    + results["probe"]["requests"],
        "disconnects": sum(ph.get("disconnects", 0) for ph in phases.values()),
        "aborts": sum(ph.get("aborts", 0) for ph in phases.values()),
        "faults_injected": kill.faults_injected if kill else 0,
        "num_5xx_outside_fatal_fault": sum(ph.get("num_5xx", 0) for ph in phases.values())
                                       + sum(n for s, n in results["probe"]["statuses"].items()
                                             if int(s) >= 500),
        "leaked_pages": results["leaked_pages"],
        "small_request_p99_s": results["probe"]["p99_s"],
    }
    results["args"] = vars(args)
    emit(results, args.output)


if __name__ == "__main__":
    main()
