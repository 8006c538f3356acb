"""What an HTTP request body must be before any handler reads it, checked once at the edge.

    ASGI request ──BodyLimitMiddleware──► route handler ──parse_json()──► pydantic model
                   415 not application/json         400 invalid JSON, NaN/Infinity,
                   413 more than max_request_bytes       nested deeper than MAX_JSON_DEPTH,
                                                          a lone surrogate in a string,
                                                          an integer beyond 64 bits

The middleware works on the raw ASGI stream, so an oversized body is refused after at most
`max_request_bytes` are read (a lying or absent Content-Length included). Requiring
`application/json` on every body keeps browsers honest: a page on another origin can send
`text/plain`, form or typeless bodies without a CORS preflight, never JSON.

After parsing, one iterative walk over the value rejects what would otherwise fail much later
in another process (a surrogate cannot be UTF-8 encoded for IPC; msgpack holds 64-bit integers
at most), naming the offending field.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_JSON_DEPTH = 64  # objects/arrays nested deeper than this are refused
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what msgpack (the IPC encoding) can carry
_JSON_TYPES = ("application/json",)


class BodyError(ValueError):
    """A request body refused before parsing or by `parse_json`; `status_code` says how."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def is_json_content_type(value: str) -> bool:
    """`application/json` or `application/<anything>+json`, parameters (charset) ignored."""
    media = value.split(";", 1)[0].strip().lower()
    return media in _JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


def _reject_constant(name: str) -> Any:
    raise BodyError(f"request body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """Bytes -> JSON value, or BodyError (400) naming the problem."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep"
                        ) from None
    check_json_value(data)
    return data


def check_json_value(data: Any) -> None:
    """Depth, strings and integers of a parsed JSON value; BodyError names the first bad field.

    Iterative (an explicit stack), so depth is measured without recursing."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise BodyError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
            if isinstance(value, dict):
                for key, item in value.items():
                    sub = f"{path}.{key}" if path else str(key)
                    _check_str(key, sub)
                    stack.append((item, sub, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_str(value, path)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT_MIN <= value <= INT_MAX:
                raise BodyError(f"{path or 'body'}: integer out of the 64-bit range")


def _check_str(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(f"{_shown(path)}: string is not valid Unicode (a lone surrogate "
                        "escape such as \\ud800)") from None


def _shown(path: str) -> str:
    path = printable(path or "body")
    return path if len(path) <= 80 else path[:77] + "..."


def printable(text: str) -> str:
    """`text` with lone surrogates escaped (`\\ud800`), so it can go into a JSON response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class BodyLimitMiddleware:
    """Refuse bodies that are too large (413) or not JSON (415) before a route reads them."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Any) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error  # (path, message, status) -> ASGI response (the error shape)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        has_body = "transfer-encoding" in headers or (length not in (None, "0"))
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send, 413,
                               f"request body is larger than {self.max_bytes} bytes")
            return
        if has_body and not is_json_content_type(headers.get("content-type", "")):
            got = headers.get("content-type") or "none"
            await self._refuse(scope, receive, send, 415,
                               f"Content-Type must be application/json, got {got[:80]}")
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the route's handler answers 413
                    raise BodyError(f"request body is larger than {self.max_bytes} bytes", 413)
            return message

        await self.app(scope, limited_receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str) -> None:
        response = self.on_error(scope["path"], message, status)
        await response(scope, receive, send)
