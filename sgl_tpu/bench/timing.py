"""Timing loops shared by the micro-benchmarks: every function runs once untimed first (compile
and warm), then is timed with `time.perf_counter`. `sync` waits for an asynchronous result (pass
`jax.block_until_ready` for JAX calls that are not synchronised inside `fn`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def _identity(result: Any) -> Any:
    return result


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int,
                sync: Callable[[Any], Any] = _identity,
                clock: Callable[[], float] = time.perf_counter,
                before: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds of each of `fns` over `repeats` rounds, one call of each per round, the order
    rotated by one each round (ABC BCA CAB ABC..., so a load change on a shared machine hits
    every function alike, and every function takes every place equally often and runs after
    each of the others, not always after the same one). `clock`: wall time by default;
    `time.thread_time` counts only this thread's CPU time (a loaded machine).
    `before` runs untimed ahead of every call (e.g. evicting the caches, so that a function
    does not find its inputs warm from the previous one)."""
    for fn in fns.values():
        sync(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for rep in range(repeats):
        shift = rep % len(order)
        for name, fn in order[shift:] + order[:shift]:
            if before is not None:
                before()
            t0 = clock()
            sync(fn())
            times[name].append(clock() - t0)
    return times


def interleaved_median(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each of `fns` under `interleaved`."""
    return {name: statistics.median(t) for name, t in interleaved(fns, repeats).items()}


def best(fn: Callable[[], Any], repeats: int, sync: Callable[[Any], Any] = _identity) -> float:
    """The fastest of `repeats` timed calls, in seconds."""
    return min(interleaved({"fn": fn}, repeats, sync)["fn"])
