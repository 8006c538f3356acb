"""Rank 0's side of the runner channel: `FollowerGroup` (the socket) and `LeaderRunner` (the
`executor.step.ModelRunner` the scheduler talks to).

    Scheduler ──forward / token_logprobs / row_logits / warmup──► LeaderRunner
              (hidden_rows: a host copy on rank 0, nothing broadcast)
                   1. FollowerGroup.publish(Runner* call)  ──ROUTER──► every follower (DEALER)
                   2. the same call on the local runner    ──► its result goes back

Every rank must enter the same collectives in the same order, so each call is sent before it
runs here, and a follower replays the calls in the order their `seq` numbers give. Only rank
0's results are used; followers compute theirs and drop them. The scheduler (time-based state:
deadlines, session retention) runs on rank 0 alone, which is why runner calls are broadcast
rather than requests.

Hidden states (`StepResult.hidden`, handed back to `token_logprobs` / `row_logits`) stay on
each rank's device: the leader's result carries a `HiddenRef` naming the forward call that made
them, and the hand-back call names that call so each follower uses its own copy.

Failures: a follower whose replay raises sends `FollowerFailed` before it exits; the leader's
next publish raises `FollowerLost` with its message. A follower that disappears without a word
(killed) makes the send itself fail (ROUTER_MANDATORY) or, on TP, the collective it would have
joined.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from sgl_tpu import messages as M
from sgl_tpu.executor.step import ForwardMode, ModelRunner, SeqStep, StepResult
from sgl_tpu.parallel.calls import ints_to_bytes, step_to_msg
from sgl_tpu.parallel.channel import decode_or_none, set_heartbeat

logger = logging.getLogger(__name__)
POLL_MS = 100


class FollowerLost(RuntimeError):
    """A follower rank failed or went away: the tensor-parallel group cannot run on."""


class FollowersNotConnected(RuntimeError):
    """Start-up: not every follower rank reached the leader in time."""


@dataclass(frozen=True)
class HiddenRef:
    """`StepResult.hidden` of a broadcast EXTEND step: this rank's array and the call id."""

    seq: int
    local: Any


class FollowerGroup:
    """A ROUTER socket bound at `endpoint` that follower ranks 1..world_size-1 connect to."""

    def __init__(self, endpoint: str, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"a follower group needs world_size >= 2, got {world_size}")
        self.world_size = world_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        set_heartbeat(self._sock)
        self._sock.bind(endpoint)
        # The bound address (tcp://host:0 becomes the real port).
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[int, bytes] = {}  # rank -> zmq routing id
        self.hellos: dict[int, M.FollowerHello] = {}
        self._seq = 0
        self._closed = False

    # ---- start-up ------------------------------------------------------------------------
    def wait_for_followers(self, timeout_s: float,
                           check: Callable[[], None] | None = None) -> dict[int, M.FollowerHello]:
        """Block until every follower rank said hello (each is answered `LeaderWelcome`).

        `check` runs between polls and may raise (e.g. a local follower process died); on
        timeout `FollowersNotConnected` names the ranks that never came."""
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self.world_size - 1:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(self._peers))
                raise FollowersNotConnected(
                    f"follower rank(s) {missing} did not connect to {self.endpoint} within "
                    f"{timeout_s:.0f} s")
            if not self._sock.poll(POLL_MS):
                continue
            ident, data = self._sock.recv_multipart()
            msg = decode_or_none(data)
            if isinstance(msg, M.FollowerFailed):
                raise FollowerLost(f"follower rank {msg.rank} failed: {msg.error}")
            if not isinstance(msg, M.FollowerHello):
                continue
            if not 1 <= msg.rank < self.world_size or msg.rank in self._peers:
                logger.error("ignored a hello from rank %d (world size %d, connected %s)",
                             msg.rank, self.world_size, sorted(self._peers))
                continue
            self._peers[msg.rank] = ident
            self.hellos[msg.rank] = msg
            self._sock.send_multipart([ident, M.encode(M.LeaderWelcome(self.world_size))])
            logger.info("follower rank %d connected (pid %d%s)", msg.rank, msg.pid,
                        f" on {msg.host}" if msg.host else "")
        return dict(self.hellos)

    def wait_until_ready(self, timeout_s: float,
                         check: Callable[[], None] | None = None) -> None:
        """Block until every connected follower sent `FollowerReady` (its weights are loaded),
        raising `FollowerLost` for one that reported a failure instead."""
        deadline = time.monotonic() + timeout_s
        ready: set[int] = set()
        while len(ready) < len(self._peers):
            if check is not None:
                check()
            if time.monotonic() > deadline:
                missing = sorted(set(self._peers) - ready)
                raise FollowersNotConnected(f"follower rank(s) {missing} were not ready within "
                                            f"{timeout_s:.0f} s")
            if not self._sock.poll(POLL_MS):
                continue
            _, data = self._sock.recv_multipart()
            msg = decode_or_none(data)
            if isinstance(msg, M.FollowerFailed):
                raise FollowerLost(f"follower rank {msg.rank} failed: {msg.error}")
            if isinstance(msg, M.FollowerReady):
                ready.add(msg.rank)

    # ---- calls ---------------------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def publish(self, call: M.RunnerCall) -> None:
        """Send `call` to every follower (after reporting any follower that failed)."""
        self._raise_if_failed()
        data = M.encode(call)
        for rank, ident in self._peers.items():
            try:
                self._sock.send_multipart([ident, data])
            except zmq.ZMQError as e:
                raise FollowerLost(f"follower rank {rank} is gone ({e})") from None

    def _raise_if_failed(self) -> None:
        while True:
            try:
                _, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_or_none(data)
            if isinstance(msg, M.FollowerFailed):
                raise FollowerLost(f"follower rank {msg.rank} failed: {msg.error}")

    def close(self) -> None:
        """Tell followers to exit (best effort), then close the socket."""
        if self._closed:
            return
        self._closed = True
        try:
            self.publish(M.RunnerShutdown(seq=self.next_seq()))
        except FollowerLost as e:
            logger.info("closing the follower group: %s", e)
        self._sock.close(linger=200)  # let the shutdown call leave
        self._ctx.term()


