"""The torch runner's compute thread (backends/torch/compute_thread.py): calls run on one
thread in submission order, a call made from the thread itself runs in place, errors reach the
caller, `shutdown` ends the thread, and so does a runner that fails to build. Which server
settings get one: registry tests below; that every torch call of such a runner runs on it:
tests/test_engine.py ("torch-overlap")."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from sgl_tpu.backends.torch.compute_thread import ComputeThread, one_malloc_arena
from sgl_tpu.cli import parse_args
from sgl_tpu.executor.registry import runner_config


def test_calls_run_on_one_thread_in_order():
    ct = ComputeThread("test-compute")
    try:
        seen = []

        def slow(i: int) -> int:
            time.sleep(0.01 * (3 - i))  # later calls are quicker, yet run after
            seen.append((i, threading.current_thread()))
            return i

        futures = [ct.submit(slow, i) for i in range(3)]
        assert ct.call(lambda: "last") == "last"  # queued behind the three
        assert [f.result() for f in futures] == [0, 1, 2]
        assert [i for i, _ in seen] == [0, 1, 2]
        assert {t for _, t in seen} == {ct.thread} and ct.thread is not threading.main_thread()
        assert not ct.on_it()
        # a call from the thread itself runs in place (no deadlock waiting on itself)
        assert ct.call(lambda: ct.call(lambda: ct.on_it())) is True
    finally:
        ct.shutdown()
    assert not ct.thread.is_alive()


def test_a_runner_that_fails_to_build_ends_its_compute_thread(monkeypatch):
    from sgl_tpu.backends.torch.runner import TorchModelRunner

    def fail(self, *args):
        raise ValueError("bad weights")

    def compute_threads() -> int:
        return sum(t.name.startswith("torch-compute") for t in threading.enumerate())

    monkeypatch.setattr(TorchModelRunner, "_build", fail)
    cfg = runner_config(parse_args(["--backend", "torch", "--overlap-schedule", "on"]), 2048)
    before = compute_threads()
    with pytest.raises(ValueError, match="bad weights"):
        TorchModelRunner(None, {}, cfg)
    assert compute_threads() == before


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    ct = ComputeThread("test-compute")
    try:
        with pytest.raises(ZeroDivisionError):
            ct.call(lambda: 1 / 0)
        assert ct.call(lambda: 2) == 2
    finally:
        ct.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_one_malloc_arena_on_glibc():
    assert one_malloc_arena() is True


@pytest.mark.parametrize("flags, expected", [
    (["--backend", "torch", "--overlap-schedule", "on"], True),
    (["--backend", "torch"], False),  # auto: overlap is off on CPU
    (["--backend", "torch", "--overlap-schedule", "on", "--disable-overlap-schedule"], False),
    (["--backend", "torch", "--overlap-schedule", "on", "--tp-size", "2"], False),
    (["--backend", "jax", "--overlap-schedule", "on"], False),
])
def test_a_cpu_torch_runner_gets_a_compute_thread_when_its_steps_overlap(flags, expected):
    cfg = runner_config(parse_args(flags), 2048)
    assert cfg.cpu_compute_thread is expected
