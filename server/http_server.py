"""The FastAPI app: error handlers and middleware, then every route module's `add_routes`
(native `native_api.py`, OpenAI `openai_api.py`, embeddings `embeddings_api.py`, Responses
`responses_api.py`, Anthropic Messages `anthropic_api.py`, `/tokenize` and `/detokenize`
`tokenize_api.py`, Prometheus `metrics.py`), all on one `TokenizerManager`. Shared helpers are
in `http_common.py`.

Bad input never reaches the scheduler (see `http_common.py` for the layers of checks).
Routes `--api-key` guards (the key as `Authorization: Bearer KEY` or, as Anthropic's clients
send it, `x-api-key: KEY`): all but `/health` (the liveness probe: an empty 200 or a 503, it
reveals nothing and load balancers call it without credentials, as with SGLang). `/metrics`,
`/get_model_info` and `/server_info` need the key. An unexpected exception in a handler is a 500
whose body says only that (the traceback goes to the log, never paths or settings to clients).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl_tpu.server.body_limits import BodyError, BodyLimitMiddleware
from sgl_tpu.server.http_common import api_key_matches, bearer_matches, error_response_for
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead, TokenizerManager

logger = logging.getLogger("sgl_tpu.http")


class ApiKeyMiddleware:
    """`--api-key`: 401 for a request without the key (all routes but `/health` and CORS
    preflights). Plain ASGI, so a streamed response's chunks pass straight through (a
    `BaseHTTPMiddleware` would relay every SSE chunk through a memory stream and a task)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.key and scope["type"] == "http" and scope["path"] != "/health"
                and scope["method"] != "OPTIONS"):
            headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
                       if k.lower() in (b"authorization", b"x-api-key")}
            if not (bearer_matches(headers.get(b"authorization", ""), self.key)
                    or api_key_matches(headers.get(b"x-api-key", ""), self.key)):
                response = error_response_for(scope["path"], "invalid or missing API key", 401,
                                              "AuthenticationError")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    for stop in app.state.shutdown_hooks:  # before the launcher closes the sockets
        await stop()


def create_app(tm: TokenizerManager) -> FastAPI:
    app = FastAPI(title="sgl-tpu", lifespan=_lifespan)
    app.state.tm = tm
    app.state.shutdown_hooks = []  # coroutines run at shutdown, e.g. stopping background runs

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, e: RequestError) -> JSONResponse:
        return error_response_for(request.url.path, str(e), e.status_code)

    @app.exception_handler(ServerDead)
    async def _dead(request: Request, e: ServerDead) -> JSONResponse:
        return error_response_for(request.url.path, f"server unavailable: {e}", 503,
                                  "ServiceUnavailableError")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return error_response_for(request.url.path, "invalid request: " + "; ".join(parts), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response_for(request.url.path, str(e.detail), e.status_code)

    @app.exception_handler(BodyError)
    async def _body(request: Request, e: BodyError) -> JSONResponse:
        return error_response_for(request.url.path, str(e), e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response_for(request.url.path, f"internal server error "
                                  f"({type(e).__name__}); see the server log", 500)

    app.add_middleware(BodyLimitMiddleware, max_bytes=tm.args.max_request_bytes,
                       on_error=error_response_for)

    app.add_middleware(ApiKeyMiddleware, key=tm.args.api_key)

    # Middleware runs outermost-last-added: CORS (only with --allow-origins) answers
    # preflights, then the API key, then the body limits before any route reads a byte.
    if tm.args.allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(tm.args.allow_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])

    from sgl_tpu.server import (
        anthropic_api,
        embeddings_api,
        metrics,
        native_api,
        openai_api,
        responses_api,
        tokenize_api,
    )

    native_api.add_routes(app, tm)
    openai_api.add_routes(app, tm)
    tokenize_api.add_routes(app, tm)
    embeddings_api.add_routes(app, tm)
    responses_api.add_routes(app, tm)
    anthropic_api.add_routes(app, tm)
    metrics.add_routes(app, tm)
    return app
