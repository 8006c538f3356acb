"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

Served on top of the chat path (`openai_chat.chat_completion` / `chat_completion_chunks`),
whose contract is the OpenAI chat wire format:

    ResponsesRequest ──(previous conversation from the store) + new input items──►
        ChatCompletionRequest (messages, tools, tool_choice, response_format, session_id)
    non-stream: chat.completion ──output_items──► response object
    stream:     chat.completion.chunk ... ──ResponseEvents──► response.* SSE events

A stored response (`store`, the default) keeps its conversation in `ResponseStore`, so the next
request names it as `previous_response_id` and sends only new items; every turn of a
conversation runs with the first response's id as its `session_id`, so the radix cache keeps
the trajectory between turns. Instructions are not carried over (as OpenAI): each request's
own `instructions` lead its prompt.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from sgl_tpu.server.http_common import error_response, parse_body, sse
from sgl_tpu.server.openai_api import check_model
from sgl_tpu.server.openai_chat import chat_completion, chat_completion_chunks
from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.responses_protocol import (
    ResponsesRequest,
    assistant_message,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    new_id,
    output_items,
    usage,
)
from sgl_tpu.server.responses_store import ResponseStore
from sgl_tpu.server.responses_stream import ResponseEvents
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead, TokenizerManager


class _Turn:
    """One request resolved against the store: its id, conversation and chat request."""

    def __init__(self, tm: TokenizerManager, store: ResponseStore, req: ResponsesRequest
                 ) -> None:
        self.id = new_id("resp")
        prior: list[dict[str, Any]] = []
        self.conversation_id = self.id
        if req.previous_response_id is not None:
            entry = store.get(req.previous_response_id)
            if entry is None:
                raise RequestError(
                    f"previous_response_id: no stored response {req.previous_response_id!r} "
                    f"(unknown, deleted, created with store=false, or expired: responses are "
                    f"kept {store.ttl_s:g} s after last use, at most {store.max_count})", 404)
            prior, self.conversation_id = entry.messages, entry.conversation_id
        new = items_to_messages(req.input)
        if not new:
            raise RequestError("input: no input items")
        self.messages = prior + new
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        body = {
            "model": req.model, "messages": system + self.messages,
            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "response_format": chat_response_format(req.text),
            "seed": req.seed, "top_k": req.top_k, "ignore_eos": req.ignore_eos,
            "stream": req.stream,
            "stream_options": {"include_usage": True}, "session_id": self.conversation_id,
        }
        try:
            self.chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise RequestError("invalid request: " + "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            ) from None
        self.response = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model or tm.served_model_name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": {"format": (req.text.format if req.text and req.text.format
                                else {"type": "text"})},
            "truncation": "disabled", "store": req.store, "metadata": req.metadata or {},
            "user": req.user, "usage": None,
        }

    def save(self, store: ResponseStore, final: dict[str, Any]) -> None:
        store.put(final, self.messages + [assistant_message(final["output"])],
                  self.conversation_id)


async def create_response(tm: TokenizerManager, store: ResponseStore, req: ResponsesRequest):
    turn = _Turn(tm, store, req)
    if req.stream:
        return await _stream(store, req, turn, chat_completion_chunks(tm, turn.chat))
    chat = await chat_completion(tm, turn.chat)
    choice = chat["choices"][0]
    final = {**turn.response, "status": "completed", "output": output_items(choice["message"]),
             "usage": usage(chat.get("usage"))}
    if choice["finish_reason"] == "length":
        final.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    if req.store:
        turn.save(store, final)
    return final


async def _stream(store: ResponseStore, req: ResponsesRequest, turn: _Turn,
                  chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    first = await anext(chunks, None)  # errors before the first token: a 4xx, not a stream
    events = ResponseEvents(turn.response)

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


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    store = app.state.response_store = ResponseStore(tm.args.responses_max_stored,
                                                     tm.args.responses_ttl_s)

    def not_found(rid: str):
        return error_response(f"no stored response {rid!r} (unknown, deleted, created with "
                              f"store=false, or expired)", 404, "NotFoundError")

    @app.post("/v1/responses")
    async def v1_responses(request: Request):
        req = await parse_body(request, ResponsesRequest)
        if (err := check_model(tm, req.model)) is not None:
            return err
        return await create_response(tm, store, req)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        entry = store.get(rid)
        return not_found(rid) if entry is None else entry.response

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if not store.delete(rid):
            return not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}
