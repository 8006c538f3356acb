"""Waiting-queue policy micro-benchmark: the cost of ordering a long queue of agent requests.

    python -m sgl_tpu.bench.policy [--waiting 56] [--agents 8] [--shared 1300] [--own 300,700]
        [--steps 200] [--repeats 5]

Builds a radix tree holding the agents' histories (a shared system prompt plus each agent's own
turns, as in the agent harness) and a queue of `--waiting` requests that each extend one of them
by a new turn. Times one `lpm` ordering per scheduler step, for steps where the tree did not
change and for steps after which one agent's new turn was cached (a leaf added, so every request
resumes its match), against `rematch`: every request matched afresh with `match_prefix` (the
policy before prefix peeks). Alternates the variants (ABAB...), prints median microseconds per
step and the rematch/lpm ratios as one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sgl_tpu.bench.report import emit

PAGE_SIZE = 16


def _rematch(waiting, tree) -> list:
    prefix = {id(r): tree.match_prefix(r.fill_ids[: r.max_prefix_len]).prefix_len
              for r in waiting}
    return sorted(waiting, key=lambda r: (-prefix[id(r)], r.arrival))


def _build(args: argparse.Namespace):
    from sgl_tpu.mem_cache import PageAllocator, RadixCache
    from sgl_tpu.sampling_params import SamplingParams
    from sgl_tpu.scheduler.req import Req

    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.own.split(","))
    shared = rng.integers(0, 49152, args.shared).tolist()
    histories = [shared + rng.integers(0, 49152, int(rng.integers(lo, hi))).tolist()
                 for _ in range(args.agents)]
    total = sum(len(h) for h in histories) + args.steps * 64
    allocator = PageAllocator(num_pages=total // PAGE_SIZE + 64, page_size=PAGE_SIZE)
    tree = RadixCache(allocator)

    def cache(key: list[int]) -> None:
        match = tree.match_prefix(key)
        n = len(key) - match.prefix_len
        pages = allocator.alloc(-(-n // PAGE_SIZE))
        slots = np.concatenate([match.slots, allocator.pages_to_slots(pages, n)])
        aligned = len(key) - len(key) % PAGE_SIZE
        tree.insert(key, slots)
        allocator.free(allocator.slots_to_pages(slots[aligned:]))

    for h in histories:
        cache(h)
    waiting = [Req(rid=str(i), origin_input_ids=histories[i % args.agents]
                   + rng.integers(0, 49152, 40).tolist(), sampling=SamplingParams(), seed=0)
               for i in range(args.waiting)]
    grow = [histories[i % args.agents] + rng.integers(0, 49152, 48).tolist()
            for i in range(args.steps)]
    return tree, waiting, cache, grow


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.scheduler.policy import lpm

    variants = {"rematch": _rematch, "lpm": lpm}
    samples: dict[str, list[float]] = {f"{v}_{c}": [] for v in variants for c in
                                       ("unchanged", "changed")}
    for _ in range(args.repeats):
        for name, fn in variants.items():  # a fresh tree and queue per variant and repeat
            tree, waiting, cache, grow = _build(args)
            fn(waiting, tree)  # the first look at the queue walks every request
            for i in range(args.steps):
                t0 = time.perf_counter()
                order = fn(waiting, tree)
                samples[f"{name}_unchanged"].append(time.perf_counter() - t0)
                cache(grow[i])
                t0 = time.perf_counter()
                changed = fn(waiting, tree)
                samples[f"{name}_changed"].append(time.perf_counter() - t0)
                assert order and len(changed) == len(waiting)
    us = {k: round(1e6 * statistics.median(v), 1) for k, v in samples.items()}
    return {"waiting": args.waiting, "agents": args.agents, "shared_tokens": args.shared,
            "own_tokens": args.own, "page_size": PAGE_SIZE, "steps": args.steps,
            "repeats": args.repeats, "median_us_per_step": us,
            "rematch_over_lpm_unchanged": round(us["rematch_unchanged"] / us["lpm_unchanged"], 1),
            "rematch_over_lpm_changed": round(us["rematch_changed"] / us["lpm_changed"], 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waiting", type=int, default=56)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--shared", type=int, default=1300)
    p.add_argument("--own", default="300,700")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
