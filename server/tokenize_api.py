"""`/tokenize` and `/detokenize` (also under `/v1/`): token counts for budgeting a context, in
SGLang's and vLLM's shapes at once (the two agree on the names; each reads its own fields).

    /tokenize    {prompt: str | [str]} | {messages: [...], tools, chat_template_kwargs, ...}
                 -> {tokens, count, max_model_len[, token_strs]}   (lists for a list of prompts)
    /detokenize  {tokens: [int] | [[int]], skip_special_tokens}
                 -> {text (SGLang: special tokens skipped by default),
                     prompt (vLLM: every token's text)}

`messages` are rendered by the chat path (`openai_chat.prompt_ids`): with the defaults the ids
are exactly the prompt a chat completion of the same body prefills (tools, template kwargs and
the tool-call fallbacks included). Extra fields are passed to that chat request, so a client
may send its chat body as it is.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from sgl_tpu.server.http_common import parse_body
from sgl_tpu.server.openai_chat import prompt_ids
from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.tokenizer_manager import RequestError, TokenizerManager
from sgl_tpu.validation import check_batch_size, check_token_ids


class TokenizeRequest(BaseModel):
    """SGLang's `TokenizeRequest` and vLLM's `TokenizeCompletionRequest` /
    `TokenizeChatRequest` in one: exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    # None: True for a prompt; for messages False, as the chat path encodes its rendering
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # None: True, as a chat completion renders
    continue_final_message: bool = False
    return_token_strs: bool = False  # vLLM: also each token's vocabulary string


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: bool = True


def _chat_ids(tm: TokenizerManager, req: TokenizeRequest) -> list[int]:
    if req.continue_final_message:
        raise RequestError("continue_final_message is not supported")
    body = {**(req.model_extra or {}), "model": req.model, "messages": req.messages}
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise RequestError("invalid request: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    return prompt_ids(tm, chat, add_generation_prompt=req.add_generation_prompt is not False,
                      add_special_tokens=bool(req.add_special_tokens))


async def tokenize(tm: TokenizerManager, req: TokenizeRequest) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("exactly one of prompt and messages must be given")
    batch = isinstance(req.prompt, list)
    if req.messages is not None:
        ids = [_chat_ids(tm, req)]
    else:
        prompts = req.prompt if batch else [req.prompt]
        if (error := check_batch_size(len(prompts))) is not None:
            raise RequestError(f"prompt: {error}")
        special = req.add_special_tokens is not False
        ids = [await tm.tokenize_async(p, add_special_tokens=special) for p in prompts]
    out: dict[str, Any] = {"tokens": ids if batch else ids[0],
                           "count": [len(x) for x in ids] if batch else len(ids[0]),
                           "max_model_len": tm.context_len}
    if req.return_token_strs:
        strs = [[tm.tokenizer.backend.id_to_token(t) for t in x] for x in ids]
        out["token_strs"] = strs if batch else strs[0]
    return out


def detokenize(tm: TokenizerManager, req: DetokenizeRequest) -> dict[str, Any]:
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    seqs = req.tokens if batch else [req.tokens]
    if (error := check_batch_size(len(seqs))) is not None:
        raise RequestError(f"tokens: {error}")
    for i, seq in enumerate(seqs):
        name = f"tokens[{i}]" if batch else "tokens"
        if (error := check_token_ids(name, seq, tm.vocab_size)) is not None:
            raise RequestError(error)
    texts = [tm.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
    prompts = [tm.tokenizer.decode(s, skip_special_tokens=False) for s in seqs]
    return {"text": texts if batch else texts[0], "prompt": prompts if batch else prompts[0]}


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(tm, await parse_body(request, TokenizeRequest))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return detokenize(tm, await parse_body(request, DetokenizeRequest))
