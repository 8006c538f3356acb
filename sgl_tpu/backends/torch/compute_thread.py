"""The torch runner's compute thread on CPU under overlap scheduling: one thread runs every
torch call of the runner, from building the model to the last step.

    scheduler thread:  dispatch t+1 ─┐  process t, send outputs │ forward(EXTEND) ─┐ wait
    compute thread:       ... run t  └► run t+1 ...             │                  └► run it

Why one thread: libgomp gives each thread that starts OpenMP parallel regions a team of pool
threads of its own, kept until that thread exits. Overlapped steps run on a worker thread; if
the scheduler's thread also ran torch (building the model, warm-up, prefill, log-probs), the
process would hold two teams, more OpenMP threads than a 2-core machine has CPUs, and libgomp
then cuts every team's spin-wait to its throttled count, so each parallel region of every step
pays a futex wake (benchmarks/results/omp_teams_cpu.json; docs/overlap-scheduling.md). With
all compute on one thread the process has one team, as the serial loop has.

The thread allocates from glibc's main malloc arena (`M_ARENA_MAX` 1, set before it starts),
where the serial loop's step allocates too: a thread's own arena is a separate heap of mmap'd
segments that glibc trims and grows again around each step's temporaries.

Calls are taken in order; `call` waits for its result, `submit` returns a Future.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


class ComputeThread:
    """One worker thread; every call submitted to it runs there, in submission order."""

    def __init__(self, name: str = "torch-compute", one_arena: bool = True) -> None:
        if one_arena:
            one_malloc_arena()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.thread: threading.Thread = self._pool.submit(threading.current_thread).result()

    def on_it(self) -> bool:
        """Whether the caller is the compute thread itself."""
        return threading.current_thread() is self.thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the thread (directly when already on it) and return its result."""
        if self.on_it():
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def one_malloc_arena() -> bool:
    """Let every thread of this process allocate from glibc's main arena (no-op elsewhere:
    False when the C library has no `mallopt`)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_ARENA_MAX, 1) == 1
    if not ok:
        logger.warning("mallopt(M_ARENA_MAX, 1) failed; the compute thread keeps its own arena")
    return ok
