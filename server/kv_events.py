"""Publishing KV events (`--kv-events-config`) over ZeroMQ, framed as SGLang frames them, so a
cache-aware router subscribed to each replica knows which prefixes that replica holds.

    scheduler loop ──(one KVEventBatch per turn)──► queue ──► publisher thread
                                                              ├─ PUB    endpoint
                                                              └─ ROUTER replay_endpoint

PUB message, three frames: ``topic`` (UTF-8), the batch's sequence number (8 bytes, big-endian,
from 0), the msgpack-encoded `KVEventBatch` (`mem_cache/kv_events.py`). A subscriber that sees
a gap in the sequence can ask the replay socket: it sends ``[b"", start_seq (8 bytes)]`` from a
DEALER (or REQ) socket and receives ``[b"", seq, payload]`` for each kept batch from
`start_seq` on (the last `buffer_steps`), then ``[b"", -1 (8 bytes, signed), b""]``.

The scheduler thread only builds and queues batches; the publisher thread owns both sockets
(a ZeroMQ socket is used by one thread), encodes, sends and answers replays. PUB never blocks:
past `hwm` queued messages a slow subscriber loses messages (the sequence shows the gap).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from sgl_tpu.config import KVEventsConfig
from sgl_tpu.mem_cache.kv_events import KVEventBatch, KVEventRecorder

logger = logging.getLogger("sgl_tpu.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.1  # how often the publisher thread looks at the replay socket when idle
CLOSE_TIMEOUT_S = 2.0


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of replica `dp_rank`: a TCP port plus `dp_rank`, else a name suffix."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--kv-events-config: {endpoint!r} has no port to offset")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"  # ipc:// or inproc://


def _binds(endpoint: str) -> bool:
    """SGLang's rule: a wildcard address or a local transport is bound, anything else dialed
    (a subscriber, or a forwarder, listening there)."""
    return (any(s in endpoint for s in ("*", "::", "0.0.0.0"))
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    """Sends each batch on a PUB socket and keeps the last `buffer_steps` for replay."""

    def __init__(self, config: KVEventsConfig, ctx: zmq.Context | None = None) -> None:
        self.topic = config.topic.encode()
        self.endpoint = offset_endpoint(config.endpoint, config.dp_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, config.dp_rank)
        ctx = ctx or zmq.Context.instance()
        # Made here, so a bad or busy address fails the server's start-up; used only by the
        # publisher thread from then on.
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeError(f"KV events: cannot open {self.endpoint} / "
                               f"{self.replay_endpoint}: {e}") from e
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue `batch`; when the thread has fallen `max_queue_size` batches behind, the batch
        is dropped (logged) rather than stalling the scheduler."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events: publisher queue full, a batch of %d events dropped",
                           len(batch.events))

    def close(self) -> None:
        """Send what is queued (for at most CLOSE_TIMEOUT_S), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
            except queue.Full:
                pass
            self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=int(CLOSE_TIMEOUT_S * 1000))  # the last batches still go out
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                batch = self._queue.get(timeout=POLL_S)
                while batch is not None:  # everything queued, before any replay is answered
                    self._send(encoder.encode(batch))
                    batch = self._queue.get_nowait()
                return  # None: closed
            except queue.Empty:
                pass
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:  # one subscriber's replay; publishing goes on
                    logger.exception("KV events: replay request failed")

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the batch stays replayable
            logger.warning("KV events: batch %d not sent: %s", seq, e)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


# --kv-events-config "publisher" -> its class. config.KV_EVENT_PUBLISHERS also has "null",
# which publishes nothing (ServerArgs.kv_events is None: no recorder is attached at all).
PUBLISHERS: dict[str, Callable[[KVEventsConfig], ZmqEventPublisher]] = {
    "zmq": ZmqEventPublisher,
}


class KVEventStream:
    """The recorder the tree calls and the publisher it feeds: `flush` once per loop turn."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.recorder = KVEventRecorder()
        self.publisher = PUBLISHERS[config.publisher](config)
        self.dp_rank = config.dp_rank
        logger.info("KV events: publishing on %s (replay: %s, topic %r)",
                    self.publisher.endpoint, self.publisher.replay_endpoint, config.topic)

    def flush(self) -> None:
        """Publish the events recorded since the last flush as one batch (none: nothing)."""
        events = self.recorder.take()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events,
                                                attn_dp_rank=self.dp_rank))

    def close(self) -> None:
        self.flush()
        self.publisher.close()
