"""The scheduler process: owns the device (JAX), the KV pool and the radix cache.

Loop: drain incoming messages (new requests, aborts, control calls) without blocking, run one
`Scheduler.step()`, push the produced token ids to the detokenizer. When there is no work it
blocks on the input socket (with a timeout, to notice a dead parent). It reports ready only
after the model is loaded and every shape bucket is compiled.

Nothing it receives is trusted: a message that fails to decode is dropped (logged), an
exception while admitting one request answers that request with an error, and an exception in
a step ends the requests of that step (`Scheduler.fail_all`) while the process keeps serving.
Only fatal faults (`scheduler/faults.py`) end the process; the launcher then answers 503.

With `--kv-events-config`, each turn of the loop ends by publishing what it changed in the
radix tree as one batch of KV events (server/kv_events.py).

CPU threads (torch on CPU): `--torch-threads`, or every CPU the process may use, fixed at
start (switching per step costs a slow first step after each switch). On a busy host give it
fewer: a step runs hundreds of OpenMP parallel regions, each ending in a barrier, and when one
of its threads loses its core every barrier waits for it. How those threads wait between
regions (`--omp-spin-count`, executor/omp_wait.py) is set in `build_scheduler` before torch
loads.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import zmq

from sgl_tpu.config import ServerArgs
from sgl_tpu.lora import LoraError
from sgl_tpu.messages import (
    AbortReq,
    BatchTokenIdOut,
    CloseSessionReq,
    ControlReq,
    ControlResp,
    KvHintsReq,
    LoadLoraReq,
    OpenSessionReq,
    ReadyMsg,
    ReqOutput,
    TokenizedGenerateReq,
    ToolPauseReq,
    UnloadLoraReq,
)
from sgl_tpu.parallel.runner_factory import close_runner
from sgl_tpu.scheduler.faults import fault_reason, is_fatal
from sgl_tpu.scheduler.sessions import SessionError
from sgl_tpu.scheduler.stats import load_info, server_info
from sgl_tpu.server.ipc import PortArgs, parent_alive, pull_socket, push_socket, recv_all, send
from sgl_tpu.server.kv_events import KVEventStream

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
        kv_events = None if args.kv_events is None else KVEventStream(args.kv_events)
        if kv_events is not None:
            scheduler.kv.tree.add_listener(kv_events.recorder)
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
            "kv_cache_dtype": runner.config.kv_dtype,
            "grammar_supported": scheduler.grammar is not None,
            "hidden_size": loaded.config.hidden_size,
            "backend": runner.config.backend,
            "lora_enabled": scheduler.lora is not None,
            "lora_adapters": {} if scheduler.lora is None else scheduler.lora.info(),
            "pid": os.getpid()}
    send(to_tokenizer, ReadyMsg(process="scheduler", info=info))
    logger.info("scheduler ready: %s", info)

    consecutive_faults = 0
    while parent_alive(parent_pid):
        if not scheduler.has_work and not inbox.poll(
                int(1000 * scheduler.idle_wait_s(IDLE_POLL_MS / 1000))):
            continue
        outputs = [out for msg in recv_all(inbox, on_error=_log_bad_message)
                   if (out := _handle(scheduler, msg, to_tokenizer)) is not None]
        try:
            outputs += scheduler.step()
            consecutive_faults = 0
        except Exception as e:
            consecutive_faults += 1
            if is_fatal(e, consecutive_faults):
                raise
            logger.exception("step failed; ending the requests of that step")
            outputs += scheduler.fail_all(e)
        if outputs:
            send(to_detok, BatchTokenIdOut(outputs=outputs))
        if kv_events is not None:
            kv_events.flush()  # what this turn stored in, and dropped from, the tree
    logger.info("parent process gone; scheduler exits")
    if kv_events is not None:
        kv_events.close()
    if scheduler.tiers is not None:
        scheduler.tiers.close()  # the disk tier writes what is queued
    close_runner(runner)  # end the follower ranks (tensor parallelism), the compute thread


def _handle(scheduler, msg, to_tokenizer) -> ReqOutput | None:
    """One inbound message; an error output for a request that could not be admitted."""
    if isinstance(msg, TokenizedGenerateReq):
        try:
            return scheduler.add_request(msg)
        except Exception as e:
            return ReqOutput(rid=msg.rid, new_token_ids=[], finished=True,
                             finish_reason=fault_reason(msg.rid, e))
    if isinstance(msg, AbortReq):
        scheduler.abort(msg.rid)
    elif isinstance(msg, ToolPauseReq):
        for rid in msg.rids:  # turns that ended in tool calls: pinned for the grace
            scheduler.kv.retention.tool_pause(rid)
    elif isinstance(msg, OpenSessionReq | CloseSessionReq):
        send(to_tokenizer, _session_call(scheduler, msg))
    elif isinstance(msg, KvHintsReq):
        results = [{"action_id": action.action_id,
                    **scheduler.prefetcher.hint(msg.session_id, action.action_type,
                                                action.ttl_s, scheduler.waiting)}
                   for action in msg.actions]
        send(to_tokenizer, ControlResp(call_id=msg.call_id, ok=True, data={"results": results}))
    elif isinstance(msg, LoadLoraReq | UnloadLoraReq):
        send(to_tokenizer, _lora_call(scheduler, msg))
    elif isinstance(msg, ControlReq):
        try:
            resp = _control(scheduler, msg)
        except Exception as e:
            logger.exception("control call %s failed", msg.name)
            resp = ControlResp(call_id=msg.call_id, ok=False,
                               data={"error": f"{type(e).__name__}"})
        send(to_tokenizer, resp)
    return None


def _log_bad_message(error: Exception) -> None:
    logger.error("dropped a message that does not decode: %s", error)


def _session_call(scheduler, msg: OpenSessionReq | CloseSessionReq) -> ControlResp:
    """/open_session or /close_session; a refusal carries its message and HTTP status."""
    try:
        if isinstance(msg, OpenSessionReq):
            session_id = scheduler.sessions.open(msg.session_id, msg.ttl_s)
            return ControlResp(call_id=msg.call_id, ok=True, data={"session_id": session_id})
        scheduler.sessions.close(msg.session_id)
        return ControlResp(call_id=msg.call_id, ok=True)
    except SessionError as e:
        return ControlResp(call_id=msg.call_id, ok=False,
                           data={"error": str(e), "status": e.status_code})


def _lora_call(scheduler, msg: LoadLoraReq | UnloadLoraReq) -> ControlResp:
    """/load_lora_adapter or /unload_lora_adapter; a refusal is a 400 naming the problem."""
    try:
        if isinstance(msg, LoadLoraReq):
            if scheduler.lora is None:
                raise LoraError("LoRA is not enabled on this server (start it with "
                                "--enable-lora)")
            data = {"lora_id": scheduler.lora.load(msg.lora_name, msg.lora_path)}
        else:
            scheduler.unload_lora(msg.lora_name)
            data = {}
    except LoraError as e:
        return ControlResp(call_id=msg.call_id, ok=False, data={"error": str(e), "status": 400})
    return ControlResp(call_id=msg.call_id, ok=True,
                       data={**data, "adapters": scheduler.lora.info()})


def _control(scheduler, msg: ControlReq) -> ControlResp:
    if msg.name == "flush_cache":
        return ControlResp(call_id=msg.call_id, ok=scheduler.flush_cache())
    if msg.name == "server_info":
        return ControlResp(call_id=msg.call_id, ok=True, data=server_info(scheduler))
    if msg.name == "get_load":
        return ControlResp(call_id=msg.call_id, ok=True, data=load_info(scheduler))
    return ControlResp(call_id=msg.call_id, ok=False, data={"error": f"unknown call {msg.name}"})
