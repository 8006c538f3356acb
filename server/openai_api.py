"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request becomes one `GenItem` per (prompt, choice): `n` is expanded here (seed + k when a
seed is given), and the items run concurrently, so the choices of one prompt share its KV
through the radix cache. Choice `i * n + k` is prompt i's k-th sample.

    request ──parse_body──► pydantic model ──_sampling()──► GenItems ──tm.generate()──►
        non-stream: gather every item's final dict ──► one response
        stream:     merge the items' cumulative dicts ──► per-choice deltas as SSE chunks

Streamed text holds back a tail that could still become a stop string: the scheduler trims a
matched stop only when the request finishes, and text already sent cannot be taken back.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sgl_tpu.detokenize import stop_safe_len
from sgl_tpu.server.http_server import error_response, gather_results, parse_body, sse
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, ServerDead, TokenizerManager
from sgl_tpu.validation import check_batch_size

# A JSON object of any shape: what `response_format: {"type": "json_object"}` asks for.
JSON_OBJECT_SCHEMA = {"type": "object"}


# ---- request models ----------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints; the SGLang extensions are accepted through extra_body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None  # a JSON schema as a string, like the native field
    rid: str | None = None
    session_id: str | None = None  # an agent's session: retention hint for its KV


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name: for the template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None


# ---- shared helpers ----------------------------------------------------------------------
def _check_model(tm: TokenizerManager, name: str | None) -> JSONResponse | None:
    names = {tm.served_model_name, tm.model_path, tm.args.model_path}
    if name is None or name in names:
        return None
    return error_response(f"The model `{name}` does not exist.", 404, "NotFoundError")


def _sampling(req: _SamplingRequest, max_tokens: int | None) -> dict[str, Any]:
    """OpenAI fields -> SGLang sampling params (None = default); validated later by tm."""
    if req.logit_bias:
        raise RequestError("logit_bias is not supported")
    sp = {
        "max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "stop": req.stop, "seed": req.seed, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty, "min_new_tokens": req.min_tokens,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim,
        "regex": req.regex, "ebnf": req.ebnf, "json_schema": req.json_schema,
    }
    return {k: v for k, v in sp.items() if v is not None}


def _expand(prompts: list[list[int]], sampling: dict[str, Any], n: int, rid: str | None,
            **item_kwargs: Any) -> list[GenItem]:
    items = []
    for i, ids in enumerate(prompts):
        for k in range(n):
            sp = dict(sampling)
            if n > 1 and sp.get("seed") is not None:
                sp["seed"] = sp["seed"] + k
            item = GenItem(input_ids=list(ids), sampling=sp, **item_kwargs)
            if rid is not None:
                item.rid = rid if len(prompts) * n == 1 else f"{rid}-{i * n + k}"
            items.append(item)
    return items


def _finish_reason(result: dict[str, Any]) -> str | None:
    reason = result["meta_info"]["finish_reason"]
    if reason is None:
        return None
    if reason["type"] == "abort":
        raise RequestError(reason.get("message") or "request aborted", 500)
    return reason["type"]  # "stop" | "length"


def _matched_stop(result: dict[str, Any]) -> str | int | None:
    reason = result["meta_info"]["finish_reason"] or {}
    return reason.get("matched")


