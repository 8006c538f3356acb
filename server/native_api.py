"""SGLang's native API (see shared docs `sglang-native-api.md`): `/generate` (single or batch,
text or ids, streaming, log-probs), `/health`, `/health_generate`, `/get_model_info`,
`/model_info`, `/server_info` (`/get_server_info`), `/get_load`, `/flush_cache`,
`/abort_request`, `/open_session`, `/close_session`, `/kv_hints`.

    body ──parse_body──► GenerateReqInput ──expand_generate──► GenItems (one per prompt x n)
        ──tm.validate──► tm.generate ──► one dict per item, or SSE chunks (one item)
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from sgl_tpu.messages import KvHintAction
from sgl_tpu.response import incremental_logprobs
from sgl_tpu.sampling_params import expand_n
from sgl_tpu.server.body_limits import BodyError, parse_json
from sgl_tpu.server.http_common import (
    collect,
    error_response,
    gather_results,
    parse_body,
    session_hint,
    sse,
)
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, ServerDead, TokenizerManager
from sgl_tpu.validation import MAX_SESSION_ID_LEN, check_batch_size

MAX_N = 64  # most samples per prompt (SamplingParams' bound)


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    # (None, as SGLang's frontend `Runtime.generate` sends when unset: the default)
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # An agent's session: its KV is kept at eviction priority between turns. One for all
    # prompts, or a list with one per prompt (None entries allowed). Without it, SGLang's
    # `session_params.id` or the X-SMG-Routing-Key header name the session (`session_hint`).
    session_id: str | list[str | None] | None = None
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    # Cache control (scheduler/retention.py), each one value or one per prompt: the KV's
    # eviction priority (SGLang's field; --radix-eviction-policy priority), a retention pin in
    # seconds (at most --max-retention-s), and the hint that the turn ends in a tool call (its
    # KV is pinned for --tool-pause-grace-s).
    priority: StrictInt | list[StrictInt | None] | None = None
    retention_seconds: StrictInt | StrictFloat | list[StrictInt | StrictFloat | None] | None = None
    tool_pause: StrictBool | list[StrictBool] = False
    # LoRA (SGLang's field): the name of a loaded adapter, one for all prompts or one per prompt
    # (None: the base model)
    lora_path: str | list[str | None] | None = None


class OpenSessionInput(BaseModel):
    """SGLang's `OpenSessionReqInput`; `capacity_of_str_len` is accepted and unused (a session
    here pins KV, it does not keep the text)."""

    model_config = ConfigDict(extra="ignore")

    capacity_of_str_len: StrictInt | None = None
    session_id: str | None = None
    streaming: bool | None = None
    timeout: StrictInt | StrictFloat | None = None  # seconds; None: --session-ttl-s


class LoadLoraInput(BaseModel):
    """SGLang's `LoadLoRAAdapterReqInput` (`pinned` is accepted: every adapter stays loaded
    until unloaded)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


class CloseSessionInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str


class KvHintPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # seconds the pin of a retain (default 5) or prefetch (default: the program's pause window)
    # lasts; more than --max-retention-s is clipped
    ttl_seconds: StrictInt | StrictFloat | None = Field(None, gt=0, allow_inf_nan=False)


class KvHintActionInput(BaseModel):
    """One action of a `kv_hints` envelope (SGLang #36224's `KvHintAction`)."""

    model_config = ConfigDict(extra="ignore")

    action_id: str = Field(min_length=1, max_length=256)
    action_type: Literal["retain", "prefetch", "release"]
    action_version: Literal["0.1"]
    payload: KvHintPayload = KvHintPayload()


class KvHintsEnvelope(BaseModel):
    """SGLang #36224's `kv_hints` envelope; only protocol_version 0.1 is understood."""

    model_config = ConfigDict(extra="ignore")

    protocol_version: Literal["0.1"]
    message_id: str = Field(min_length=1, max_length=256)
    actions: list[KvHintActionInput] = Field(min_length=1, max_length=16)


class KvHintsInput(BaseModel):
    """/kv_hints: hints about one program's KV (its session_id, or its program key)."""

    model_config = ConfigDict(extra="ignore")

    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LEN)
    kv_hints: KvHintsEnvelope


def _pick(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


# GenerateReqInput's fields that the request (`messages.TokenizedGenerateReq`) takes by the
# same name; a None value (or list entry) leaves the request's default.
_REQ_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
               "return_text_in_logprobs", "priority", "retention_seconds", "tool_pause")
