"""The scheduler process: owns the device (JAX), the KV pool and the radix cache.

Loop: drain incoming messages (new requests, aborts, control calls) without blocking, run one
`Scheduler.step()`, push the produced token ids to the detokenizer. When there is no work it
blocks on the input socket (with a timeout, to notice a dead parent). It reports ready only
after the model is loaded and every shape bucket is compiled.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import zmq

from sgl_tpu.config import ServerArgs
from sgl_tpu.messages import (
    AbortReq,
    BatchTokenIdOut,
    ControlReq,
    ControlResp,
    ReadyMsg,
    TokenizedGenerateReq,
)
from sgl_tpu.server.ipc import PortArgs, parent_alive, pull_socket, push_socket, recv_all, send

logger = logging.getLogger("sgl_tpu.scheduler")
IDLE_POLL_MS = 500


def run_scheduler_process(args: ServerArgs, ports: PortArgs, parent_pid: int) -> None:
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s scheduler] %(message)s")
    ctx = zmq.Context()
    to_tokenizer = push_socket(ctx, ports.tokenizer_in)
    try:
        from sgl_tpu.engine import build_scheduler

        scheduler, loaded = build_scheduler(args)
    except Exception as e:  # report why start-up failed, then exit
        send(to_tokenizer, ReadyMsg(process="scheduler", ok=False,
                                    error=f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        sys.exit(1)
    inbox = pull_socket(ctx, ports.scheduler_in)
    to_detok = push_socket(ctx, ports.detokenizer_in)
    runner = scheduler.runner
    info = {"context_len": scheduler.config.context_len,
            "max_total_tokens": scheduler.kv.capacity_tokens,
            "num_compilations": runner.num_compilations(), "dtype": runner.config.dtype,
            "grammar_supported": scheduler.grammar_supported,
            "pid": os.getpid()}
    send(to_tokenizer, ReadyMsg(process="scheduler", info=info))
    logger.info("scheduler ready: %s", info)

    while parent_alive(parent_pid):
        if not scheduler.has_work and not inbox.poll(IDLE_POLL_MS):
            continue
        errors = []
        for msg in recv_all(inbox):
            if isinstance(msg, TokenizedGenerateReq):
                err = scheduler.add_request(msg)
                if err is not None:
                    errors.append(err)
            elif isinstance(msg, AbortReq):
                scheduler.abort(msg.rid)
            elif isinstance(msg, ControlReq):
                send(to_tokenizer, _control(scheduler, msg))
        outputs = errors + scheduler.step()
        if outputs:
            send(to_detok, BatchTokenIdOut(outputs=outputs))
    logger.info("parent process gone; scheduler exits")


def _control(scheduler, msg: ControlReq) -> ControlResp:
    if msg.name == "flush_cache":
        return ControlResp(call_id=msg.call_id, ok=scheduler.flush_cache())
    if msg.name == "server_info":
        s = scheduler.stats
        data = {
            "memory": scheduler.memory_info(),
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "num_compilations": scheduler.runner.num_compilations(),
            "stats": {"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                      "generated_tokens": s.generated_tokens,
                      "num_requests_finished": s.num_requests_finished,
                      "num_retractions": s.num_retractions,
                      "num_extend_steps": s.num_extend_steps,
                      "num_decode_steps": s.num_decode_steps,
                      "jump_forward_tokens": s.jump_forward_tokens},
        }
        if not scheduler.has_work:
            try:
                scheduler.check_integrity()
                data["integrity"] = "ok"
            except RuntimeError as e:
                data["integrity"] = str(e)
        return ControlResp(call_id=msg.call_id, ok=True, data=data)
    return ControlResp(call_id=msg.call_id, ok=False, data={"error": f"unknown call {msg.name}"})
