"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Served on top of the chat path (`openai_chat.chat_completion` / `chat_completion_chunks` /
`prompt_ids`), so the template, tool calling, tool-call grammars and reasoning parser are the
chat route's:

    MessagesRequest ──chat_request──► ChatCompletionRequest (messages, tools, tool_choice,
                                      stop, priority, session from the X-SMG-Routing-Key
                                      header, cache_control TTLs as retention_seconds,
                                      metadata.user_id as the program)
    non-stream: chat.completion ──message_content / stop_reason / usage──► message object
    stream:     chat.completion.chunk ... ──MessageEvents──► Anthropic's SSE events

Errors on these routes take Anthropic's shape (`http_common.error_response_for`); an error
before the first token is a 4xx response, a later one an `error` event in the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from sgl_tpu.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    message,
    message_content,
    new_id,
    stop_reason,
    usage,
)
from sgl_tpu.server.anthropic_stream import MessageEvents
from sgl_tpu.server.http_common import log_identity, parse_body, session_hint, sse
from sgl_tpu.server.openai_api import model_error
from sgl_tpu.server.openai_chat import chat_completion, chat_completion_chunks, prompt_ids
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead, TokenizerManager

# The chat path's checks name chat fields; these are their names in a Messages request.
_FIELD_NAMES = ((".function.parameters", ".input_schema"), (".function.name", ".name"),
                ("tool_choice 'required'", "tool_choice 'any'"))


def _in_anthropic_terms(e: RequestError) -> RequestError:
    text = str(e)
    for chat_name, name in _FIELD_NAMES:
        text = text.replace(chat_name, name)
    return RequestError(text, e.status_code)


async def _request(tm: TokenizerManager, request: Request, model: type[CountTokensRequest]
                   ) -> tuple[Any, Any]:
    req = await parse_body(request, model)
    if (error := model_error(tm, req.model)) is not None:
        raise RequestError(error)
    log_identity(request, user_id=getattr(req, "user_id", None))
    return req, chat_request(req, session_hint(None, None, request), tm.args.max_retention_s)


async def create_message(tm: TokenizerManager, request: Request):
    req, chat = await _request(tm, request, MessagesRequest)
    msg_id = new_id("msg")
    if req.stream:
        return await _stream(req, MessageEvents(
            message(msg_id, req.model, [], None, None, usage(None)), req.stop_sequences),
            chat_completion_chunks(tm, chat))
    try:
        result = await chat_completion(tm, chat)
    except RequestError as e:
        raise _in_anthropic_terms(e) from None
    choice = result["choices"][0]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("matched_stop"),
                                   req.stop_sequences)
    return message(msg_id, req.model, message_content(choice["message"]), reason, sequence,
                   usage(result["usage"]))


async def _stream(req: MessagesRequest, events: MessageEvents,
                  chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    try:
        first = await anext(chunks, None)  # errors before the first token: a 4xx, not a stream
    except RequestError as e:
        raise _in_anthropic_terms(e) from None

    async def body() -> AsyncIterator[bytes]:
        try:
            for event in events.start(first) + (events.feed(first) if first else []):
                yield sse(event, event["type"])
            async for chunk in chunks:
                for event in events.feed(chunk):
                    yield sse(event, event["type"])
            for event in events.finish():
                yield sse(event, event["type"])
        except (RequestError, ServerDead) as e:
            for event in events.failed(str(e), getattr(e, "status_code", 503)):
                yield sse(event, event["type"])
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


async def count_tokens(tm: TokenizerManager, request: Request) -> dict[str, int]:
    _, chat = await _request(tm, request, CountTokensRequest)
    try:
        return {"input_tokens": len(prompt_ids(tm, chat))}
    except RequestError as e:
        raise _in_anthropic_terms(e) from None


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/v1/messages")
    async def v1_messages(request: Request):
        return await create_message(tm, request)

    @app.post("/v1/messages/count_tokens")
    async def v1_count_tokens(request: Request):
        return await count_tokens(tm, request)
