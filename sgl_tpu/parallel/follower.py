"""A follower rank's loop: receive the leader's runner calls and replay them, in order, on the
local runner (backend-neutral: any `executor.step.ModelRunner`).

    connect_to_leader(endpoint, rank)   DEALER ──FollowerHello──► leader's ROUTER
                                               ◄──LeaderWelcome── (else FollowerConnectError)
    run_follower(runner, link)          loop: RunnerForward / RunnerTokenLogprobs /
                                              RunnerRowLogits / RunnerWarmup -> local runner
                                              RunnerShutdown -> return "shutdown"

What blocks: the loop waits on the socket and on a zmq monitor of the connection. It returns
"leader gone" when the connection drops (the leader's process ended: its socket closes; the
leader's host vanished: zmq heartbeats stop, `channel.HEARTBEAT_TIMEOUT_S`) or when
`parent_pid` is no longer its parent. Local followers also ask the kernel for SIGTERM when
their parent dies (`set_parent_death_signal`), which covers a follower stuck in a collective.

A replay that raises is reported to the leader (`FollowerFailed`) and re-raised: a rank that
missed a call can never rejoin the group's collectives, so the process ends.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl_tpu import messages as M
from sgl_tpu.executor.step import ForwardMode, ModelRunner
from sgl_tpu.parallel.calls import ints_from_bytes, step_from_msg
from sgl_tpu.parallel.channel import decode_or_none, set_heartbeat

logger = logging.getLogger(__name__)
POLL_MS = 1000
_PR_SET_PDEATHSIG = 1


class FollowerConnectError(ConnectionError):
    """A follower could not reach its leader (wrong address, leader not running)."""


class ReplayError(RuntimeError):
    """The call stream broke its contract (a gap in seq numbers, an unknown hidden state)."""


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Linux: deliver `sig` to this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


@dataclass
class LeaderLink:
    """A follower's connection to its leader (after the hello / welcome exchange)."""

    rank: int
    world_size: int
    endpoint: str
    ctx: zmq.Context
    sock: zmq.Socket
    monitor: zmq.Socket

    def send(self, msg: M.RunnerMessage) -> None:
        self.sock.send(M.encode(msg))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500)  # a FollowerFailed may still be leaving
        self.ctx.term()


def connect_to_leader(endpoint: str, rank: int, *, timeout_s: float = 60.0) -> LeaderLink:
    """Connect to the leader's runner channel and introduce this rank.

    Raises `FollowerConnectError` naming the endpoint when no leader answers within
    `timeout_s` (zmq retries a connect silently, so the welcome is the proof)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_heartbeat(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    sock.send(M.encode(M.FollowerHello(rank=rank, pid=os.getpid(), host=socket.gethostname())))
    link = LeaderLink(rank=rank, world_size=0, endpoint=endpoint, ctx=ctx, sock=sock,
                      monitor=monitor)
    deadline = time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if not sock.poll(min(left_ms, POLL_MS)):
            continue
        msg = decode_or_none(sock.recv())
        if isinstance(msg, M.LeaderWelcome):
            link.world_size = msg.world_size
            logger.info("rank %d connected to the leader at %s (world size %d)", rank,
                        endpoint, msg.world_size)
            return link
    link.close()
    raise FollowerConnectError(
        f"rank {rank}: no leader answered at {endpoint} within {timeout_s:.0f} s (is rank 0 "
        f"running, and is that address reachable from this host?)")


@dataclass
class _Replay:
    """The follower's state between calls: the runner and the last EXTEND's hidden states."""

    runner: ModelRunner
    hidden_seq: int = -1
    hidden: Any = None
    calls: int = 0
    handlers: dict[type, Callable[[Any], None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.handlers = {M.RunnerForward: self.forward, M.RunnerTokenLogprobs: self.token_logprobs,
                         M.RunnerRowLogits: self.row_logits, M.RunnerWarmup: self.warmup}

    def forward(self, msg: M.RunnerForward) -> None:
        result = self.runner.forward(ForwardMode(msg.mode),
                                     [step_from_msg(s) for s in msg.steps])
        if result.hidden is not None:  # the leader may hand this one back next
            self.hidden_seq, self.hidden = msg.seq, result.hidden

    def _hidden_of(self, seq: int) -> Any:
        if seq != self.hidden_seq:
            raise ReplayError(f"hidden states of call {seq} asked for; this rank holds those "
                              f"of call {self.hidden_seq}")
        return self.hidden

    def token_logprobs(self, msg: M.RunnerTokenLogprobs) -> None:
        self.runner.token_logprobs(self._hidden_of(msg.hidden_seq),
                                   ints_from_bytes(msg.target_ids))

    def row_logits(self, msg: M.RunnerRowLogits) -> None:
        self.runner.row_logits(self._hidden_of(msg.hidden_seq), ints_from_bytes(msg.rows))

    def warmup(self, msg: M.RunnerWarmup) -> None:
        self.runner.warmup()


def run_follower(runner: ModelRunner, leader: str | LeaderLink, *, rank: int | None = None,
                 connect_timeout_s: float = 60.0, parent_pid: int | None = None) -> str:
    """Replay the leader's calls on `runner` until told to stop or the leader is gone.

    `leader` is a connected `LeaderLink`, or an endpoint to connect to as `rank`. Returns
    "shutdown" (the leader closed the group) or "leader gone"."""
    if isinstance(leader, str):
        if rank is None:
            raise ValueError("run_follower(endpoint) needs the follower's rank")
        link = connect_to_leader(leader, rank, timeout_s=connect_timeout_s)
    else:
        link = leader
    replay = _Replay(runner)
    poller = zmq.Poller()
    poller.register(link.sock, zmq.POLLIN)
    poller.register(link.monitor, zmq.POLLIN)
    expected_seq = 1
    try:
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                return _gone(link, "its parent process exited")
            ready = dict(poller.poll(POLL_MS))
            if link.sock not in ready:  # calls first: a closing leader's last one is shutdown
                if link.monitor in ready and (recv_monitor_message(link.monitor)["event"]
                                              == zmq.EVENT_DISCONNECTED):
                    return _gone(link, "the connection dropped")
                continue
            msg = decode_or_none(link.sock.recv())
            if msg is None or not hasattr(msg, "seq"):
                continue
            if msg.seq != expected_seq:
                raise ReplayError(f"call {msg.seq} arrived, call {expected_seq} expected")
            expected_seq += 1
            if isinstance(msg, M.RunnerShutdown):
                logger.info("rank %d: leader closed the group after %d calls", link.rank,
                            replay.calls)
                return "shutdown"
            replay.handlers[type(msg)](msg)
            replay.calls += 1
    except Exception as e:
        logger.exception("rank %d: replay failed", link.rank)
        link.send(M.FollowerFailed(rank=link.rank, error=f"{type(e).__name__}: {e}"))
        raise
    finally:
        link.close()


def _gone(link: LeaderLink, why: str) -> str:
    logger.info("rank %d: leader at %s is gone (%s); exiting", link.rank, link.endpoint, why)
    return "leader gone"
