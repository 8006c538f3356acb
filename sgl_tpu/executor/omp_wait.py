"""How the torch CPU executor's OpenMP threads wait between parallel regions.

A CPU decode step runs a few hundred short parallel regions (the compiled GEMM and attention
kernels of every layer), with Python between them. After a region, libgomp's threads spin
`GOMP_SPINCOUNT` iterations for the next one, then sleep on a futex; waking a sleeping thread
costs ~10 microseconds per region. `OMP_WAIT_POLICY=PASSIVE` (spin count 0) therefore made a
batch-1 step ~1.2x slower on an idle machine, while long spinning (`ACTIVE`, or libgomp's own
default of ~3 ms) made steps many times slower next to other busy processes. A short spin is
the default; next to a busy neighbour it costs up to ~1.4x (docs/backends.md, "OpenMP waiting").

`--omp-spin-count N` sets `GOMP_SPINCOUNT` for the scheduler process (0 sleeps at once);
without it the environment's `GOMP_SPINCOUNT` / `OMP_WAIT_POLICY` apply when set, else
`DEFAULT_SPIN_COUNT`. libgomp reads them once, when torch loads: `configure` runs at
`sgl_tpu.executor`'s import (the default, for every in-process runner) and again in
`build_scheduler` with the flag, both before any runner imports torch; after that it only
reports that the value could not be applied.
"""

from __future__ import annotations

import os
import sys

DEFAULT_SPIN_COUNT = 1000  # ~10 us of spinning: covers the gaps within a step, not between steps
_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
# what the environment said before this module set anything
_FROM_ENV = {name: os.environ[name] for name in _VARS if os.environ.get(name)}
_set_before_torch = False  # whether `configure` set GOMP_SPINCOUNT before torch loaded


def configure(spin_count: int | None = None) -> str:
    """Set `GOMP_SPINCOUNT` for this process (`spin_count`, or None: the environment's
    settings, else `DEFAULT_SPIN_COUNT`) while torch is not loaded yet. Returns what applies,
    for the start-up log."""
    global _set_before_torch
    if spin_count is None and _set_before_torch:  # an earlier call (maybe the flag's) stands
        return describe()
    if spin_count is None:
        # (a child process inherits its parent's default: not the user's setting)
        if _FROM_ENV and _FROM_ENV != {"GOMP_SPINCOUNT": str(DEFAULT_SPIN_COUNT)}:
            return describe() + " (from the environment)"
        spin_count = DEFAULT_SPIN_COUNT
    want = str(spin_count)
    if "torch" in sys.modules:  # libgomp has read the environment already
        had = os.environ.get("GOMP_SPINCOUNT") if _set_before_torch \
            else _FROM_ENV.get("GOMP_SPINCOUNT")
        if had == want:
            return describe()
        return (describe() + f"; GOMP_SPINCOUNT={want} not applied: torch was loaded first "
                "(set it in the environment instead)")
    os.environ["GOMP_SPINCOUNT"] = want
    _set_before_torch = True
    return describe()


def describe() -> str:
    """The OpenMP wait settings of this process's environment, e.g. 'GOMP_SPINCOUNT=1000'."""
    return " ".join(f"{name}={os.environ[name]}" for name in _VARS if os.environ.get(name)) \
        or "libgomp defaults"


def settings() -> dict[str, str | None]:
    """The same as a dict (`/server_info`'s `omp_wait`)."""
    return {name: os.environ.get(name) for name in _VARS}
