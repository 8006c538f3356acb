"""HTTP helpers shared by every route module (native, OpenAI, Responses, metrics): the error
body, JSON body parsing into a pydantic model, SSE framing, collecting results, the API-key
check, the agent-session hint, the debug log of client identifiers. Route modules import this;
nothing here imports a route module.

Every error is JSON `{"error": {"message", "type", "code"}}` with a 4xx/5xx status, except on
the Anthropic routes (`/v1/messages...`), whose errors take Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` (`error_response_for` picks by path). Bodies are
checked in layers: size and content type by `BodyLimitMiddleware`, JSON syntax, depth, strings
and integer ranges by `parse_json` (`body_limits.py`), field types by the pydantic models,
values by `TokenizerManager.validate`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import os
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from sgl_tpu.server.body_limits import BodyError, parse_json, printable
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, TokenizerManager
from sgl_tpu.validation import check_session_id

logger = logging.getLogger(__name__)


def error_response(message: str, status_code: int = 400, err_type: str | None = None
                   ) -> JSONResponse:
    err_type = err_type or ("BadRequestError" if status_code < 500 else "InternalServerError")
    message = printable(message)  # a message may quote user input
    return JSONResponse({"object": "error", "error": {"message": message, "type": err_type,
                                                      "code": status_code},
                         "message": message, "code": status_code}, status_code=status_code)


# Anthropic's error types by HTTP status (other 4xx: invalid_request_error, other 5xx: api_error).
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large",
                         429: "rate_limit_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(message: str, status_code: int) -> dict[str, Any]:
    default = "invalid_request_error" if status_code < 500 else "api_error"
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status_code, default),
                                       "message": printable(message)}}


def error_response_for(path: str, message: str, status_code: int = 400,
                       err_type: str | None = None) -> JSONResponse:
    """The error in the shape of the API that `path` belongs to."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return JSONResponse(anthropic_error_body(message, status_code), status_code=status_code)
    return error_response(message, status_code, err_type)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """JSON body -> `model`; errors become 4xx naming the field (the content type and size
    were checked by `BodyLimitMiddleware`)."""
    try:
        data = parse_json(await request.body())
    except BodyError as e:
        raise RequestError(str(e), e.status_code) from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    # Validation costs microseconds per invalid list item (and a message listing every one
    # would be megabytes), so a copy with every list cut to its first items is validated first:
    # long lists of junk are refused for the price of a few items, with a short message.
    for candidate, whole in ((_truncated(data), False), (data, True)):
        try:
            validated = model.model_validate(candidate)
        except ValidationError as e:
            raise RequestError(_validation_message(e, whole)) from None
    return validated


# The sglang-router forwards this header unchanged (its `manual` policy pins each key to one
# worker) while it drops a top-level `session_id` when it re-serialises a body.
ROUTING_KEY_HEADER = "x-smg-routing-key"


def session_hint(session_id: Any, session_params: Any, request: Request,
                 prompt_cache_key: Any = None) -> Any:
    """The agent session a request belongs to (a KV retention hint, see
    `KVManager.retain_prefix`), from the first of: the body's `session_id`, SGLang's
    `session_params.id`, OpenAI's `prompt_cache_key`, the `X-SMG-Routing-Key` header; the
    header is what the sglang-router routes on (`--router-policy manual`), and it and
    `session_params.id` survive the router. `session_params` may be one object or a list with
    one per prompt (then a list comes back); the values are checked later by
    `check_session_id`."""
    if session_id is not None:
        return session_id
    if isinstance(session_params, list):
        return [_params_id(p, f"session_params[{i}]") for i, p in enumerate(session_params)]
    if session_params is not None:
        return _params_id(session_params, "session_params")
    if prompt_cache_key is not None:
        return checked_cache_key(prompt_cache_key)
    return request.headers.get(ROUTING_KEY_HEADER)


def checked_cache_key(prompt_cache_key: str) -> str:
    """OpenAI's `prompt_cache_key` as a session id (RequestError naming the field)."""
    if (error := check_session_id(prompt_cache_key, "prompt_cache_key")) is not None:
        raise RequestError(error)
    return prompt_cache_key


def log_identity(request: Request, **ids: Any) -> None:
    """Client identifiers (OpenAI's `user` / `safety_identifier`, Anthropic's
    `metadata.user_id`) at debug level, as `log_digest`s: accepted and logged, never used for
    routing or retention."""
    named = {k: v for k, v in ids.items() if v is not None}
    if named and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s", request.url.path,
                     " ".join(f"{k}={log_digest(str(v))}" for k, v in named.items()))


@functools.cache
def _log_secret() -> bytes:
    return os.urandom(32)


def log_digest(value: str) -> str:
    """A client's key or identifier as a log shows it: an HMAC-SHA256 under a random secret of
    this process, truncated (lines of one client correlate; the string, a capability for
    some keys such as a response id, never leaves the server)."""
    digest = hmac.new(_log_secret(), value.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest()[:16]


def _params_id(params: Any, name: str) -> Any:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise RequestError(f"{name} must be an object")
    return params.get("id")


_VALIDATION_ITEMS = 16  # list items validated before the whole body is
_MAX_REPORTED_ERRORS = 5


def _truncated(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _truncated(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_truncated(v) for v in value[:_VALIDATION_ITEMS]]
    return value


def _validation_message(e: ValidationError, whole: bool) -> str:
    count = e.error_count()
    if whole and count > 10 * _MAX_REPORTED_ERRORS:  # listing them would cost more than it says
        return (f"invalid request: {count} validation errors in list items beyond the first "
                f"{_VALIDATION_ITEMS}")
    parts = []
    for err in e.errors(include_url=False, include_input=False)[:_MAX_REPORTED_ERRORS]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = f" (and {count - len(parts)} more)" if count > len(parts) else ""
    return "invalid request: " + "; ".join(parts) + more


async def collect(tm: TokenizerManager, item: GenItem) -> dict[str, Any]:
    result = None
    async for out in tm.generate(item, final_only=True):
        result = out
    assert result is not None
    return result


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (after `event: <name>` when named). orjson, since
    a stream encodes one per token (it writes non-finite floats as null, valid JSON where the
    standard encoder writes NaN); what it refuses (an int beyond 64 bits) goes through the
    standard encoder."""
    try:
        body = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        body = json.dumps(data, ensure_ascii=False).encode()
    head = b"data: " if event is None else f"event: {event}\ndata: ".encode()
    return head + body + b"\n\n"


def bearer_matches(header: str, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme case-insensitive (RFC 7235), the key compared in
    constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def api_key_matches(header: str, key: str) -> bool:
    """`x-api-key: KEY` (how Anthropic's clients send the key), compared in constant time."""
    return bool(header) and hmac.compare_digest(header.strip().encode(), key.encode())


async def gather_results(tm: TokenizerManager, items: list[GenItem]) -> list[dict[str, Any]]:
    tasks = [asyncio.ensure_future(collect(tm, it)) for it in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
