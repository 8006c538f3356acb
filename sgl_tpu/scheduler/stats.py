"""Scheduler counters (read by `/metrics`, `/server_info` and the periodic log line), the
memory report of the KV pool and radix tree, and the load report a router polls (`/get_load`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from sgl_tpu.executor import omp_wait
from sgl_tpu.scheduler.kv_manager import KVManager

if TYPE_CHECKING:
    from sgl_tpu.scheduler.scheduler import Scheduler

logger = logging.getLogger("sgl_tpu.scheduler.scheduler")


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_requests_finished: int = 0
    num_retractions: int = 0
    num_extend_steps: int = 0
    num_decode_steps: int = 0
    # Where the scheduler's time goes: seconds from each step's dispatch until its results
    # were on the host (an overlapped DECODE also covers the host work done meanwhile), and
    # the tokens the EXTEND steps computed (prompt tokens not served from the cache, chunks,
    # re-extends after jump-forward).
    extend_tokens: int = 0
    extend_seconds: float = 0.0
    decode_seconds: float = 0.0
    num_overlapped_steps: int = 0  # decode steps dispatched before the last one's tokens came
    jump_forward_tokens: int = 0  # tokens appended by jump-forward (no decode step)
    num_requests_failed: int = 0  # ended by an exception while handling them (faults.py)
    # Speculative decoding (speculative.py): requests' verifies, their draft tokens, and the
    # draft tokens kept (acceptance rate = accepted / draft).
    spec_verify_reqs: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    last_log_time: float = field(default_factory=time.monotonic)
    last_log_tokens: int = 0

    def count_extend(self, tokens: int, seconds: float) -> None:
        self.num_extend_steps += 1
        self.extend_tokens += tokens
        self.extend_seconds += seconds

    def count_decode(self, seconds: float) -> None:
        self.num_decode_steps += 1
        self.decode_seconds += seconds

    def maybe_log(self, num_running: int, num_waiting: int, free_pages: int,
                  interval_s: float = 10.0) -> None:
        """One line of load, cache hit rate and throughput every `interval_s` seconds."""
        now = time.monotonic()
        if now - self.last_log_time < interval_s:
            return
        tokens = self.generated_tokens - self.last_log_tokens
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        logger.info(
            "running: %d, waiting: %d, free pages: %d, cache hit rate: %.1f%%, "
            "gen throughput: %.1f tok/s", num_running, num_waiting, free_pages, 100 * hit,
            tokens / (now - self.last_log_time))
        self.last_log_time, self.last_log_tokens = now, self.generated_tokens


def memory_info(kv: KVManager) -> dict[str, Any]:
    alloc, tree = kv.allocator, kv.tree
    return {
        "num_pages_total": alloc.num_usable_pages,
        "num_pages_free": alloc.num_free_pages,
        "num_pages_tree": tree.num_pages_held(),
        "num_pages_requests": alloc.num_usable_pages - alloc.num_free_pages
                              - tree.num_pages_held(),
        "tree_evictable_tokens": tree.evictable_size(),
        "tree_protected_tokens": tree.protected_size(),
        "tree_retained_tokens": tree.retained_size(),
        "evicted_tokens": tree.num_evicted_tokens,
        "evicted_retained_tokens": tree.num_evicted_retained_tokens,
        "page_size": kv.page_size,
        "max_total_tokens": kv.capacity_tokens,
    }


def server_info(scheduler: Scheduler) -> dict[str, Any]:
    """What `/server_info` reports from the scheduler (the server process and the in-process
    Engine both use this): memory, queues, counters, and when idle the KV integrity check."""
    stats = {k: v for k, v in asdict(scheduler.stats).items() if not k.startswith("last_log")}
    data: dict[str, Any] = {
        # the KV pool: its element type and bytes (a bfloat16 pool holds twice a float32
        # pool's tokens in the same bytes)
        "memory": {**memory_info(scheduler.kv), "kv_cache_dtype": scheduler.config.kv_cache_dtype,
                   "kv_bytes": scheduler.runner.kv_bytes},
        "num_running_reqs": scheduler.num_running,
        "num_waiting_reqs": len(scheduler.waiting),
        "num_compilations": scheduler.runner.num_compilations(),
        "device_decode_state": scheduler.config.device_decode_state,
        "scheduler_pid": os.getpid(),
        "omp_wait": omp_wait.settings(),
        # the arithmetic the runner runs (CPU ISA, oneDNN's kernels, AMX, compiled kernels)
        "compute": scheduler.runner.compute_info(),
        "stats": stats,
    }
    if not scheduler.has_work:
        try:
            scheduler.check_integrity()
            data["integrity"] = "ok"
        except RuntimeError as e:
            data["integrity"] = str(e)
    return data


def load_info(scheduler: Scheduler) -> dict[str, Any]:
    """The load a router balances on (`/get_load`, SGLang's fields): requests running and
    waiting, tokens whose K/V the running requests hold, prompt tokens still to compute. Cheap:
    no integrity check, one pass over the queues."""
    chunked = [] if scheduler.chunked_req is None else [scheduler.chunked_req]
    running = [*scheduler.running, *scheduler.jump_forward_reqs, *chunked]
    waiting = list(scheduler.waiting)
    return {
        "num_reqs": len(running) + len(waiting),
        "num_waiting_reqs": len(waiting),
        "num_tokens": sum(r.kv_len for r in running),
        "num_pending_tokens": sum(max(r.prompt_len - r.kv_len, 0) for r in waiting + chunked),
    }
