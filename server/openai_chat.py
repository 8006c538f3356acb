"""The chat-completions path as two functions whose contract is the OpenAI wire format:

    chat_completion(tm, req)         -> the whole `chat.completion` object (non-streaming)
    chat_completion_chunks(tm, req)  -> the `chat.completion.chunk` dicts of a stream
    prompt_ids(tm, req)              -> the rendered prompt's token ids (no generation)

The `/v1/chat/completions` route wraps them (JSON body / SSE); other front-ends (the Responses
and Anthropic Messages APIs) call them directly. Errors found before the first token (bad
messages, a bad grammar; an unknown model name is the route's business) raise `RequestError`,
so the caller can answer 4xx.

    request ──_chat_prompt──► prompt ids ──_chat_sampling──► GenItems ──tm.generate()──►
        non-stream: every item's final dict ──► one chat.completion
        stream:     the items' cumulative dicts ──► per-choice deltas as chunks
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sgl_tpu.server.chat_output import ChatOutput, final_message
from sgl_tpu.server.http_common import gather_results
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
from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.openai_tools import ChatPlan, plan_chat, plan_grammar, tool_parser
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, TokenizerManager

# A JSON object of any shape: what `response_format: {"type": "json_object"}` asks for.
JSON_OBJECT_SCHEMA = {"type": "object"}


def _chat_prompt(tm: TokenizerManager, req: ChatCompletionRequest, plan: ChatPlan, *,
                 add_generation_prompt: bool = True, add_special_tokens: bool = False
                 ) -> list[int]:
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in ("messages", "tools", "add_generation_prompt")}
    try:
        text = tm.tokenizer.apply_chat_template(plan.messages,
                                                add_generation_prompt=add_generation_prompt,
                                                tools=plan.template_tools, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"messages: {e}") from None
    if plan.reasoning is not None:
        plan.in_reasoning = plan.reasoning.starts_in_reasoning(text)
    plan.grammar = plan_grammar(plan, tool_parser(tm), text)
    return tm.tokenize(text, add_special_tokens=add_special_tokens)  # bounded by context_len


def _chat_sampling(tm: TokenizerManager, req: ChatCompletionRequest, prompt_len: int,
                   plan: ChatPlan) -> dict[str, Any]:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    if max_tokens is None:  # as OpenAI: up to the context (and KV capacity) limit
        max_tokens = max(min(tm.context_len, tm.max_total_tokens) - prompt_len, 0)
    sp = sampling_params(req, max_tokens)
    fmt = req.response_format
    if plan.grammar is not None:  # tool calls, or response_format after a reasoning block
        sp["ebnf"] = plan.grammar
    elif fmt is not None and fmt.type == "json_object":
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


def prompt_ids(tm: TokenizerManager, req: ChatCompletionRequest, *,
               add_generation_prompt: bool = True, add_special_tokens: bool = False
               ) -> list[int]:
    """The prompt's token ids exactly as a generation of `req` would send them (what a
    token-counting route reports) with the defaults; the options render it otherwise (the
    `/tokenize` route's). RequestError on bad input."""
    tm.check_num_messages(len(req.messages))
    return _chat_prompt(tm, req, plan_chat(tm, req),
                        add_generation_prompt=add_generation_prompt,
                        add_special_tokens=add_special_tokens)


def _chat_logprobs(tm: TokenizerManager, entries: list, tops: list) -> dict[str, Any]:
    def one(lp: float, tid: int, text: str | None) -> dict[str, Any]:
        return {"token": text or "", "logprob": lp,
                "bytes": list(tm.tokenizer.id_to_token_bytes(tid))}

    content = []
    for (lp, tid, text), top in zip(entries, tops or [None] * len(entries), strict=False):
        content.append({**one(lp, tid, text),
                        "top_logprobs": [one(*t) for t in top] if top else []})
    return {"content": content}


def chat_items(tm: TokenizerManager, req: ChatCompletionRequest
               ) -> tuple[list[GenItem], ChatPlan]:
    """Validate the request and build its GenItems (RequestError on bad input)."""
    if req.audio is not None:
        raise RequestError("audio output is not supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true")
    tm.check_num_messages(len(req.messages))
    plan = plan_chat(tm, req)
    prompt = _chat_prompt(tm, req, plan)
    items = expand_items([prompt], _chat_sampling(tm, req, len(prompt), plan), req.n, req.rid,
                         may_call_tools=plan.parser is not None, **req.request_fields(),
                         lora_path=model_adapter(tm, req.model))
    for item in items:
        tm.validate(item)
    return items, plan


def _reason(result: dict[str, Any], has_calls: bool) -> str | None:
    reason = finish_reason(result)
    return "tool_calls" if has_calls and reason == "stop" else reason


async def chat_completion(tm: TokenizerManager, req: ChatCompletionRequest) -> dict[str, Any]:
    """The `chat.completion` object for a non-streaming request."""
    items, plan = chat_items(tm, req)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or tm.served_model_name
    results = await gather_results(tm, items)
    choices, paused = [], []  # paused: the rids whose turn ended in tool calls
    for i, r in enumerate(results):
        meta = r["meta_info"]
        lp = (_chat_logprobs(tm, meta["output_token_logprobs"], meta["output_top_logprobs"])
              if req.logprobs else None)
        finish_reason(r)  # an aborted request raises
        message, has_calls = final_message(plan, r["text"])
        if has_calls:
            paused.append(items[i].rid)
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": _reason(r, has_calls), "matched_stop": matched_stop(r)})
    tm.tool_pause(paused)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(results, req.n)}


