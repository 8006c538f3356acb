"""Helpers shared by the OpenAI routes: OpenAI fields -> sampling params, `n` expansion into
`GenItem`s, finish reasons, usage, merging concurrent items' results, and streamed deltas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from sgl_tpu.detokenize import stop_safe_len
from sgl_tpu.sampling_params import expand_n
from sgl_tpu.server.openai_protocol import SamplingRequest
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, ServerDead, TokenizerManager


def sampling_params(req: SamplingRequest, max_tokens: int | None) -> dict[str, Any]:
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
        "stop_regex": req.stop_regex, "regex": req.regex, "ebnf": req.ebnf,
        "json_schema": req.json_schema,
    }
    return {k: v for k, v in sp.items() if v is not None}


def expand_items(prompts: list[list[int]], sampling: dict[str, Any], n: int, rid: str | None,
                 **fields: Any) -> list[GenItem]:
    """One item per (prompt, choice), each with the request `fields` (`request_fields()`)."""
    items = []
    for i, ids in enumerate(prompts):
        for k, sp in enumerate(expand_n(sampling, n)):
            item_rid = rid if rid is None or len(prompts) * n == 1 else f"{rid}-{i * n + k}"
            items.append(GenItem(list(ids), sp, rid=item_rid, **fields))
    return items


def model_adapter(tm: TokenizerManager, name: str | None) -> str | None:
    """The LoRA adapter a request's `model` selects: a loaded adapter's name (as vLLM), or
    SGLang's `<served name>:<adapter>`; None: the base model. Without --enable-lora any other
    name is the one model (clients send "default", "gpt-4o", ...); with it, a name that is
    neither the model nor a loaded adapter is refused (RequestError naming it), so a misspelt
    adapter never silently runs the base model."""
    if name is None:
        return None
    if name in tm.lora_adapters:
        return name
    prefix = f"{tm.served_model_name}:"
    if name.startswith(prefix) and (adapter := name[len(prefix):].strip()):
        tm.lora_id(adapter)  # RequestError unless loaded
        return adapter
    if tm.lora_enabled and name not in {"default", tm.served_model_name, tm.model_path,
                                        tm.args.model_path}:
        raise RequestError(f"model `{name}` is neither the served model "
                           f"`{tm.served_model_name}` nor a loaded LoRA adapter (loaded: "
                           f"{sorted(tm.lora_adapters)})")
    return None


def finish_reason(result: dict[str, Any]) -> str | None:
    reason = result["meta_info"]["finish_reason"]
    if reason is None:
        return None
    if reason["type"] == "abort":
        raise RequestError(reason.get("message") or "request aborted", 500)
    return reason["type"]  # "stop" | "length"


def matched_stop(result: dict[str, Any]) -> str | int | None:
    reason = result["meta_info"]["finish_reason"] or {}
    return reason.get("matched")


def usage(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
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


async def merge_results(tm: TokenizerManager, items: list[GenItem]
                 ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice index, cumulative dict) from all items as they arrive; errors re-raised.

    One item (n=1, the common case) is read directly; several through one queue that a task
    per item fills (a task switch and a queue round trip per update: 5-12% of the HTTP
    process's CPU per streamed chat token when it was paid for one item too)."""
    if len(items) == 1:
        gen = tm.generate(items[0])
        try:
            async for result in gen:
                yield 0, result
        finally:
            await gen.aclose()  # a consumer that stops early aborts the request
        return
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


async def stream_chunks(tm: TokenizerManager, items: list[GenItem],
                        chunks: Callable[[int, dict[str, Any]], list[dict[str, Any]]],
                        usage_chunk: Callable[[list[dict[str, Any]]], dict[str, Any]] | None
                        ) -> AsyncIterator[dict[str, Any]]:
    """`chunks(index, result)` for every update of every item, then the usage chunk (if any).

    Errors (RequestError, ServerDead) propagate; the caller decides whether they become a 4xx
    (before the first chunk) or an error event in the stream.
    """
    merged = merge_results(tm, items)
    finals: dict[int, dict[str, Any]] = {}
    try:
        async for index, result in merged:
            if result["meta_info"]["finish_reason"] is not None:
                finals[index] = result
            for chunk in chunks(index, result):
                yield chunk
    finally:
        await merged.aclose()
    if usage_chunk is not None:
        yield usage_chunk([finals[i] for i in range(len(items))])


class Deltas:
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


def stop_strings(req: SamplingRequest) -> list[str]:
    if req.stop is None or req.no_stop_trim:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