class LeaderRunner:
    """A `ModelRunner` whose every device call is first published to the follower ranks."""

    def __init__(self, runner: ModelRunner, group: FollowerGroup,
                 on_close: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.group = group
        self._on_close = on_close
        self.backend = runner.backend

    # Attributes the scheduler and reports read (no device work, nothing to broadcast).
    @property
    def config(self) -> Any:
        return self.runner.config

    @property
    def quantization(self) -> Any:
        return getattr(self.runner, "quantization", None)

    @property
    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    def num_compilations(self) -> int:
        return self.runner.num_compilations()

    def compute_info(self) -> dict[str, Any]:
        return self.runner.compute_info()

    @property
    def world_size(self) -> int:
        return self.group.world_size

    # ---- broadcast calls -----------------------------------------------------------------
    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        seq = self.group.next_seq()
        self.group.publish(M.RunnerForward(seq=seq, mode=int(mode),
                                           steps=[step_to_msg(st) for st in steps]))
        result = self.runner.forward(mode, steps)
        if result.hidden is None:
            return result
        return StepResult(token_ids=result.token_ids, logprobs=result.logprobs,
                          top_ids=result.top_ids, top_logprobs=result.top_logprobs,
                          hidden=HiddenRef(seq, result.hidden))

    def token_logprobs(self, hidden: HiddenRef, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.group.publish(M.RunnerTokenLogprobs(seq=self.group.next_seq(), hidden_seq=hidden.seq,
                                                 target_ids=ints_to_bytes(target_ids)))
        return self.runner.token_logprobs(hidden.local, target_ids)

    def row_logits(self, hidden: HiddenRef, rows: np.ndarray) -> np.ndarray:
        self.group.publish(M.RunnerRowLogits(seq=self.group.next_seq(), hidden_seq=hidden.seq,
                                             rows=ints_to_bytes(rows)))
        return self.runner.row_logits(hidden.local, rows)

    def hidden_rows(self, hidden: HiddenRef, rows: np.ndarray) -> np.ndarray:
        """Read on this rank alone: every rank holds the whole hidden states, and a host
        copy joins no collective."""
        return self.runner.hidden_rows(hidden.local, rows)

    def warmup(self) -> float:
        self.group.publish(M.RunnerWarmup(seq=self.group.next_seq()))
        return self.runner.warmup()

    def close(self) -> None:
        """Send the followers away and release what the launcher of this group holds."""
        self.group.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
