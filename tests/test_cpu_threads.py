"""The executor's CPU threads: their count, fixed at start by `--torch-threads` or (0) every CPU
the process may use, and how they wait between parallel regions (`--omp-spin-count`)."""

from __future__ import annotations

import os
import subprocess
import sys

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
    from sgl_tpu.backends.torch.device import set_cpu_threads

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_cpu_threads(0) == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


def test_omp_spin_count_flag_and_bad_values():
    assert parse_args([]).omp_spin_count is None
    assert parse_args(["--omp-spin-count", "0"]).omp_spin_count == 0
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="omp_spin_count"):
            ServerArgs(omp_spin_count=bad)


def _fresh_interpreter(code: str, **env: str) -> str:
    """Run `code` in a new Python (torch not loaded) with the OpenMP variables of `env` only."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_omp_wait_default_environment_and_flag():
    show = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    # the executor package sets the default before any runner loads torch
    assert _fresh_interpreter("import sgl_tpu.executor; " + show) == "1000 None"
    # a setting of the environment is kept unless the flag says otherwise
    assert _fresh_interpreter("import sgl_tpu.executor; " + show,
                              OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"
    assert _fresh_interpreter("import sgl_tpu.executor; " + show,
                              GOMP_SPINCOUNT="50") == "50 None"
    flagged = ("from sgl_tpu.executor import omp_wait; print(omp_wait.configure(0)); "
               "import torch; print(omp_wait.configure(7))")
    applied, refused = _fresh_interpreter(flagged, OMP_WAIT_POLICY="PASSIVE").splitlines()
    assert applied == "GOMP_SPINCOUNT=0 OMP_WAIT_POLICY=PASSIVE"
    assert refused.startswith("GOMP_SPINCOUNT=0 OMP_WAIT_POLICY=PASSIVE; GOMP_SPINCOUNT=7 "
                              "not applied: torch was loaded first"), refused
    # torch loaded before the executor package: the default is not claimed either
    late = _fresh_interpreter("import torch, sgl_tpu.executor; from sgl_tpu.executor import "
                              "omp_wait; print(omp_wait.configure())")
    assert late == "libgomp defaults; GOMP_SPINCOUNT=1000 not applied: torch was loaded first " \
                   "(set it in the environment instead)", late
