"""The detokenizer process: token ids from the scheduler -> cumulative text for the tokenizer
manager, incrementally (never splitting a UTF-8 character, trimming matched stop strings).
Blocks on its input socket; exits when the launcher is gone. An output that fails to decode
ends its own request with an error (`DetokenizerState.process`); a batch that fails to decode as
a message ends every request whose rid can still be read from it.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from sgl_tpu import messages
from sgl_tpu.config import ServerArgs
from sgl_tpu.detokenize import DetokenizerState, error_str_out
from sgl_tpu.messages import BatchStrOut, BatchTokenIdOut, ReadyMsg
from sgl_tpu.server.ipc import PortArgs, parent_alive, pull_socket, push_socket, send

logger = logging.getLogger("sgl_tpu.detokenizer")


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, parent_pid: int) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s detokenizer] %(message)s")
    from sgl_tpu.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, ports.detokenizer_in)
    to_tokenizer = push_socket(ctx, ports.tokenizer_in)
    state = DetokenizerState(tokenizer.decode)
    send(to_tokenizer, ReadyMsg(process="detokenizer"))
    while parent_alive(parent_pid):
        if not inbox.poll(500):
            continue
        while True:
            try:
                data = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = messages.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("a scheduler batch does not decode: %s", e)
                outs = [error_str_out(rid, "internal error: undecodable output", 500)
                        for rid in _rids(data)]
                send(to_tokenizer, BatchStrOut(outputs=outs))
                continue
            if isinstance(msg, BatchTokenIdOut):
                send(to_tokenizer, BatchStrOut(outputs=state.process(msg.outputs)))
    logger.info("parent process gone; detokenizer exits")


def _rids(data: bytes) -> list[str]:
    """The request ids in a message that does not decode as a `BatchTokenIdOut`."""
    try:
        raw = msgspec.msgpack.decode(data)
        return [o["rid"] for o in raw.get("outputs", [])
                if isinstance(o, dict) and isinstance(o.get("rid"), str)]
    except Exception:
        return []
