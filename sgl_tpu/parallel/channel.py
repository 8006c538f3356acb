"""Socket settings, endpoints and decoding shared by both ends of the runner channel (leader
ROUTER, follower DEALER; see sgl_tpu/parallel/__init__.py)."""

from __future__ import annotations

import logging

import msgspec
import zmq

from sgl_tpu import messages as M
from sgl_tpu.config import ServerArgs

logger = logging.getLogger(__name__)
HEARTBEAT_IVL_S = 1.0  # zmq-level pings on every link, both directions
HEARTBEAT_TIMEOUT_S = 10.0  # nothing heard for this long: the peer is gone, the link drops


def set_heartbeat(sock: zmq.Socket) -> None:
    """zmq heartbeats: a peer whose host vanished (no FIN ever arrives) is noticed too."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_S * 1000))


def decode_or_none(data: bytes) -> M.RunnerMessage | None:
    """The message, or None (logged) for bytes that are not one: a channel is untrusted."""
    try:
        return M.decode_runner(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.error("dropped a runner-channel message that does not decode: %s", e)
        return None


def dist_host_port(args: ServerArgs) -> tuple[str, int]:
    """`--dist-init-addr` HOST:PORT, checked (the JAX coordinator's, or torch.distributed's)."""
    host, sep, port = (args.dist_init_addr or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--dist-init-addr must be HOST:PORT (rank 0's address), got "
                         f"{args.dist_init_addr!r}")
    return host, int(port)


def runner_channel(args: ServerArgs, *, bind: bool) -> str:
    """The runner channel's endpoint: rank 0 binds every interface, followers dial HOST."""
    host, port = dist_host_port(args)
    return f"tcp://{'*' if bind else host}:{port + 1}"
