"""The tier crossover's arithmetic (mem_cache/load_cost.py): lines fitted to timed samples, and
the least prefix length whose load beats its compute; the server's use of it is tested in
tests/test_kv_prefetch.py."""

from __future__ import annotations

import math

import pytest

from sgl_tpu.mem_cache.load_cost import LoadCost


def _feed(cost: LoadCost, kind: str, fixed_s: float, per_token_s: float) -> None:
    for n in (100, 400, 1600, 800):
        getattr(cost, f"observe_{kind}")(n, fixed_s + n * per_token_s)


def test_loads_below_the_crossover_are_computed():
    cost = LoadCost()
    assert cost.worth_loading(16, 0) and cost.crossover_tokens("host") is None  # unknown: load
    _feed(cost, "compute", 0.01, 100e-6)
    _feed(cost, "host_load", 1e-3, 10e-6)
    crossover = cost.crossover_tokens("host")
    assert crossover == math.floor(1e-3 / 90e-6) + 1 == 12
    assert not cost.worth_loading(11, 0) and cost.worth_loading(12, 0)
    assert cost.crossover_tokens("disk") is None  # no disk read timed yet
    _feed(cost, "disk_read", 9.02e-3, 40e-6)
    assert cost.crossover_tokens("disk") == math.floor(10.02e-3 / 50e-6) + 1 == 201
    assert not cost.worth_loading(150, 50) and cost.worth_loading(150, 51)
    info = cost.info()
    assert info["host_crossover_tokens"] == 12 and info["disk_crossover_tokens"] == 201
    assert info["compute"]["s_per_token"] == pytest.approx(100e-6)


def test_when_loading_is_slower_per_token_nothing_loads():
    cost = LoadCost()
    _feed(cost, "compute", 0.0, 10e-6)
    _feed(cost, "host_load", 0.0, 20e-6)
    assert cost.crossover_tokens("host") == math.inf
    assert not cost.worth_loading(100_000, 0)
    assert cost.info()["host_never_load"] and cost.info()["host_crossover_tokens"] is None


def test_a_fixed_crossover_overrides_the_fit():
    cost = LoadCost(min_load_tokens=64)
    _feed(cost, "compute", 0.0, 10e-6)
    _feed(cost, "host_load", 0.0, 20e-6)
    assert not cost.worth_loading(48, 0) and cost.worth_loading(48, 16)
    assert cost.info()["source"] == "flag" and cost.crossover_tokens("disk") == 64
    with pytest.raises(ValueError, match="min_load_tokens"):
        LoadCost(min_load_tokens=-1)
