"""API drivers: one request -> the JSON body of an API, and its streamed events -> StreamState.

    GenRequest --Driver.body--> POST base_url + Driver.path (stream: true)
    "data: {...}" lines --parse_sse_line--> dicts --Driver.update--> StreamState

Drivers do no I/O (client.py does), so tests feed them recorded bytes. Registry: DRIVERS.

| api                | prompt sent              | counts from the server                  |
|--------------------|--------------------------|-----------------------------------------|
| native             | `text` (template applied | meta_info: prompt, completion, cached   |
|                    |  by the harness)         |   tokens in every event                 |
| openai-completions | `prompt` (same text)     | `usage` chunk when the server sends one |
| openai-chat        | `messages`               | `usage` chunk when the server sends one |

Comparable work: with `output_mode="fixed"` every unconstrained request asks for exactly
`max_tokens` tokens (`ignore_eos` and `min_tokens`/`min_new_tokens`; llama.cpp honours
`min_tokens`) and sends no stop strings; `"natural"` sends the workload's stop strings and lets
the model stop. Constrained requests always end where the grammar ends.

Structured output per dialect (`json_dialect`): "openai" (sgl-tpu, SGLang) sends
`sampling_params.json_schema` (native), the SGLang extension field `json_schema` (completions),
`response_format: {"type": "json_schema", ...}` (chat); "llamacpp" sends a GBNF `grammar`
(completions) or `response_format: {"type": "json_object", "schema": ...}` (chat), since
llama.cpp answers HTTP 500 to OpenAI's `json_schema` form.

`priority` (mixed traffic, mixed.py) goes as a top-level body field on every API (SGLang's
name; servers that do not schedule by it ignore it).

Function tools (the `tool-calls` workload) exist only in the chat API: the body carries `tools`,
`tool_choice` and `parallel_tool_calls: false` (one call per agent turn); streamed
`delta.tool_calls` fragments are joined per call `index` into `StreamState.tool_calls`, and
such requests are never length-forced (a call ends where its JSON does). The llama.cpp dialect
sends an assistant turn that only made calls with `content: ""` (it refuses OpenAI's null).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sgl_tpu.bench.agent_loop.gbnf import schema_to_gbnf

OUTPUT_MODES = ("fixed", "natural")
JSON_DIALECTS = ("openai", "llamacpp")
DONE = object()  # what parse_sse_line returns for `data: [DONE]`


class StreamError(RuntimeError):
    """An error event inside a stream (the HTTP status was already 200)."""


@dataclass
class GenRequest:
    messages: list[dict[str, Any]]
    prompt: str  # `messages` rendered with the chat template, ending in the generation prompt
    max_tokens: int
    stop: tuple[str, ...] = ()
    json_schema: dict[str, Any] | None = None
    seed: int = 0
    session_id: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    priority: int | None = None  # SGLang's `priority` field (None: not sent)


@dataclass(frozen=True)
class DriverOptions:
    output_mode: str = "fixed"
    temperature: float = 0.0
    json_dialect: str = "openai"
    model: str | None = None  # the OpenAI `model` field (None: omitted)

    def __post_init__(self) -> None:
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}")
        if self.json_dialect not in JSON_DIALECTS:
            raise ValueError(f"json_dialect must be one of {JSON_DIALECTS}")


@dataclass
class StreamState:
    """What one streamed answer has delivered so far; times are seconds on the run clock."""

    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output
    chunk_tokens: list[int] = field(default_factory=list)  # generated tokens after each chunk
    prompt_tokens: int | None = None  # as reported by the server
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {id, name, arguments}

    def add_chunk(self, t: float, num_tokens: int) -> None:
        self.chunk_times.append(t)
        self.chunk_tokens.append(num_tokens)


def parse_sse_line(line: bytes | str) -> dict[str, Any] | object | None:
    """One SSE line -> its JSON payload, DONE, or None (blank, comment or non-data line)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    data = json.loads(payload)
    if isinstance(data, dict) and "error" in data and not data.get("choices"):
        err = data["error"]
        raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    return data


def _length_fields(req: GenRequest, opts: DriverOptions, min_key: str) -> dict[str, Any]:
    if req.json_schema is not None or req.tools:
        return {}
    if opts.output_mode == "fixed":
        return {"ignore_eos": True, min_key: req.max_tokens}
    return {"stop": list(req.stop)} if req.stop else {}


class Driver:
    api: str
    path: str
    supports_tools = False

    def body(self, req: GenRequest, opts: DriverOptions) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, req: GenRequest) -> None:
        if req.tools and not self.supports_tools:
            raise ValueError(f"function tools need the openai-chat API, not {self.api}")

    def update(self, state: StreamState, data: dict[str, Any], t: float) -> None:
        raise NotImplementedError


