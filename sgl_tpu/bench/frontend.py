"""SGLang frontend benchmark: `run_batch` of a fork-heavy DSL program, radix cache on vs off.

    python -m sgl_tpu.bench.frontend [--programs 64] [--branches 4] [--branch-tokens 16]
        [--rules 12] [--server-flags "..."] [--output result.json]

Needs SGLang's frontend (`pip install --no-deps sglang` plus its few pure-Python dependencies;
see README, "SGLang frontend programs"). For each configuration (`cache`: default flags,
`nocache`: `--disable-radix-cache`) it launches a server (as `bench/serving.py` does), warms it
with a few programs, flushes the cache, then times `run_batch` over `--programs` inputs of one
program: a long shared instruction block, a per-input ticket, `fork` into `--branches` branches
that each generate a short note, `join`, and a summary. The hit rate is the server's own count
over the timed run: delta `stats.cached_tokens` / delta `stats.prompt_tokens` from
`/server_info`. Prints one JSON object with both runs and the nocache/cache wall-time ratio.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types

import requests

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serving import Server

ASPECTS = ("Category", "Urgency", "Owner team", "Next step", "Customer reply", "Risk")
TICKETS = (
    "The checkout page times out when the cart has more than 20 items.",
    "A customer was charged twice for the same order last Tuesday.",
    "Password reset emails arrive after about an hour.",
    "The mobile app crashes on start after the latest update.",
    "Invoices show the wrong VAT rate for customers in Austria.",
    "Search returns no results for product names with accents.",
    "The warehouse dashboard shows stock from yesterday.",
    "A user cannot remove an old credit card from the account.",
)


def import_frontend() -> types.ModuleType:
    """`import sglang`. With the frontend-only install, `sglang/__init__.py`'s one import of the
    GPU runtime (`sglang.srt.utils.hf_transformers_patches`) fails; then, and only then, a
    stand-in with a no-op `apply_all` takes its place (as `tests/sglang_frontend.py` does)."""
    name = "sglang.srt.utils.hf_transformers_patches"
    try:
        return importlib.import_module("sglang")
    except ImportError:
        for m in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[m]
    stand_in = types.ModuleType(name)
    stand_in.apply_all = lambda: None
    sys.modules[name] = stand_in
    return importlib.import_module("sglang")


def instructions(num_rules: int) -> str:
    """A long instruction block every program shares, as agents resend their system prompt."""
    rules = [f"Rule {i + 1}: tickets about {topic} go to the {team} team, who answer within "
             f"{hours} hours and escalate after {2 * hours} hours.\n"
             for i, (topic, team, hours) in enumerate(
                 (t, m, h) for h in (2, 4, 8, 24) for t, m in (
                     ("payments", "billing"), ("login", "identity"), ("shipping", "logistics"),
                     ("the app", "mobile"), ("search", "discovery"), ("taxes", "finance"),
                     ("stock", "warehouse"), ("accounts", "identity"), ("emails", "platform"),
                     ("pages", "web")))]
    return ("You triage support tickets. For each ticket, write one short line per field.\n"
            + "".join(rules[:num_rules]))


def make_program(sgl, prefix: str, num_branches: int, branch_tokens: int):
    @sgl.function
    def triage(s, ticket: str):
        s += prefix + "Ticket: " + ticket + "\n"
        forks = s.fork(num_branches)
        for f, aspect in zip(forks, ASPECTS, strict=False):
            f += f"{aspect}:" + sgl.gen("note", max_tokens=branch_tokens, stop="\n")
        forks.join()
        for aspect, note in zip(ASPECTS, s["note"], strict=False):
            s += f"{aspect}:{note}\n"
        s += "Summary:" + sgl.gen("summary", max_tokens=branch_tokens, stop="\n")

    return triage


def server_stats(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=60).json()["stats"]


def flush(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while requests.post(url + "/flush_cache", timeout=60).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the server would not flush its cache")
        time.sleep(0.5)


def run_config(sgl, url: str, args) -> dict:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    program = make_program(sgl, instructions(args.rules), args.branches, args.branch_tokens)
    inputs = [{"ticket": f"#{i}: {TICKETS[i % len(TICKETS)]}"} for i in range(args.programs)]
    # Warm-up: compile the shapes this workload uses, then start the timed run from cold.
    for st in program.run_batch(inputs[: args.warmup_programs], temperature=0):
        st.sync()
    flush(url)
    before = server_stats(url)
    t0 = time.perf_counter()
    states = program.run_batch(inputs, temperature=0)
    for st in states:
        st.sync()
    wall = time.perf_counter() - t0
    after = server_stats(url)
    errors = [str(st.error()) for st in states if st.error() is not None]
    delta = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens",
                                               "generated_tokens", "num_requests_finished")}
    return {"programs": len(states), "errors": len(errors), "first_error": errors[:1],
            "wall_s": round(wall, 2), "programs_per_s": round(len(states) / wall, 3),
            "requests": delta["num_requests_finished"],
            "prompt_tokens": delta["prompt_tokens"], "cached_tokens": delta["cached_tokens"],
            "generated_tokens": delta["generated_tokens"],
            "cache_hit_rate": round(delta["cached_tokens"] / delta["prompt_tokens"], 3)
            if delta["prompt_tokens"] else 0.0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--branches", type=int, default=4, choices=range(2, len(ASPECTS) + 1))
    p.add_argument("--branch-tokens", type=int, default=16)
    p.add_argument("--rules", type=int, default=12,
                   help="lines of shared instructions, ~27 tokens each")
    p.add_argument("--warmup-programs", type=int, default=4)
    p.add_argument("--server-flags", default="", help="extra flags for both servers")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    sgl = import_frontend()
    base = args.server_flags.split() + (["--model-path", args.model_path]
                                        if args.model_path else [])
    configs = {"cache": base, "nocache": base + ["--disable-radix-cache"]}
    results: dict = {"args": vars(args), "sglang_version": sgl.__version__, "runs": {}}
    for name, flags in configs.items():
        server = Server(flags, f"/tmp/sgl_tpu_bench_frontend_{name}.log")
        try:
            server.wait_ready()
            results["runs"][name] = run_config(sgl, server.url, args)
            print(json.dumps({name: results["runs"][name]}), flush=True)
        finally:
            server.stop()
    cache, nocache = results["runs"]["cache"], results["runs"]["nocache"]
    results["ratios"] = {"wall_nocache_over_cache": round(nocache["wall_s"] / cache["wall_s"], 3)}
    emit(results, args.output)


if __name__ == "__main__":
    main()