async def chat_completion_chunks(tm: TokenizerManager, req: ChatCompletionRequest,
                                 prepared: tuple[list[GenItem], ChatPlan] | None = None
                                 ) -> AsyncIterator[dict[str, Any]]:
    """The `chat.completion.chunk` dicts of a stream (usage last when asked for); `prepared`:
    the request's `chat_items`, when the caller checked it already.

    Nothing is yielded before the first result arrives, so errors before the first token raise
    from the first `anext`; later errors raise mid-stream.
    """
    items, plan = prepared or chat_items(tm, req)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or tm.served_model_name
    outputs = [ChatOutput(plan) for _ in items]
    deltas = Deltas(len(items), stop_strings(req))
    started = [False] * len(items)
    continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
    latest: dict[int, dict[str, Any]] = {}  # each choice's latest result (continuous usage)

    def chunk(index: int, delta: dict[str, Any], lp: dict | None, reason: str | None,
              matched: Any = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched
        running = usage(list(latest.values()), len(latest)) if continuous else None
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [choice], "usage": running}

    def chunks(index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        latest[index] = result
        if not started[index]:
            started[index] = True
            out.append(chunk(index, {"role": "assistant", "content": ""}, None, None))
        text = deltas.text(index, result)
        entries, tops = deltas.logprobs(index, result)
        reason = finish_reason(result)
        updates = outputs[index].feed(text) if text else []
        if reason is not None:
            updates += outputs[index].finish()
        lp = _chat_logprobs(tm, entries, tops) if req.logprobs and entries else None
        if lp is not None and not updates:
            updates = [{"content": ""}]
        for k, delta in enumerate(updates):
            out.append(chunk(index, delta, lp if k == 0 else None, None))
        if reason is not None:
            has_calls = outputs[index].num_calls > 0
            if has_calls:
                tm.tool_pause([items[index].rid])
            out.append(chunk(index, {}, None, _reason(result, has_calls), matched_stop(result)))
        return out

    def usage_chunk(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": usage(results, req.n)}

    include_usage = req.stream_options is not None and req.stream_options.include_usage
    async for c in stream_chunks(tm, items, chunks, usage_chunk if include_usage else None):
        yield c
