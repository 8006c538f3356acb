"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request becomes one `GenItem` per (prompt, choice): `n` is expanded here (seed + k when a
seed is given), and the items run concurrently, so the choices of one prompt share its KV
through the radix cache. Choice `i * n + k` is prompt i's k-th sample. The chat path lives in
`openai_chat.py` (functions returning OpenAI dicts); this module adds the HTTP framing.

    request ──parse_body──► pydantic model (openai_protocol.py) ──► GenItems ──tm.generate()──►
        non-stream: gather every item's final dict ──► one response
        stream:     merge the items' cumulative dicts ──► per-choice deltas as SSE chunks

Streamed text holds back a tail that could still become a stop string: the scheduler trims a
matched stop only when the request finishes, and text already sent cannot be taken back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sgl_tpu.server.http_common import (
    error_response,
    gather_results,
    log_identity,
    parse_body,
    session_hint,
    sse,
)
from sgl_tpu.server.openai_chat import chat_completion, chat_completion_chunks
from sgl_tpu.server.openai_common import (
    Deltas,
    expand_items,
    finish_reason,
    matched_stop,
    model_adapter,
    sampling_params,
    stop_strings,
    stream_chunks,
    usage,
)
from sgl_tpu.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from sgl_tpu.server.openai_tools import log_tool_setup
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead, TokenizerManager
from sgl_tpu.validation import check_batch_size


def model_error(tm: TokenizerManager, name: str | None) -> str | None:
    """The 4xx message for a `model` that names a LoRA adapter not loaded (`model_adapter`),
    or None for a servable name."""
    try:
        model_adapter(tm, name)
    except RequestError as e:
        return str(e)
    return None


def check_model(tm: TokenizerManager, name: str | None) -> JSONResponse | None:
    try:
        model_adapter(tm, name)
    except RequestError as e:
        return error_response(str(e), e.status_code)
    return None


async def sse_response(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """SSE of `chunks`, then `[DONE]`. An error before the first chunk raises (a 4xx, not a
    stream); a later one becomes an error event."""
    first = await anext(chunks)

    async def events() -> AsyncIterator[bytes]:
        try:
            yield sse(first)
            async for chunk in chunks:
                yield sse(chunk)
        except (RequestError, ServerDead) as e:
            code = getattr(e, "status_code", 503)
            yield sse({"error": {"message": str(e), "type": type(e).__name__, "code": code}})
        finally:
            await chunks.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


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
    req.session_id = session_hint(req.session_id, req.session_params, request,
                                  req.prompt_cache_key)
    log_identity(request, user=req.user, safety_identifier=req.safety_identifier)
    if (err := check_model(tm, req.model)) is not None:
        return err
    if req.suffix:
        raise RequestError("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of is not supported (it must equal n)")
    prompts, texts = _completion_prompts(tm, req.prompt)
    want_lp = req.logprobs is not None
    items = expand_items(prompts, sampling_params(req, req.max_tokens), req.n, req.rid,
                         **req.request_fields(), lora_path=model_adapter(tm, req.model))
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
                            "finish_reason": finish_reason(r), "matched_stop": matched_stop(r)})
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(results, req.n)}

    deltas = Deltas(len(items), stop_strings(req))
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
        reason = finish_reason(result)
        if not text and not entries and reason is None:
            return []
        return [{"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": index, "text": text, "logprobs": lp,
                              "finish_reason": reason, "matched_stop": matched_stop(result)}],
                 "usage": None}]

    def usage_chunk(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": usage(results, req.n)}

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return await sse_response(
        stream_chunks(tm, items, chunks, usage_chunk if include_usage else None))


# ---- routes --------------------------------------------------------------------------------
def _model_card(tm: TokenizerManager) -> dict[str, Any]:
    return {"id": tm.served_model_name, "object": "model", "created": int(tm.start_time),
            "owned_by": "sgl-tpu", "root": tm.model_path, "parent": None,
            "max_model_len": tm.context_len}


def _adapter_card(tm: TokenizerManager, name: str) -> dict[str, Any]:
    """A loaded LoRA adapter, as vLLM lists one: its folder as `root`, the model as `parent`."""
    return {**_model_card(tm), "id": name, "root": tm.lora_adapters[name]["path"],
            "parent": tm.served_model_name}


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    log_tool_setup(tm)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(tm), *(
            _adapter_card(tm, name) for name in sorted(tm.lora_adapters))]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        if model in tm.lora_adapters:
            return _adapter_card(tm, model)
        if model not in {tm.served_model_name, tm.model_path, tm.args.model_path}:
            return error_response(f"The model `{model}` does not exist.", 404, "NotFoundError")
        return _model_card(tm)

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await completions(tm, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request):
        req = await parse_body(request, ChatCompletionRequest)
        req.session_id = session_hint(req.session_id, req.session_params, request,
                                      req.prompt_cache_key)
        log_identity(request, user=req.user, safety_identifier=req.safety_identifier)
        if (err := check_model(tm, req.model)) is not None:
            return err
        if req.stream:
            return await sse_response(chat_completion_chunks(tm, req))
        return await chat_completion(tm, req)