def _usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt; its cached tokens are the best of its n choices."""
    prompt = cached = 0
    for i in range(0, len(results), n):
        group = [r["meta_info"] for r in results[i : i + n]]
        prompt += group[0]["prompt_tokens"]
        cached += max(m["cached_tokens"] for m in group)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _merge(tm: TokenizerManager, items: list[GenItem]
                 ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice index, cumulative dict) from all items as they arrive; errors re-raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, item: GenItem) -> None:
        try:
            async for result in tm.generate(item):
                queue.put_nowait((index, result))
        except (RequestError, ServerDead) as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(items)]
    remaining = len(tasks)
    try:
        while remaining:
            index, result = await queue.get()
            if isinstance(result, Exception):
                raise result
            if result is None:
                remaining -= 1
            else:
                yield index, result
    finally:
        for t in tasks:
            t.cancel()


async def _stream(tm: TokenizerManager, items: list[GenItem],
                  chunks: Callable[[int, dict[str, Any]], list[dict[str, Any]]],
                  usage_chunk: Callable[[list[dict[str, Any]]], dict[str, Any]] | None
                  ) -> StreamingResponse:
    """SSE response of `chunks(index, result)` for every update, then the usage chunk."""
    merged = _merge(tm, items)
    first = await anext(merged)  # errors before the first token become a 4xx, not a stream

    async def events() -> AsyncIterator[bytes]:
        finals: dict[int, dict[str, Any]] = {}
        try:
            update: tuple[int, dict[str, Any]] | None = first
            while update is not None:
                index, result = update
                if result["meta_info"]["finish_reason"] is not None:
                    finals[index] = result
                for chunk in chunks(index, result):
                    yield sse(chunk)
                update = await anext(merged, None)
            if usage_chunk is not None:
                yield sse(usage_chunk([finals[i] for i in range(len(items))]))
        except (RequestError, ServerDead) as e:
            code = getattr(e, "status_code", 503)
            yield sse({"error": {"message": str(e), "type": type(e).__name__, "code": code}})
        finally:
            await merged.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


class _Deltas:
    """Per-choice streaming state: how much text and how many log-prob entries went out."""

    def __init__(self, num_choices: int, stops: list[str]) -> None:
        self.sent_text = [0] * num_choices
        self.sent_logprobs = [0] * num_choices
        self.stops = stops

    def text(self, index: int, result: dict[str, Any], prefix: str = "") -> str:
        text = prefix + result["text"]
        end = len(text)
        if result["meta_info"]["finish_reason"] is None:
            end = stop_safe_len(text, self.stops)
        start, self.sent_text[index] = self.sent_text[index], max(end, self.sent_text[index])
        return text[start:end]

    def logprobs(self, index: int, result: dict[str, Any]) -> tuple[list, list]:
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        start, self.sent_logprobs[index] = self.sent_logprobs[index], len(entries)
        return entries[start:], tops[start:]


def _stops(req: _SamplingRequest) -> list[str]:
    if req.stop is None or req.no_stop_trim:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


# ---- /v1/completions -----------------------------------------------------------------------
def _completion_prompts(tm: TokenizerManager, prompt: Any) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of every prompt (text is what `echo` sends back)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt: the prompt list is empty")
    if (error := check_batch_size(len(prompt))) is not None:
        raise RequestError(f"prompt: {error}")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(tm.tokenize(p))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def _top_dict(top: list) -> dict[str, float]:
    """{text: logprob}, best first; tokens that decode to the same text keep the best one."""
    out: dict[str, float] = {}
    for lp, _tid, text in top:
        out.setdefault(text or "", lp)
    return out


def _completion_logprobs(entries: list, tops: list, offset: int) -> dict[str, Any]:
    """Legacy completions format; `offset` is where the first token's text starts."""
    tokens, token_lps, top_lps, offsets = [], [], [], []
    for (lp, _tid, text), top in zip(entries, tops or [None] * len(entries), strict=False):
        text = text or ""
        tokens.append(text)
        token_lps.append(lp)
        top_lps.append(None if top is None else _top_dict(top))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps,
            "text_offset": offsets}