# LoRA: the adapter's name, resolved to its id by `TokenizerManager.validate`
_PER_PROMPT_FIELDS = ("sampling_params", "rid", "session_id", "session_params", "lora_path",
                      *_REQ_FIELDS)


async def expand_generate(tm: TokenizerManager, req: GenerateReqInput, request: Request
                          ) -> tuple[list[GenItem], bool]:
    """Native request -> GenItems (n > 1 becomes n items); returns (items, is_batch)."""
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("exactly one of text and input_ids must be given")
    if req.text is not None:
        batch = isinstance(req.text, list)
        texts = req.text if batch else [req.text]
        num_prompts = len(texts)
    else:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        if batch and not all(isinstance(p, list) for p in req.input_ids):
            raise RequestError("input_ids must be a list of ids or a list of such lists")
        num_prompts = len(req.input_ids) if batch else 1
    if batch and not num_prompts:
        raise RequestError("the batch is empty")
    if (error := check_batch_size(num_prompts)) is not None:
        raise RequestError(error)
    for name in _PER_PROMPT_FIELDS:  # a list gives one value per prompt
        value = getattr(req, name)
        if isinstance(value, list) and len(value) != num_prompts:
            raise RequestError(f"{name} has {len(value)} entries for {num_prompts} prompt(s)")
    if req.text is not None:
        prompts = [await tm.tokenize_async(t) for t in texts]
    else:
        prompts = req.input_ids if batch else [req.input_ids]
    session = session_hint(req.session_id, req.session_params, request)
    items = []
    for i, ids in enumerate(prompts):
        sp = dict(_pick(req.sampling_params, i) or {})
        n = sp.get("n", 1)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
        rid = _pick(req.rid, i) if req.rid is not None else None
        fields = {name: value for name in _REQ_FIELDS
                  if (value := _pick(getattr(req, name), i)) is not None}
        for k, spk in enumerate(expand_n(sp, n)):
            items.append(GenItem(list(ids), spk, session_id=_pick(session, i), **fields,
                                 rid=rid if rid is None or n == 1 else f"{rid}-{k}",
                                 lora_path=_pick(req.lora_path, i)))
        if (error := check_batch_size(len(items))) is not None:
            raise RequestError(error)
    return items, batch or len(items) > 1


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.get("/health")
    async def health() -> Response:
        if tm.dead_reason:
            return error_response(tm.dead_reason, 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        item = GenItem(input_ids=tm.tokenize("ping"),
                       sampling={"max_new_tokens": 1, "temperature": 0})
        await collect(tm, item)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        # SGLang's frontend (`sgl.RuntimeEndpoint`) picks its chat template by regex on
        # `model_path` alone, and maps plain ChatML only from "tinyllama"; any other path it does
        # not know (SmolLM2, the default model) gets the "USER:/ASSISTANT:" default template,
        # which the model was never trained on. So a model whose own template is ChatML, at a
        # path the frontend would not map to a ChatML-family template, is reported with a
        # "#chatml-tinyllama" suffix; the real path stays in `tokenizer_path`/`real_model_path`.
        path = tm.args.model_path or tm.model_path
        reported = path
        frontend_chatml = (r"tinyllama|qwen.*(chat|instruct|vl)|yi-1\.5.*chat|yi-vl|llava"
                           r"|dbrx.*instruct|internvl2_5|intern-?s1")
        if ("<|im_start|>" in (tm.tokenizer.chat_template or "")
                and not re.search(frontend_chatml, path, re.IGNORECASE)):
            reported = f"{path}#chatml-tinyllama"
        return {"model_path": reported, "tokenizer_path": path, "real_model_path": path,
                "is_generation": True, "preferred_sampling_params": None,
                "served_model_name": tm.served_model_name, "weight_version": "default",
                "reasoning_parser": tm.args.reasoning_parser,
                "tool_call_parser": tm.args.tool_call_parser,
                "has_image_understanding": False, "has_audio_understanding": False}

    async def _server_info() -> dict[str, Any]:
        resp = await tm.control("server_info")
        args = {k: v for k, v in vars(tm.args).items() if k != "api_key"}
        # The resolved model, not the flags' None: the sglang-router reads both on registration.
        args.update(model_path=tm.model_path, served_model_name=tm.served_model_name)
        # One replica (a `--dp-size` launcher runs each as its own server) of tp_size ranks.
        args.update(tp_size=tm.args.tp_size, dp_size=1)
        return {**args, **resp.data, "version": "0.1.0", "context_len": tm.context_len,
                "uptime_s": _uptime(tm)}

    app.get("/server_info")(_server_info)
    app.get("/get_server_info")(_server_info)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's load report, one entry per DP rank (one here); the sglang-router's
        `power_of_two` policy polls it."""
        resp = await tm.control("get_load")
        return [{"dp_rank": 0, **resp.data, "ts_tic": time.perf_counter()}]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        resp = await tm.control("flush_cache")
        if not resp.ok:
            return error_response("cache not flushed: requests are still running", 400)
        return PlainTextResponse("Cache flushed.\n")

    @app.api_route("/open_session", methods=["GET", "POST"])
    async def open_session(request: Request) -> Any:
        """SGLang's answer: the session's id as a JSON string."""
        req = await parse_body(request, OpenSessionInput)
        if req.streaming:
            raise RequestError("streaming sessions are not supported")
        return await tm.open_session(req.session_id, req.timeout)

    @app.api_route("/close_session", methods=["GET", "POST"])
    async def close_session(request: Request) -> Response:
        req = await parse_body(request, CloseSessionInput)
        await tm.close_session(req.session_id)
        return Response(status_code=200)

    @app.post("/kv_hints")
    async def kv_hints(request: Request) -> Any:
        """Retain, prefetch or release one program's KV (scheduler/prefetch.py): the outcome
        of each action, accepted, clipped, deferred or missing (hints are advice)."""
        req = await parse_body(request, KvHintsInput)
        actions = [KvHintAction(action_id=a.action_id, action_type=a.action_type,
                                ttl_s=None if a.payload.ttl_seconds is None
                                else float(a.payload.ttl_seconds))
                   for a in req.kv_hints.actions]
        return {"message_id": req.kv_hints.message_id,
                "results": await tm.kv_hints(req.session_id, actions)}

    async def lora_update(call) -> Response:
        """SGLang's `LoRAUpdateOutput`: {success, error_message, loaded_adapters (name ->
        folder)}; a refusal is a 400 of that shape."""
        try:
            await call
        except RequestError as e:
            return JSONResponse({"success": False, "error_message": str(e),
                                 "loaded_adapters": _loaded(tm)}, status_code=e.status_code)
        return JSONResponse({"success": True, "error_message": None,
                             "loaded_adapters": _loaded(tm)})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, LoadLoraInput)
        return await lora_update(tm.load_lora(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, UnloadLoraInput)
        return await lora_update(tm.unload_lora(req.lora_name))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = parse_json(await request.body())
        except BodyError as e:
            raise RequestError(str(e), e.status_code) from None
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise RequestError("abort_request needs a string rid")
        await tm.abort(rid)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        req = await parse_body(request, GenerateReqInput)
        items, batch = await expand_generate(tm, req, request)
        for item in items:
            tm.validate(item)
        if req.stream:
            if len(items) != 1:
                raise RequestError("stream=true takes a single prompt with n=1")
            gen = tm.generate(items[0])
            first = await anext(gen)  # errors before streaming starts become a 4xx

            async def events() -> AsyncIterator[bytes]:
                num_sent = 0  # output log-prob entries already streamed

                def event(chunk: dict[str, Any]) -> bytes:
                    nonlocal num_sent
                    out = incremental_logprobs(chunk, num_sent)
                    num_sent = chunk["meta_info"].get("output_token_logprobs_length", 0)
                    return sse(out)

                # A client that disconnects cancels this generator (StreamingResponse listens
                # for it, or its send fails); `finally` then aborts the request. No per-chunk
                # `is_disconnected()`: it was ~1/5 of this process's CPU per streamed token.
                try:
                    yield event(first)
                    async for chunk in gen:
                        yield event(chunk)
                except (RequestError, ServerDead) as e:
                    yield sse({"error": {"message": str(e)}})
                finally:
                    await gen.aclose()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await gather_results(tm, items)
        return results if batch else results[0]


def _loaded(tm: TokenizerManager) -> dict[str, str]:
    return {name: a["path"] for name, a in sorted(tm.lora_adapters.items())}


def _uptime(tm: TokenizerManager) -> float:
    return time.time() - tm.start_time