class NativeDriver(Driver):
    """SGLang's /generate: every event carries the cumulative text and meta_info."""

    api, path = "native", "/generate"

    def body(self, req: GenRequest, opts: DriverOptions) -> dict[str, Any]:
        self.check(req)
        # `sampling_seed`: SGLang's native name, the one its router keeps
        sp: dict[str, Any] = {"max_new_tokens": req.max_tokens, "temperature": opts.temperature,
                              "sampling_seed": req.seed,
                              **_length_fields(req, opts, "min_new_tokens")}
        if req.json_schema is not None:
            sp["json_schema"] = json.dumps(req.json_schema)
        body: dict[str, Any] = {"text": req.prompt, "sampling_params": sp, "stream": True}
        if req.session_id is not None:
            body["session_id"] = req.session_id
        if req.priority is not None:
            body["priority"] = req.priority
        return body

    def update(self, state: StreamState, data: dict[str, Any], t: float) -> None:
        meta = data.get("meta_info") or {}
        state.text = data.get("text", state.text)
        before = state.completion_tokens or 0
        state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
        state.completion_tokens = meta.get("completion_tokens", state.completion_tokens)
        state.cached_tokens = meta.get("cached_tokens", state.cached_tokens)
        reason = meta.get("finish_reason")
        if reason is not None:
            state.finish_reason = reason.get("type") if isinstance(reason, dict) else str(reason)
            if state.finish_reason == "abort":
                raise StreamError((reason.get("message") if isinstance(reason, dict) else None)
                                  or "request aborted")
        if (state.completion_tokens or 0) > before:
            state.add_chunk(t, state.completion_tokens or 0)


class _OpenAIDriver(Driver):
    """OpenAI SSE: text deltas in `choices[0]`, then (if the server sends one) a usage chunk."""

    def _common(self, req: GenRequest, opts: DriverOptions) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": opts.temperature,
                                "seed": req.seed, "stream": True,
                                "stream_options": {"include_usage": True},
                                **_length_fields(req, opts, "min_tokens")}
        if opts.model is not None:
            body["model"] = opts.model
        if req.session_id is not None:
            body["session_id"] = req.session_id
        if req.priority is not None:
            body["priority"] = req.priority
        return body

    @staticmethod
    def _delta(choice: dict[str, Any]) -> str:
        raise NotImplementedError

    @staticmethod
    def _tool_deltas(state: StreamState, choice: dict[str, Any]) -> bool:
        """Join `delta.tool_calls` fragments into state.tool_calls; True if any arrived."""
        return False

    def update(self, state: StreamState, data: dict[str, Any], t: float) -> None:
        usage = data.get("usage")
        if usage:
            state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
            state.completion_tokens = usage.get("completion_tokens", state.completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                state.cached_tokens = details["cached_tokens"]
        timings = data.get("timings")  # llama-server: prompt tokens reused from its cache
        if timings and timings.get("cache_n") is not None and state.cached_tokens is None:
            state.cached_tokens = timings["cache_n"]
        for choice in data.get("choices") or []:
            delta = self._delta(choice) or ""
            state.text += delta
            if self._tool_deltas(state, choice) or delta:
                # one chunk ~ one token until the usage chunk gives the real count
                state.add_chunk(t, len(state.chunk_times) + 1)
            if choice.get("finish_reason"):
                state.finish_reason = choice["finish_reason"]


class CompletionsDriver(_OpenAIDriver):
    api, path = "openai-completions", "/v1/completions"

    def body(self, req: GenRequest, opts: DriverOptions) -> dict[str, Any]:
        self.check(req)
        body = {"prompt": req.prompt, **self._common(req, opts)}
        if req.json_schema is not None:
            if opts.json_dialect == "llamacpp":
                body["grammar"] = schema_to_gbnf(req.json_schema)
            else:
                body["json_schema"] = json.dumps(req.json_schema)
        return body

    @staticmethod
    def _delta(choice: dict[str, Any]) -> str:
        return choice.get("text") or ""


class ChatDriver(_OpenAIDriver):
    api, path = "openai-chat", "/v1/chat/completions"
    supports_tools = True

    def body(self, req: GenRequest, opts: DriverOptions) -> dict[str, Any]:
        messages = req.messages
        if opts.json_dialect == "llamacpp":  # it refuses an assistant turn with null content
            messages = [m if m.get("content") is not None else {**m, "content": ""}
                        for m in messages]
        body = {"messages": messages, **self._common(req, opts)}
        if req.tools:
            body["tools"] = list(req.tools)
            body["tool_choice"] = req.tool_choice or "auto"
            body["parallel_tool_calls"] = False  # the workload's agents act one call per turn
        if req.json_schema is not None:
            if opts.json_dialect == "llamacpp":
                body["response_format"] = {"type": "json_object", "schema": req.json_schema}
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "tool_call", "schema": req.json_schema, "strict": True}}
        return body

    @staticmethod
    def _delta(choice: dict[str, Any]) -> str:
        return (choice.get("delta") or {}).get("content") or ""

    @staticmethod
    def _tool_deltas(state: StreamState, choice: dict[str, Any]) -> bool:
        fragments = (choice.get("delta") or {}).get("tool_calls") or []
        for frag in fragments:
            index = frag.get("index", len(state.tool_calls))
            while len(state.tool_calls) <= index:
                state.tool_calls.append({"id": "", "name": "", "arguments": ""})
            call = state.tool_calls[index]
            fn = frag.get("function") or {}
            call["id"] = frag.get("id") or call["id"]
            # OpenAI sends the name once, in a call's first delta; some servers (llama.cpp)
            # repeat it in every delta, so the first one is kept, never appended to.
            call["name"] = call["name"] or fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
        return bool(fragments)


DRIVERS: dict[str, Driver] = {d.api: d for d in (NativeDriver(), CompletionsDriver(),
                                                  ChatDriver())}
