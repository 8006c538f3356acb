"""The scheduler's counters (read by `/metrics`, `/server_info` and the periodic log line)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("sgl_tpu.scheduler.scheduler")


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_requests_finished: int = 0
    num_retractions: int = 0
    num_priority_preemptions: int = 0  # retractions for a higher-priority request (priority.py)
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
