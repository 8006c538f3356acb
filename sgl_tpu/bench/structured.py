"""Structured-output benchmark through HTTP: the cost of grammar masks per token, and what
jump-forward saves on mostly-forced JSON, in one invocation, reported as ratios.

    python -m sgl_tpu.bench.structured [--model-path PATH] [--overhead-batches 1,16]
        [--overhead-tokens 64] [--json-batches 1,8] [--json-rounds 2] [--repeats 3]
        [--output FILE]

Two servers run side by side (the `Server` class of `sgl_tpu.bench.http_load`): `jf` with
default flags (llguidance, jump-forward on) and `nojf` with `--disable-jump-forward`; their
timed runs alternate, so load from other processes hits both alike.

(a) overhead, on `nojf` (masks only): the same prompts decoded greedily without a constraint
    (`ignore_eos`) and with the permissive regex `[^\\x00]*\\x01` (every token but those
    holding a NUL byte; EOS only after a \\x01 the model never picks, so there are no forced
    tokens and it runs to `max_new_tokens` like the unconstrained run). Every request yields
    exactly `--overhead-tokens` tokens, so output tok/s compare like for like; the mask's cost
    per decode step is reported in ms.
(b) jump-forward, on `jf` and `nojf`: greedy JSON for a schema whose keys are fixed and whose
    values are enums, booleans and small integers, so most of the text is forced. Reports
    output chars/s, requests/s, decode and extend steps, the jf/nojf ratios, and whether the
    outputs were identical (they must be: jump-forward is exact).

Each workload is run once untimed first (prompts then come from the radix cache in every timed
run alike), so no timed run compiles a new shape; then `--repeats` timed runs (the two arms,
or the two servers, alternating), of which the median wall time is reported. A batch
of B is one `/generate` call with B prompts. Prints one JSON object (also written to --output).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from sgl_tpu.bench.http_load import Server
from sgl_tpu.bench.report import emit

PERMISSIVE_REGEX = r"[^\x00]*\x01"
TOPICS = ["a lighthouse keeper", "the history of tea", "a robot learning to paint",
          "volcanoes", "a city under the sea", "the first winter on Mars", "a lost dog",
          "bread baking", "an old clock", "migrating birds", "a chess tournament",
          "the northern lights", "a desert caravan", "a jazz musician", "glaciers",
          "a library at night"]

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "priority": {"enum": ["low", "normal", "high"]},
        "express_shipping": {"type": "boolean"},
        "warehouse_location": {"enum": ["north", "south", "east", "west"]},
        "currency": {"enum": ["USD", "EUR"]},
        "number_of_items": {"type": "integer", "minimum": 1, "maximum": 9},
        "gift_wrapped": {"type": "boolean"},
        "shipping_carrier": {"enum": ["UPS", "FedEx", "DHL"]},
        "customer_tier": {"enum": ["bronze", "silver", "gold", "platinum"]},
        "requires_signature": {"type": "boolean"},
    },
    "additionalProperties": False,
}
ORDER_SCHEMA["required"] = list(ORDER_SCHEMA["properties"])


def story_prompt(i: int) -> str:
    return f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}.\n\n"


def order_prompt(i: int) -> str:
    return (f"Order #{1000 + 37 * i} for customer {i}: return its record as JSON with the "
            f"fields {', '.join(ORDER_SCHEMA['properties'])}.\n")


def generate(url: str, prompts: list[str], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    import requests

    r = requests.post(url + "/generate", json={"text": prompts, "sampling_params": sampling},
                      timeout=3600)
    r.raise_for_status()
    return r.json()


def stats(url: str) -> dict[str, int]:
    import requests

    return requests.get(url + "/server_info", timeout=60).json()["stats"]


def timed(url: str, batches: list[list[str]], sampling: dict[str, Any]) -> dict[str, Any]:
    """Run the batches one after another; totals over all of them."""
    before = stats(url)
    t0 = time.perf_counter()
    outs = [o for prompts in batches for o in generate(url, prompts, sampling)]
    wall = time.perf_counter() - t0
    after = stats(url)
    return {"wall_s": wall, "outs": outs,
            "decode_steps": after["num_decode_steps"] - before["num_decode_steps"],
            "extend_steps": after["num_extend_steps"] - before["num_extend_steps"]}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    r = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {**r, "walls_s": [round(x["wall_s"], 3) for x in runs]}


def overhead_run(url: str, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    prompts = [story_prompt(i) for i in range(batch)]
    base = {"temperature": 0.0, "max_new_tokens": tokens}
    arms = {"unconstrained": {**base, "ignore_eos": True},
            "constrained": {**base, "regex": PERMISSIVE_REGEX}}
    result: dict[str, Any] = {}
    for sampling in arms.values():  # compile / warm: the timed runs reuse these shapes
        generate(url, prompts, sampling)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, sampling in arms.items():
            runs[name].append(timed(url, [prompts], sampling))
    for name in arms:
        r = median_run(runs[name])
        n = sum(o["meta_info"]["completion_tokens"] for o in r["outs"])
        lengths = {o["meta_info"]["completion_tokens"] for o in r["outs"]}
        result[name] = {"output_tokens": n, "tokens_per_request": sorted(lengths),
                        "wall_s": round(r["wall_s"], 3), "walls_s": r["walls_s"],
                        "output_tok_per_s": round(n / r["wall_s"], 2),
                        "ms_per_decode_step": round(1000 * r["wall_s"] / max(tokens, 1), 2)}
    u, c = result["unconstrained"], result["constrained"]
    result["constrained_over_unconstrained_tok_per_s"] = round(
        c["output_tok_per_s"] / u["output_tok_per_s"], 3)
    result["mask_overhead_ms_per_step"] = round(
        c["ms_per_decode_step"] - u["ms_per_decode_step"], 2)
    return result


def json_summary(r: dict[str, Any]) -> dict[str, Any]:
    outs = r["outs"]
    chars = sum(len(o["text"]) for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    valid = 0
    for o in outs:
        try:
            value = json.loads(o["text"])
            valid += isinstance(value, dict) and set(value) == set(ORDER_SCHEMA["properties"])
        except ValueError:
            pass
    return {"requests": len(outs), "output_chars": chars, "output_tokens": tokens,
            "valid_json": valid, "wall_s": round(r["wall_s"], 3), "walls_s": r["walls_s"],
            "chars_per_s": round(chars / r["wall_s"], 1),
            "req_per_s": round(len(outs) / r["wall_s"], 3),
            "output_tok_per_s": round(tokens / r["wall_s"], 2),
            "decode_steps": r["decode_steps"], "extend_steps": r["extend_steps"]}


def json_run(urls: dict[str, str], batch: int, rounds: int, repeats: int) -> dict[str, Any]:
    """The same greedy JSON batches on each server, the servers' timed runs interleaved."""
    sampling = {"temperature": 0.0, "max_new_tokens": 256,
                "json_schema": json.dumps(ORDER_SCHEMA)}
    batches = [[order_prompt(k * batch + i) for i in range(batch)] for k in range(rounds)]
    for url in urls.values():  # warm
        for prompts in batches:
            generate(url, prompts, sampling)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    for _ in range(repeats):
        for name, url in urls.items():
            runs[name].append(timed(url, batches, sampling))
    medians = {name: median_run(rs) for name, rs in runs.items()}
    result: dict[str, Any] = {name: json_summary(r) for name, r in medians.items()}
    a, n = result["jf"], result["nojf"]
    result["jf_over_nojf"] = {
        "chars_per_s": round(a["chars_per_s"] / n["chars_per_s"], 3),
        "req_per_s": round(a["req_per_s"] / n["req_per_s"], 3),
        "decode_steps": round(a["decode_steps"] / max(n["decode_steps"], 1), 3),
        "identical_outputs": all(
            [(o["output_ids"], o["text"]) for o in r_jf["outs"]]
            == [(o["output_ids"], o["text"]) for o in r_nojf["outs"]]
            for r_jf, r_nojf in zip(runs["jf"], runs["nojf"], strict=True)),
    }
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--overhead-batches", default="1,16")
    p.add_argument("--overhead-tokens", type=int, default=64)
    p.add_argument("--json-batches", default="1,8")
    p.add_argument("--json-rounds", type=int, default=2, help="batches per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    p.add_argument("--server-flags", default="", help="extra flags for both servers")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    base = args.server_flags.split() + (["--model-path", args.model_path]
                                        if args.model_path else [])
    overhead_batches = [int(b) for b in args.overhead_batches.split(",") if b]
    json_batches = [int(b) for b in args.json_batches.split(",") if b]
    results: dict[str, Any] = {"args": vars(args), "overhead": {}, "json": {}}
    configs = {"jf": base, "nojf": base + ["--disable-jump-forward"]}
    logs = Path(tempfile.mkdtemp(prefix="sgl_tpu_bench_structured_"))
    servers = {name: Server(flags, str(logs / f"{name}.log")) for name, flags in configs.items()}
    try:
        for server in servers.values():
            server.wait_ready()
        urls = {name: server.url for name, server in servers.items()}
        for b in overhead_batches:
            r = overhead_run(urls["nojf"], b, args.overhead_tokens, args.repeats)
            results["overhead"][f"batch{b}"] = r
            print(json.dumps({f"overhead/batch{b}": r}), flush=True)
        for b in json_batches:
            r = json_run(urls, b, args.json_rounds, args.repeats)
            results["json"][f"batch{b}"] = r
            print(json.dumps({f"json/batch{b}": r}), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    emit(results, args.output)


if __name__ == "__main__":
    main()
