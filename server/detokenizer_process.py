"""The detokenizer process: token ids from the scheduler -> cumulative text for the tokenizer
manager, incrementally (never splitting a UTF-8 character, trimming matched stop strings).
Blocks on its input socket; exits when the launcher is gone.
"""

from __future__ import annotations

import logging

import zmq

from sgl_tpu.config import ServerArgs
from sgl_tpu.detokenize import DetokenizerState
from sgl_tpu.messages import BatchStrOut, BatchTokenIdOut, ReadyMsg
from sgl_tpu.server.ipc import PortArgs, parent_alive, pull_socket, push_socket, recv_all, send

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
        for msg in recv_all(inbox):
            if isinstance(msg, BatchTokenIdOut):
                send(to_tokenizer, BatchStrOut(outputs=state.process(msg.outputs)))
    logger.info("parent process gone; detokenizer exits")
