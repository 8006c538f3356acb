"""A model runner whose calls can be checked by hand, for the tensor-parallel runner channel
(sgl_tpu/parallel), and a script that runs a leader or a follower of it in its own process:

    python tests/parallel_helpers.py follower ENDPOINT RANK   # replays into a RecordingRunner
    python tests/parallel_helpers.py leader ENDPOINT WORLD    # waits for followers, then idles

and process-tree helpers (Linux /proc) for "nothing is left behind" checks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sgl_tpu.executor.step import ForwardMode, StepResult


@dataclass
class RecordingRunner:
    """Records every call; forward returns token id = rank * 1000 + (call number), and hidden
    states ("hidden", rank, call number) that the hand-back calls must receive."""

    rank: int = 0
    fail_on_forward: int = -1  # raise on this forward call (0-based), to test failures
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    backend: str = "fake"
    config: Any = None
    kv_bytes: int = 0

    def forward(self, mode, steps) -> StepResult:
        n = sum(1 for c in self.calls if c[0] == "forward")
        if n == self.fail_on_forward:
            raise RuntimeError(f"rank {self.rank} cannot run forward {n}")
        self.calls.append(("forward", ForwardMode(mode), [
            (list(map(int, s.token_ids)), s.prefix_len, list(map(int, s.pages)),
             s.sampling.temperature, s.sampling.top_k, s.seed, s.counts_row,
             None if s.bitmask is None else list(map(int, s.bitmask))) for s in steps]))
        k = len(steps)
        return StepResult(token_ids=np.full(k, self.rank * 1000 + n, np.int32),
                          logprobs=np.zeros(k, np.float32), top_ids=np.zeros((k, 1), np.int32),
                          top_logprobs=np.zeros((k, 1), np.float32),
                          hidden=("hidden", self.rank, n) if mode == ForwardMode.EXTEND
                          else None)

    def token_logprobs(self, hidden, target_ids):
        self.calls.append(("token_logprobs", hidden[2], list(map(int, target_ids))))
        z = np.zeros(len(target_ids), np.float32)
        return z, np.zeros((len(target_ids), 1), np.int32), z[:, None]

    def row_logits(self, hidden, rows):
        self.calls.append(("row_logits", hidden[2], list(map(int, rows))))
        return np.zeros((len(rows), 4), np.float32)

    def warmup(self) -> float:
        self.calls.append(("warmup",))
        return 0.0

    def num_compilations(self) -> int:
        return 0

    def compute_info(self) -> dict:
        return {"backend": "fake"}


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for c in children:
            out += [c, *descendants(c)]
    return out


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` for them to exit."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _main(argv: list[str]) -> None:
    role, endpoint, number = argv[0], argv[1], int(argv[2])
    if role == "follower":
        from sgl_tpu.parallel.follower import run_follower

        print(run_follower(RecordingRunner(rank=number), endpoint, rank=number,
                           connect_timeout_s=30), flush=True)
    else:
        from sgl_tpu.parallel.leader import FollowerGroup

        FollowerGroup(endpoint, number).wait_for_followers(30)
        print("followers connected", flush=True)
        time.sleep(600)  # until killed


if __name__ == "__main__":
    _main(sys.argv[1:])
