"""ZeroMQ endpoints of one server instance and small socket helpers.

All names carry the launcher's pid, so two servers on one host never collide:

    tokenizer  --PUSH-->  scheduler_in     (TokenizedGenerateReq, AbortReq, ControlReq)
    scheduler  --PUSH-->  detokenizer_in   (BatchTokenIdOut)
    detokenizer--PUSH-->  tokenizer_in     (BatchStrOut)
    scheduler  --PUSH-->  tokenizer_in     (ControlResp, ReadyMsg)
    detokenizer--PUSH-->  tokenizer_in     (ReadyMsg)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from sgl_tpu import messages


@dataclass(frozen=True)
class PortArgs:
    scheduler_in: str
    detokenizer_in: str
    tokenizer_in: str

    @classmethod
    def for_pid(cls, pid: int | None = None) -> PortArgs:
        pid = os.getpid() if pid is None else pid
        base = os.path.join(tempfile.gettempdir(), f"sgl_tpu-{pid}")
        return cls(scheduler_in=f"ipc://{base}-scheduler",
                   detokenizer_in=f"ipc://{base}-detokenizer",
                   tokenizer_in=f"ipc://{base}-tokenizer")

    def paths(self) -> list[str]:
        return [a.removeprefix("ipc://") for a in
                (self.scheduler_in, self.detokenizer_in, self.tokenizer_in)]


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msg: messages.Message) -> None:
    sock.send(messages.encode(msg))


def recv_all(sock: zmq.Socket, on_error: Callable[[Exception], None] | None = None
             ) -> list[messages.Message]:
    """Everything queued right now, without blocking. A message that does not decode is
    passed to `on_error` and skipped (raised when there is no `on_error`)."""
    out = []
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return out
        try:
            out.append(messages.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if on_error is None:
                raise
            on_error(e)


def parent_alive(parent_pid: int) -> bool:
    """A child exits when its launcher is gone (re-parented to init or a subreaper)."""
    return os.getppid() == parent_pid
