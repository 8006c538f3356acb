"""TokenizerManager: the main process's async bridge between HTTP handlers and the scheduler.

    handler ──generate(items)──► tokenize, validate ──TokenizedGenerateReq──► scheduler
    handler ◄──cumulative dicts── ResponseAccumulator ◄──BatchStrOut── detokenizer (recv task)

One asyncio task drains the inbound socket and wakes the waiting handlers (an Event per
request). Control calls (flush cache, server info) carry a call id and await a future.
If a child process dies, every in-flight request ends with an error and `/health` fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from sgl_tpu import messages
from sgl_tpu.config import ServerArgs
from sgl_tpu.loader.tokenizer import Tokenizer
from sgl_tpu.messages import (
    AbortReq,
    BatchStrOut,
    CloseSessionReq,
    ControlReq,
    ControlResp,
    KvHintAction,
    KvHintsReq,
    LoadLoraReq,
    OpenSessionReq,
    ReadyMsg,
    ReqStrOut,
    TokenizedGenerateReq,
    ToolPauseReq,
    UnloadLoraReq,
)
from sgl_tpu.response import ResponseAccumulator, error_status
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.server.ipc import PortArgs
from sgl_tpu.validation import check_generate_fields, check_request, check_token_ids

logger = logging.getLogger("sgl_tpu.tokenizer_manager")
# Texts longer than this (characters) are tokenized on a worker thread (the tokenizer releases
# the GIL), so one large prompt does not stall the event loop and everybody else's streams.
OFF_LOOP_TOKENIZE_CHARS = 16_384
MIN_TOKEN_BYTES_SLACK = 32


class RequestError(Exception):
    """Bad input: the HTTP layer answers `status_code` with the message."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServerDead(Exception):
    """A child process died; in-flight and new requests fail with 503."""


class GenItem:
    """One prompt of a generate call, after tokenization: `req`, the message the scheduler gets
    (every per-request field is one of its fields, `messages.TokenizedGenerateReq`; `fields`
    name them), and `parsed`, its sampling params once `TokenizerManager.validate` passed it."""

    def __init__(self, input_ids: list[int], sampling: dict[str, Any], *,
                 rid: str | None = None, parsed: SamplingParams | None = None,
                 lora_path: str | None = None, **fields: Any) -> None:
        self.req = TokenizedGenerateReq(rid=uuid.uuid4().hex if rid is None else rid,
                                        input_ids=input_ids, sampling=sampling, **fields)
        self.parsed = parsed
        # LoRA: the loaded adapter's name (SGLang's `lora_path`; the OpenAI routes' `model`),
        # None: the base model; `TokenizerManager.validate` sets `req.lora_id` from it
        self.lora_path = lora_path

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclass
class _ReqState:
    acc: ResponseAccumulator
    # completion tokens at which the consumer is next woken (inf: only by the final update)
    wake_at: float = 1
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None


class TokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, tokenizer: Tokenizer,
                 vocab_size: int, model_path: str) -> None:
        self.args = args
        self.model_path = model_path
        self.served_model_name = args.served_model_name or os.path.basename(
            model_path.rstrip("/"))
        self.ports = ports
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(ports.tokenizer_in)
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(ports.scheduler_in)
        self.states: dict[str, _ReqState] = {}
        self.ready: dict[str, ReadyMsg] = {}
        self._ready_event = asyncio.Event()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_reason: str | None = None
        self.context_len = 0
        self.max_total_tokens = 0
        self.grammar_supported = False
        self.hidden_size = 0  # the model's: an embedding's length
        self.lora_enabled = False
        self.backend = ""  # the executor backend the scheduler runs (its ready message)
        self.lora_adapters: dict[str, dict[str, Any]] = {}  # name -> {id, path, rank}
        self.start_time = time.time()
        self.metrics = None  # set by the HTTP app (sgl_tpu.server.metrics.Metrics)
        self._recv_task: asyncio.Task | None = None
        # No token spans more bytes than this, so a text of more than context_len * this
        # characters is too long for the context whatever it tokenizes to (refused untokenized).
        # The slack covers added special tokens whose text may be longer than any vocab entry.
        self.max_token_bytes = max(
            (len(tokenizer.id_to_token_bytes(t)) for t in range(tokenizer.vocab_size)),
            default=1) + MIN_TOKEN_BYTES_SLACK

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def wait_ready(self, processes: tuple[str, ...] = ("scheduler", "detokenizer")
                         ) -> None:
        while not all(p in self.ready for p in processes):
            if self.dead_reason:
                raise ServerDead(self.dead_reason)
            self._ready_event.clear()
            await self._ready_event.wait()
        info = self.ready["scheduler"].info
        self.context_len = info["context_len"]
        self.max_total_tokens = info["max_total_tokens"]
        self.grammar_supported = info.get("grammar_supported", False)
        self.hidden_size = info.get("hidden_size", 0)
        self.lora_enabled = info.get("lora_enabled", False)
        self.backend = info.get("backend", "")
        self.lora_adapters = dict(info.get("lora_adapters", {}))

    def mark_dead(self, reason: str) -> None:
        """A child died: fail everything in flight (called by the launcher's watchdog)."""
        if self.dead_reason:
            return
        self.dead_reason = reason
        logger.error("server unhealthy: %s", reason)
        for state in self.states.values():
            state.error = reason
            state.event.set()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(ServerDead(reason))
        self._ready_event.set()

    async def _recv_loop(self) -> None:
        while True:
            data = await self.inbox.recv()
            try:
                self._handle(messages.decode(data))
            except Exception:  # a bad message must not stop delivery to everybody else
                logger.exception("dropped an undecodable or unhandled message from a child")

    def _handle(self, msg: messages.Message) -> None:
        if isinstance(msg, BatchStrOut):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, ControlResp):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ReadyMsg):
            if not msg.ok:
                self.mark_dead(f"{msg.process} failed to start: {msg.error}")
            self.ready[msg.process] = msg
            self._ready_event.set()

    def _deliver(self, out: ReqStrOut) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return
        state.acc.update(out)
        if self.metrics is not None:
            self.metrics.observe(out, state.acc)
        if out.finished or out.completion_tokens >= state.wake_at:
            state.event.set()

    # ---- requests --------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text that cannot fit the context is refused untokenized."""
        self._check_text_len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def tokenize_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`tokenize`, on a worker thread for long texts (see OFF_LOOP_TOKENIZE_CHARS)."""
        if len(text) <= OFF_LOOP_TOKENIZE_CHARS:
            return self.tokenize(text, add_special_tokens=add_special_tokens)
        self._check_text_len(text)
        return await asyncio.to_thread(self.tokenizer.encode, text,
                                       add_special_tokens=add_special_tokens)

    def check_num_messages(self, num_messages: int) -> None:
        """Every chat message renders to at least one token, so more messages than the context
        length can never fit: refused before the template is rendered (on the event loop)."""
        if self.context_len and num_messages > self.context_len:
            raise RequestError(f"messages: {num_messages} messages cannot fit the context "
                               f"length ({self.context_len} tokens)")

    def _check_text_len(self, text: str) -> None:
        limit = max(self.context_len, 1) * self.max_token_bytes
        if self.context_len and len(text) > limit:
            raise RequestError(f"the prompt has {len(text)} characters, more than the context "
                               f"length ({self.context_len} tokens) can hold")

    def validate(self, item: GenItem) -> SamplingParams:
        """Parse and check one item (RequestError naming the problem); the parsed params are
        kept on it (`item.parsed`), so `generate` does not parse them again."""
        if self.dead_reason:
            raise ServerDead(self.dead_reason)
        req = item.req
        try:
            sampling = SamplingParams.from_dict(req.sampling)
        except ValueError as e:
            raise RequestError(str(e)) from None
        n = len(req.input_ids)
        error = check_token_ids("input_ids", req.input_ids, self.vocab_size) or check_request(
            n, sampling, context_len=self.context_len, capacity_tokens=self.max_total_tokens,
            grammar_supported=self.grammar_supported, vocab_size=self.vocab_size)
        if error is not None:
            raise RequestError(error)
        if req.logprob_start_len >= n:
            raise RequestError(f"logprob_start_len ({req.logprob_start_len}) must be less "
                               f"than the prompt length ({n})")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > self.args.max_top_logprobs:
            raise RequestError(f"top_logprobs_num must be in [0, {self.args.max_top_logprobs}]")
        req.lora_id = self.lora_id(item.lora_path)
        if (error := check_generate_fields(req, self.args.max_retention_s)) is not None:
            raise RequestError(error)
        item.parsed = sampling
        return sampling

    async def generate(self, item: GenItem, *, final_only: bool = False
                       ) -> AsyncIterator[dict[str, Any]]:
        """Submit one request; yield its cumulative result: once it has a token, then once
        at least `stream_interval` more arrived (the request's sampling parameter, else
        --stream-interval; updates that arrive while the consumer is busy merge into one),
        and when final; with `final_only` (a caller that waits for the whole result) only
        the final one. The receive loop wakes this generator only for those (`wake_at`).
        Raises RequestError for bad input, ServerDead if the server died."""
        if item.parsed is None:  # (a route validates its items before it generates)
            self.validate(item)
        elif self.dead_reason:
            raise ServerDead(self.dead_reason)
        interval = item.parsed.stream_interval or self.args.stream_interval
        if item.rid in self.states:
            raise RequestError(f"duplicate request id {item.rid!r}")
        acc = ResponseAccumulator(
            item.rid, return_logprob=item.req.return_logprob,
            return_text_in_logprobs=item.req.return_text_in_logprobs,
            decode_token=lambda t: self.tokenizer.decode([t], False))
        try:
            data = messages.encode(item.req)
        except (TypeError, ValueError, OverflowError, UnicodeEncodeError) as e:
            # What the HTTP layer's checks let through (the Engine-like callers) ends here.
            raise RequestError(f"request cannot be encoded: {type(e).__name__}: {e}") from None
        state = self.states[item.rid] = _ReqState(acc, math.inf if final_only else 1)
        await self.to_scheduler.send(data)
        finished = False
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error:
                    raise ServerDead(state.error)
                status = error_status(acc.last)
                if status is not None:
                    raise RequestError(status[1], status[0])
                finished = acc.finished
                if not final_only:
                    state.wake_at = acc.last.completion_tokens + interval
                yield acc.to_dict()
                if finished:
                    return
        finally:
            self.states.pop(item.rid, None)
            if not finished and not self.dead_reason:  # client went away: free its KV
                await self.abort(item.rid)

    async def abort(self, rid: str) -> None:
        await self.to_scheduler.send(messages.encode(AbortReq(rid=rid)))

    async def control(self, name: str, timeout_s: float = 30.0) -> ControlResp:
        return await self._call(lambda call_id: ControlReq(call_id=call_id, name=name),
                                timeout_s)

    async def open_session(self, session_id: str | None, ttl_s: float | None) -> str:
        """/open_session: the session's id; RequestError (4xx) when the scheduler refuses."""
        resp = await self._call(lambda call_id: OpenSessionReq(
            call_id=call_id, session_id=session_id, ttl_s=ttl_s))
        self._raise_refusal(resp)
        return resp.data["session_id"]

    async def close_session(self, session_id: str) -> None:
        """/close_session; RequestError (404) when it is not open."""
        self._raise_refusal(await self._call(
            lambda call_id: CloseSessionReq(call_id=call_id, session_id=session_id)))

    async def kv_hints(self, session_id: str, actions: list[KvHintAction]) -> list[dict]:
        """/kv_hints: each action's outcome (scheduler/prefetch.py `Prefetcher.hint`)."""
        resp = await self._call(lambda call_id: KvHintsReq(
            call_id=call_id, session_id=session_id, actions=actions))
        self._raise_refusal(resp)
        return resp.data["results"]

    # ---- LoRA adapters (docs/lora.md) -----------------------------------------------------
    def lora_id(self, name: str | None) -> int:
        """The id of loaded adapter `name` (None: 0, the base model); RequestError naming it
        when it is not loaded."""
        if name is None:
            return 0
        if not self.lora_enabled:
            how = ("start it with --enable-lora" if self.backend == "torch" else
                   f"LoRA needs the torch backend; this server runs the {self.backend} backend")
            raise RequestError(f"LoRA adapter {name!r} requested, but LoRA is not enabled on "
                               f"this server ({how})")
        adapter = self.lora_adapters.get(name)
        if adapter is None:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{sorted(self.lora_adapters)})")
        return adapter["id"]

    async def load_lora(self, name: str, path: str) -> None:
        """/load_lora_adapter; RequestError (400) naming why it was refused."""
        resp = await self._call(lambda call_id: LoadLoraReq(
            call_id=call_id, lora_name=name, lora_path=path), timeout_s=300.0)
        self._raise_refusal(resp)
        self.lora_adapters = dict(resp.data["adapters"])

    async def unload_lora(self, name: str) -> None:
        """/unload_lora_adapter: refused (400) while requests use it. The name resolves to
        nothing from now on, so no new request takes it meanwhile."""
        adapter = self.lora_adapters.pop(name, None)
        try:
            resp = await self._call(lambda call_id: UnloadLoraReq(call_id=call_id,
                                                                  lora_name=name))
        except BaseException:
            if adapter is not None:
                self.lora_adapters[name] = adapter
            raise
        if not resp.ok and adapter is not None:
            self.lora_adapters[name] = adapter
        self._raise_refusal(resp)
        self.lora_adapters = dict(resp.data["adapters"])

    def tool_pause(self, rids: list[str]) -> None:
        """These finished requests' answers hold tool calls: the scheduler pins their KV for
        the tool-pause grace period (scheduler/retention.py). Sent without waiting."""
        if rids and not self.dead_reason:
            self.to_scheduler.send(messages.encode(ToolPauseReq(rids=rids)))

    @staticmethod
    def _raise_refusal(resp: ControlResp) -> None:
        if not resp.ok:
            raise RequestError(resp.data.get("error", "refused"), resp.data.get("status", 400))

    async def _call(self, make, timeout_s: float = 30.0) -> ControlResp:
        """Send the request/reply message `make(call_id)` to the scheduler; await its answer."""
        if self.dead_reason:
            raise ServerDead(self.dead_reason)
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        await self.to_scheduler.send(messages.encode(make(call_id)))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.ctx.destroy(linger=0)