async def completions(tm: TokenizerManager, request: Request):
    req = await parse_body(request, CompletionRequest)
    if (err := _check_model(tm, req.model)) is not None:
        return err
    if req.suffix:
        raise RequestError("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of is not supported (it must equal n)")
    prompts, texts = _completion_prompts(tm, req.prompt)
    want_lp = req.logprobs is not None
    items = _expand(prompts, _sampling(req, req.max_tokens), req.n, req.rid,
                    return_logprob=want_lp, top_logprobs_num=req.logprobs or 0,
                    return_text_in_logprobs=True, session_id=req.session_id,
                    logprob_start_len=0 if want_lp and req.echo else -1)
    for item in items:
        tm.validate(item)
    echo = [""] * len(items)  # text prepended to each choice
    if req.echo:
        echo = [texts[i // req.n] if texts[i // req.n] is not None
                else tm.tokenizer.decode(prompts[i // req.n], False) for i in range(len(items))]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or tm.served_model_name

    def echo_logprobs(result: dict[str, Any]) -> tuple[list, list]:
        meta = result["meta_info"]
        return (meta.get("input_token_logprobs") or []), (meta.get("input_top_logprobs") or [])

    if not req.stream:
        results = await gather_results(tm, items)
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            lp = None
            if want_lp:
                ein, tin = echo_logprobs(r) if req.echo else ([], [])
                lp = _completion_logprobs(ein + meta["output_token_logprobs"],
                                          tin + meta["output_top_logprobs"], 0)
            choices.append({"index": i, "text": echo[i] + r["text"], "logprobs": lp,
                            "finish_reason": _finish_reason(r), "matched_stop": _matched_stop(r)})
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(results, req.n)}

    deltas = _Deltas(len(items), _stops(req))
    offsets = [0] * len(items)
    echoed: set[int] = set()

    def chunks(index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        text = deltas.text(index, result, echo[index])
        entries, tops = deltas.logprobs(index, result)
        if req.echo and want_lp and index not in echoed:
            echoed.add(index)  # the prompt's log-probs go out with the first chunk
            ein, tin = echo_logprobs(result)
            entries, tops = ein + entries, tin + tops
        lp = None
        if want_lp:
            lp = _completion_logprobs(entries, tops, offsets[index])
            offsets[index] += sum(len(t) for t in lp["tokens"])
        reason = _finish_reason(result)
        if not text and not entries and reason is None:
            return []
        return [{"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": index, "text": text, "logprobs": lp,
                              "finish_reason": reason, "matched_stop": _matched_stop(result)}],
                 "usage": None}]

    def usage_chunk(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": _usage(results, req.n)}

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return await _stream(tm, items, chunks, usage_chunk if include_usage else None)


# ---- /v1/chat/completions ------------------------------------------------------------------
def _chat_prompt(tm: TokenizerManager, req: ChatCompletionRequest) -> list[int]:
    tm.check_num_messages(len(req.messages))
    messages = []
    for m in req.messages:
        msg = m.model_dump(exclude_none=True)
        msg["role"] = "system" if m.role == "developer" else m.role
        msg.setdefault("content", "")
        messages.append(msg)
    tools = None if req.tool_choice == "none" else req.tools
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in ("messages", "tools", "add_generation_prompt")}
    try:
        text = tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tools=tools, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"messages: {e}") from None
    return tm.tokenize(text, add_special_tokens=False)  # bounded by the context length


def _chat_sampling(tm: TokenizerManager, req: ChatCompletionRequest, prompt_len: int
                   ) -> dict[str, Any]:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if max_tokens is None:  # as OpenAI: up to the context (and KV capacity) limit
        max_tokens = max(min(tm.context_len, tm.max_total_tokens) - prompt_len, 0)
    sp = _sampling(req, max_tokens)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sp["json_schema"] = json.dumps(JSON_OBJECT_SCHEMA)
    elif fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON object")
        sp["json_schema"] = json.dumps(schema)
    # The template's end-of-turn token must end the turn even if it is not an EOS id.
    end = tm.tokenizer.chat_end_token
    end_id = tm.tokenizer.token_to_id(end) if end else None
    if end_id is not None and end_id not in tm.tokenizer.eos_token_ids \
            and not sp.get("ignore_eos"):
        sp["stop_token_ids"] = [*sp.get("stop_token_ids", []), end_id]
    return sp


def _chat_logprobs(tm: TokenizerManager, entries: list, tops: list) -> dict[str, Any]:
    def one(lp: float, tid: int, text: str | None) -> dict[str, Any]:
        return {"token": text or "", "logprob": lp,
                "bytes": list(tm.tokenizer.id_to_token_bytes(tid))}

    content = []
    for (lp, tid, text), top in zip(entries, tops or [None] * len(entries), strict=False):
        content.append({**one(lp, tid, text),
                        "top_logprobs": [one(*t) for t in top] if top else []})
    return {"content": content}


async def chat_completions(tm: TokenizerManager, request: Request):
    req = await parse_body(request, ChatCompletionRequest)
    if (err := _check_model(tm, req.model)) is not None:
        return err
    if req.audio is not None:
        raise RequestError("audio output is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true")
    prompt = _chat_prompt(tm, req)
    items = _expand([prompt], _chat_sampling(tm, req, len(prompt)), req.n, req.rid,
                    return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                    return_text_in_logprobs=True, session_id=req.session_id)
    for item in items:
        tm.validate(item)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or tm.served_model_name

    if not req.stream:
        results = await gather_results(tm, items)
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            lp = (_chat_logprobs(tm, meta["output_token_logprobs"], meta["output_top_logprobs"])
                  if req.logprobs else None)
            choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]},
                            "logprobs": lp, "finish_reason": _finish_reason(r),
                            "matched_stop": _matched_stop(r)})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(results, req.n)}

    deltas = _Deltas(len(items), _stops(req))
    started = [False] * len(items)

    def chunk(index: int, delta: dict[str, Any], lp: dict | None, reason: str | None,
              matched: Any = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [choice], "usage": None}

    def chunks(index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if not started[index]:
            started[index] = True
            out.append(chunk(index, {"role": "assistant", "content": ""}, None, None))
        text = deltas.text(index, result)
        entries, tops = deltas.logprobs(index, result)
        if text or entries:
            lp = _chat_logprobs(tm, entries, tops) if req.logprobs else None
            out.append(chunk(index, {"content": text}, lp, None))
        reason = _finish_reason(result)
        if reason is not None:
            out.append(chunk(index, {}, None, reason, _matched_stop(result)))
        return out

    def usage_chunk(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": _usage(results, req.n)}

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return await _stream(tm, items, chunks, usage_chunk if include_usage else None)


# ---- routes --------------------------------------------------------------------------------
def _model_card(tm: TokenizerManager) -> dict[str, Any]:
    return {"id": tm.served_model_name, "object": "model", "created": int(tm.start_time),
            "owned_by": "sgl-tpu", "root": tm.model_path, "max_model_len": tm.context_len}


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(tm)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if (err := _check_model(tm, model)) is not None:
            return err
        return _model_card(tm)

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await completions(tm, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request):
        return await chat_completions(tm, request)
