"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.

Served on top of the chat path (`openai_chat.chat_completion` / `chat_completion_chunks`),
whose contract is the OpenAI chat wire format:

    ResponsesRequest ──(previous conversation's items from the store) + new input items──►
        [truncation "auto": oldest turns dropped until the prompt fits] ──►
        ChatCompletionRequest (messages, tools, tool_choice, response_format, logprobs,
                               priority, session_id)
    non-stream: chat.completion ──output_items──► response object
    stream:     chat.completion.chunk ... ──ResponseEvents──► response.* SSE events

With `background` the request answers at once (`queued`; with `stream`, the run's events) and
runs on in a task (`responses_background.py`); `GET` shows its progress (`?stream=true`: the
events of one created with `stream`), `POST .../cancel` stops it.

A stored response (`store`, the default) keeps its conversation in `ResponseStore`, so the next
request names it as `previous_response_id` and sends only new items. Every turn of a
conversation runs with one `session_id` (its `prompt_cache_key`, else the X-SMG-Routing-Key
header, else the first response's id), so the radix cache keeps the trajectory between turns.
Instructions are not carried over (as OpenAI): each request's own `instructions` lead its
prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from sgl_tpu.server.http_common import (
    ROUTING_KEY_HEADER,
    checked_cache_key,
    error_response,
    log_digest,
    log_identity,
    parse_body,
    sse,
)
from sgl_tpu.server.openai_api import check_model
from sgl_tpu.server.openai_chat import (
    chat_completion,
    chat_completion_chunks,
    chat_items,
    prompt_ids,
)
from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.responses_background import BackgroundRuns
from sgl_tpu.server.responses_items import input_item_resources, page, truncation_cuts
from sgl_tpu.server.responses_protocol import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    new_id,
    output_items,
    thinking_kwargs,
    usage,
)
from sgl_tpu.server.responses_store import ResponseStore
from sgl_tpu.server.responses_stream import ResponseEvents
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead, TokenizerManager

logger = logging.getLogger(__name__)


class _Turn:
    """One request resolved against the store: its id, items and chat request."""

    def __init__(self, tm: TokenizerManager, store: ResponseStore, req: ResponsesRequest,
                 routing_key: str | None, runs: BackgroundRuns) -> None:
        self.id = new_id("resp")
        self.req = req
        prior: list[dict[str, Any]] = []
        self.conversation_id = self.id
        if req.previous_response_id is not None:
            entry = store.get(req.previous_response_id)
            if entry is None and runs.get(req.previous_response_id) is not None:
                raise RequestError(f"previous_response_id: response "
                                   f"{req.previous_response_id!r} is still running")
            if entry is None:
                raise RequestError(
                    f"previous_response_id: no stored response {req.previous_response_id!r} "
                    f"(unknown, deleted, created with store=false, or expired: responses are "
                    f"kept {store.ttl_s:g} s after last use, at most {store.max_count})", 404)
            prior = entry.input_items + entry.response["output"]
            self.conversation_id = entry.conversation_id
        if not items_to_messages(req.input):  # checks the new items, naming them as sent
            raise RequestError("input: no input items")
        self.input_items = prior + input_item_resources(req.input)
        key = None if req.prompt_cache_key is None else checked_cache_key(req.prompt_cache_key)
        self.session_id = key or routing_key or self.conversation_id
        self.template_kwargs = thinking_kwargs(req.reasoning)
        self.chat = self._chat(self.input_items)
        num_dropped = self._truncate(tm, len(prior)) if req.truncation == "auto" else 0
        self.response = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": req.background, "error": None,
            "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model or tm.served_model_name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "top_logprobs": req.top_logprobs,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": {"format": (req.text.format if req.text and req.text.format
                                else {"type": "text"})},
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "truncation": req.truncation or "disabled", "store": req.store,
            "metadata": req.metadata or {}, "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "usage": None,
        }
        if num_dropped:
            self.response["truncated_input_items"] = num_dropped  # this server's extension

    def _chat(self, items: list[dict[str, Any]]) -> ChatCompletionRequest:
        req = self.req
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        body = {
            "model": req.model, "messages": system + items_to_messages(items),
            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "response_format": chat_response_format(req.text),
            "logprobs": req.wants_logprobs or None,
            "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
            "chat_template_kwargs": self.template_kwargs, "priority": req.priority,
            "seed": req.seed, "top_k": req.top_k, "ignore_eos": req.ignore_eos,
            "regex": req.regex, "ebnf": req.ebnf, "stream": req.stream,
            "stream_options": {"include_usage": True}, "session_id": self.session_id,
        }
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise RequestError("invalid request: " + "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            ) from None

    def _truncate(self, tm: TokenizerManager, num_prior: int) -> int:
        """Drop the fewest oldest items (whole turns, `truncation_cuts`) that let the prompt
        and `max_output_tokens` (at least one token) fit the context; the number dropped.
        When nothing fits, all earlier turns go and the request's own checks answer 400."""
        limit = min(tm.context_len, tm.max_total_tokens)
        reserve = self.req.max_output_tokens or 1

        def fits(chat: ChatCompletionRequest) -> bool:
            try:
                return len(prompt_ids(tm, chat)) + reserve <= limit
            except RequestError:  # a text too long to tokenize, too many messages
                return False

        cuts = truncation_cuts(self.input_items, num_prior)
        if not cuts or fits(self.chat):
            return 0
        lo, hi = 0, len(cuts) - 1  # binary search: the first cut that fits, else the last
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(self._chat(self.input_items[cuts[mid]:])):
                hi = mid
            else:
                lo = mid + 1
        cut = cuts[lo]
        self.input_items = self.input_items[cut:]
        self.chat = self._chat(self.input_items)
        logger.info("response %s: truncation dropped the %d oldest input items",
                    log_digest(self.id), cut)
        return cut

    def save(self, store: ResponseStore, final: dict[str, Any],
             events: list[dict[str, Any]] | None = None) -> None:
        store.put(final, self.input_items, self.conversation_id, events)


def _reasoning_tokens(tm: TokenizerManager, output: list[dict[str, Any]]) -> int:
    text = "".join(part["text"] for item in output if item["type"] == "reasoning"
                   for part in item["content"])
    return len(tm.tokenizer.encode(text, add_special_tokens=False)) if text else 0


async def create_response(tm: TokenizerManager, store: ResponseStore, runs: BackgroundRuns,
                          req: ResponsesRequest, routing_key: str | None = None):
    if req.background and not req.store:
        raise RequestError("background: a background response must be stored (store=true)")
    turn = _Turn(tm, store, req, routing_key, runs)
    if req.background:
        prepared = chat_items(tm, turn.chat)  # bad input: a 4xx now, not a failed response
        events = ResponseEvents({**turn.response, "status": "queued"},
                                lambda output: _reasoning_tokens(tm, output))
        run = runs.start(events, turn.input_items,
                         lambda final, log: turn.save(store, final, log),
                         chat_completion_chunks(tm, turn.chat, prepared), keep_events=req.stream)
        # a stream of a background run: a client that hangs up leaves the run going
        return event_stream(run.stream(-1)) if req.stream else run.response()
    if req.stream:
        return await _stream(tm, store, req, turn, chat_completion_chunks(tm, turn.chat))
    chat = await chat_completion(tm, turn.chat)
    choice = chat["choices"][0]
    logprobs = (choice.get("logprobs") or {}).get("content") if req.wants_logprobs else None
    output = output_items(choice["message"], logprobs)
    final = {**turn.response, "status": "completed", "output": output,
             "usage": usage(chat.get("usage"), _reasoning_tokens(tm, output))}
    if choice["finish_reason"] == "length":
        final.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    if req.store:
        turn.save(store, final)
    return final


async def _stream(tm: TokenizerManager, store: ResponseStore, req: ResponsesRequest,
                  turn: _Turn, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    first = await anext(chunks, None)  # errors before the first token: a 4xx, not a stream
    events = ResponseEvents(turn.response, lambda output: _reasoning_tokens(tm, output))

    async def body() -> AsyncIterator[bytes]:
        try:
            for event in events.start() + (events.feed(first) if first else []):
                yield sse(event, event["type"])
            async for chunk in chunks:
                for event in events.feed(chunk):
                    yield sse(event, event["type"])
            closing, final = events.finish()
            if req.store:
                turn.save(store, final)
            for event in closing:
                yield sse(event, event["type"])
        except (RequestError, ServerDead) as e:
            for event in events.failed(str(e), getattr(e, "status_code", 503)):
                yield sse(event, event["type"])
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


def event_stream(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield sse(event, event["type"])

    return StreamingResponse(body(), media_type="text/event-stream")


async def _replay(events: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for event in events:
        yield event


def _starting_after(request: Request) -> int:
    value = request.query_params.get("starting_after", "-1")
    try:
        return int(value)
    except ValueError:
        raise RequestError(f"starting_after must be an integer, got {value!r}") from None


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    store = app.state.response_store = ResponseStore(tm.args.responses_max_stored,
                                                     tm.args.responses_ttl_s)
    runs = app.state.background_runs = BackgroundRuns()
    app.state.shutdown_hooks.append(runs.stop)

    def not_found(rid: str):
        return error_response(f"no stored response {rid!r} (unknown, deleted, created with "
                              f"store=false, or expired)", 404, "NotFoundError")

    @app.post("/v1/responses")
    async def v1_responses(request: Request):
        req = await parse_body(request, ResponsesRequest)
        if (err := check_model(tm, req.model)) is not None:
            return err
        log_identity(request, user=req.user, safety_identifier=req.safety_identifier)
        return await create_response(tm, store, runs, req,
                                     request.headers.get(ROUTING_KEY_HEADER))

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        run = runs.get(rid)
        entry = store.get(rid) if run is None else None
        if run is None and entry is None:
            return not_found(rid)
        if request.query_params.get("stream") not in ("true", "1"):
            return run.response() if run is not None else entry.response
        # the events after `starting_after`: live while it runs, then replayed
        after = _starting_after(request)
        if run is not None and run.log is not None:
            return event_stream(run.stream(after))
        if entry is not None and entry.events is not None:
            return event_stream(_replay(entry.events[after + 1:] if after >= 0
                                        else entry.events))
        raise RequestError(f"stream: response {rid!r} was not created with background=true and "
                           "stream=true; only those can be streamed again")

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel_response(rid: str):
        """As OpenAI: only a background response can be cancelled; one that already ended
        is returned as it is (cancelling is idempotent)."""
        if (cancelled := await runs.cancel(rid)) is not None:
            return cancelled
        entry = store.get(rid)
        if entry is None:
            return not_found(rid)
        if not entry.response.get("background"):
            raise RequestError(f"response {rid!r} was not created with background=true; "
                               "only background responses can be cancelled")
        return entry.response

    @app.get("/v1/responses/{rid}/input_items")
    async def list_input_items(rid: str, request: Request):
        run = runs.get(rid)
        entry = store.get(rid) if run is None else run
        return not_found(rid) if entry is None else page(entry.input_items,
                                                        dict(request.query_params))

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        await runs.cancel(rid)  # a running one stops first
        if not store.delete(rid):
            return not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}
