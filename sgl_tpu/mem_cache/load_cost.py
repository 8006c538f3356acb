"""When loading a prefix from a tier beats computing it: the tier crossover.

    load_s(host, n)  = fixed + n * per_token       a line fitted to the host-to-pool loads seen
    load_s(disk, n)  = load_s(host, n) + n * read   each disk page is read, then loaded from host
    compute_s(n)     = n * per_token               the slope of a line fitted to the EXTEND steps
    crossover(tier)  = the least n with load_s(tier, n) < compute_s(n): a prefix part of fewer
                       tokens in that tier is computed, not loaded (or prefetched)

Lines are fitted to decayed sums (recent samples weigh more: the host's load changes), by least
squares; one whose samples all have about one size is a line through the origin. Until both
lines have `MIN_SAMPLES` samples, or with a fixed `min_load_tokens`, nothing is estimated.
Everything here runs on the scheduler thread, but `observe_disk_read` (the reader thread's
times, handed over by disk_loads.py on the scheduler thread).
"""

from __future__ import annotations

import math
from typing import Any

MIN_SAMPLES = 3
DECAY = 0.95  # the weight of a sample after each newer one


class LineFit:
    """seconds = fixed_s + per_token_s * tokens, fitted to decayed samples."""

    def __init__(self) -> None:
        self.num_samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        self.num_samples += 1
        d = DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    @property
    def known(self) -> bool:
        return self.num_samples >= MIN_SAMPLES

    def line(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), both >= 0."""
        var = self._xx - self._x * self._x / self._w
        if var > 0.01 * self._xx:  # sizes differ enough to tell a slope from a constant
            slope = (self._xy - self._x * self._y / self._w) / var
            fixed = (self._y - slope * self._x) / self._w
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self._y / self._x if self._x else 0.0


class LoadCost:
    """Per tier, whether loading a prefix part beats computing it (see the module docstring).
    `min_load_tokens`: a fixed crossover for both tiers instead of the fitted ones."""

    def __init__(self, min_load_tokens: int | None = None) -> None:
        if min_load_tokens is not None and min_load_tokens < 0:
            raise ValueError(f"min_load_tokens must be >= 0, got {min_load_tokens}")
        self.min_load_tokens = min_load_tokens
        self.host_load = LineFit()  # host tier -> pool, per load chunk
        self.disk_read = LineFit()  # disk -> host tier, per chunk read
        self.compute = LineFit()  # EXTEND steps: tokens computed, seconds

    def observe_compute(self, tokens: int, seconds: float) -> None:
        self.compute.add(tokens, seconds)

    def observe_host_load(self, tokens: int, seconds: float) -> None:
        self.host_load.add(tokens, seconds)

    def observe_disk_read(self, tokens: int, seconds: float) -> None:
        self.disk_read.add(tokens, seconds)

    def worth_loading(self, host_tokens: int, disk_tokens: int) -> bool:
        """Whether loading `host_tokens` from the host tier and `disk_tokens` from disk (those
        after them) into the pool is faster than computing them (True while unknown)."""
        total = host_tokens + disk_tokens
        if total <= 0:
            return False
        if self.min_load_tokens is not None:
            return total >= self.min_load_tokens
        crossover = self.crossover_tokens("disk" if disk_tokens else "host")
        return crossover is None or total >= crossover

    def crossover_tokens(self, tier: str) -> int | float | None:
        """The least prefix part (tokens) in `tier` worth loading: math.inf when computing
        always wins, None while unknown."""
        if self.min_load_tokens is not None:
            return self.min_load_tokens
        if not (self.compute.known and self.host_load.known):
            return None
        fixed, per_token = self.host_load.line()
        if tier == "disk":
            if not self.disk_read.known:
                return None
            read_fixed, read_per_token = self.disk_read.line()
            fixed, per_token = fixed + read_fixed, per_token + read_per_token
        compute_per_token = self.compute.line()[1]
        if compute_per_token <= per_token:
            return math.inf
        return math.floor(fixed / (compute_per_token - per_token)) + 1

    def info(self) -> dict[str, Any]:
        """`/server_info` "tiers" "load_cost": the fitted lines and the crossover per tier
        (null: not known yet, or computing always wins: `never_load`)."""
        out: dict[str, Any] = {"source": "flag" if self.min_load_tokens is not None else "fit"}
        for name, fit in (("compute", self.compute), ("host_load", self.host_load),
                          ("disk_read", self.disk_read)):
            fixed, per_token = fit.line() if fit.num_samples else (0.0, 0.0)
            out[name] = {"samples": fit.num_samples, "fixed_s": fixed, "s_per_token": per_token}
        for tier in ("host", "disk"):
            crossover = self.crossover_tokens(tier)
            out[f"{tier}_crossover_tokens"] = None if crossover in (None, math.inf) else crossover
            out[f"{tier}_never_load"] = crossover == math.inf
        return out
