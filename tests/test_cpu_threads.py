"""The executor's CPU thread count: fixed at start, by `--torch-threads` or (0) every CPU the
process may use."""

from __future__ import annotations

import os

import pytest

from sgl_tpu.cli import parse_args
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import runner_config


def test_flag_reaches_the_runner_config():
    args = parse_args(["--torch-threads", "3"])
    assert args.torch_threads == 3
    assert runner_config(args, 2048).cpu_threads == 3
    assert runner_config(ServerArgs(), 2048).cpu_threads == 0  # every CPU


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match="torch_threads"):
        ServerArgs(torch_threads=bad)


def test_set_cpu_threads_sets_torch():
    torch = pytest.importorskip("torch")
    from sgl_tpu.executor.torch.device import set_cpu_threads

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_cpu_threads(0) == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
