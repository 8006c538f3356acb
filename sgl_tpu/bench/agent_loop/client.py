"""One streamed request over HTTP -> RequestRecord (the only module here that does network I/O).

Errors never escape: an HTTP status other than 200, an error event inside the stream, a stream
that ends before its answer did, or a connection failure all become `record.error`, so one bad
request fails its program and the run goes on. Token counts the server did not send are
counted with the model's tokenizer (`count_tokens`) and marked so in the record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp

from sgl_tpu.bench.agent_loop.drivers import (
    DONE,
    Driver,
    DriverOptions,
    GenRequest,
    StreamError,
    StreamState,
    parse_sse_line,
)
from sgl_tpu.bench.agent_loop.tools import check_call
from sgl_tpu.bench.agent_loop.trace import RequestRecord

ERROR_BODY_CHARS = 300


class Client:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, driver: Driver,
                 opts: DriverOptions, count_tokens: Callable[[str], int],
                 clock: Callable[[], float] = time.perf_counter,
                 api_key: str | None = None) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + driver.path
        self.driver = driver
        self.opts = opts
        self.count_tokens = count_tokens
        self.clock = clock
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _stream(self, req: GenRequest, state: StreamState) -> None:
        body = self.driver.body(req, self.opts)
        headers = self.headers
        if req.session_id is not None:  # survives SGLang's router, which drops `session_id`
            headers = {**headers, "X-SMG-Routing-Key": req.session_id}
        async with self.session.post(self.url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:ERROR_BODY_CHARS]
                raise StreamError(f"HTTP {resp.status}: {text}")
            done = False
            async for line in resp.content:
                data = parse_sse_line(line)
                if data is DONE:
                    done = True
                    break
                if isinstance(data, dict):
                    self.driver.update(state, data, self.clock())
            if not done and state.finish_reason is None:
                raise StreamError("stream ended before the answer was complete")

    async def send(self, req: GenRequest, program_id: str, step: int, branch: int
                   ) -> RequestRecord:
        state = StreamState()
        start = self.clock()
        error = None
        try:
            self.driver.check(req)
            await self._stream(req, state)
        except (StreamError, aiohttp.ClientError, asyncio.TimeoutError,
                ValueError) as e:  # ValueError: bad JSON or UTF-8 in the stream, or no tools
            error = f"{type(e).__name__}: {e}" if not isinstance(e, StreamError) else str(e)
        end = self.clock()
        record = RequestRecord(program_id, step, branch, start, end, state.chunk_times,
                               state.chunk_tokens, text=state.text, error=error,
                               constrained=req.json_schema is not None,
                               cached_tokens=state.cached_tokens,
                               tool_request=bool(req.tools), tool_calls=state.tool_calls)
        record.invalid_tool_calls = sum(check_call(c, req.tools) is not None
                                        for c in state.tool_calls)
        if state.prompt_tokens is not None:
            record.prompt_tokens = state.prompt_tokens
        else:
            record.prompt_tokens = self.count_tokens(req.prompt)
            record.prompt_tokens_source = "tokenizer"
        if state.completion_tokens is not None:
            record.completion_tokens = state.completion_tokens
        else:
            record.completion_tokens = self.count_tokens(state.text)
            record.completion_tokens_source = "tokenizer"
        if record.constrained and record.ok:
            try:
                json.loads(state.text)
                record.valid_json = True
            except json.JSONDecodeError:
                record.valid_json = False
        return record
