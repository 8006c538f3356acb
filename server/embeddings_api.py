"""Embedding routes: OpenAI's `/v1/embeddings` and SGLang's `/encode`.

Each input becomes one prefill-only `GenItem` (`embed=True`) that runs in the scheduler's
ordinary EXTEND batches beside other requests; its answer is the prompt's hidden states pooled
by `--pooling` (scheduler/pooling.py). Here the vector is cut to `dimensions` (if asked),
L2-normalized (unless vLLM's `normalize: false`) and encoded:

    /v1/embeddings  {"input": str | [str] | [int] | [[int]], "encoding_format": "float" |
                     "base64", "dimensions", "normalize"}
                    -> {"object": "list", "data": [{"object": "embedding", "embedding", "index"}],
                        "model", "usage": {"prompt_tokens", "total_tokens"}}
    /encode         {"text": str | [str]} or {"input_ids": [int] | [[int]]}, "rid", "dimensions"
                    -> {"embedding": [...], "meta_info": {...}} (a list of them for a batch)

base64 is the vector's little-endian float32 bytes (what the openai client asks for by default
and decodes).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from sgl_tpu.response import embedding_vector
from sgl_tpu.server.http_common import gather_results, log_identity, parse_body
from sgl_tpu.server.openai_common import model_adapter
from sgl_tpu.server.tokenizer_manager import GenItem, RequestError, TokenizerManager
from sgl_tpu.validation import check_batch_size, check_dimensions


class EmbeddingRequest(BaseModel):
    """OpenAI's request, with vLLM's `normalize` (default true)."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: bool = True
    rid: str | None = None


class EncodeRequest(BaseModel):
    """SGLang's `EmbeddingReqInput`, its text and token-id fields (no images); other fields,
    `sampling_params` among them (SGLang sets max_new_tokens 0), are ignored."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    rid: str | list[str] | None = None
    dimensions: StrictInt | None = None


async def _tokenized(tm: TokenizerManager, prompts: list[str | list[int]], field: str
                     ) -> list[list[int]]:
    if not prompts:
        raise RequestError(f"{field}: the input list is empty")
    if (error := check_batch_size(len(prompts))) is not None:
        raise RequestError(f"{field}: {error}")
    out = []
    for i, p in enumerate(prompts):
        name = field if len(prompts) == 1 else f"{field}[{i}]"
        if not p:
            raise RequestError(f"{name} is empty")
        ids = await tm.tokenize_async(p) if isinstance(p, str) else list(p)
        if not ids:
            raise RequestError(f"{name} has no tokens")
        out.append(ids)
    return out


def _rids(rid: str | None, num_prompts: int) -> list[str | None]:
    """One request id per prompt from the request's one (`rid-i` in a batch)."""
    if rid is None or num_prompts == 1:
        return [rid] * num_prompts
    return [f"{rid}-{i}" for i in range(num_prompts)]


async def embed(tm: TokenizerManager, prompts: list[list[int]], field: str,
                rids: list[str | None]) -> list[dict[str, Any]]:
    """Run one embedding request per prompt, concurrently; their `/encode` dicts in order
    (RequestError naming the input for a bad one)."""
    items = []
    for i, (ids, rid) in enumerate(zip(prompts, rids, strict=True)):
        item = GenItem(ids, {"max_new_tokens": 0}, rid=rid, embed=True)
        try:
            tm.validate(item)
        except RequestError as e:
            name = field if len(prompts) == 1 else f"{field}[{i}]"
            raise RequestError(f"{name}: {e}", e.status_code) from None
        items.append(item)
    return await gather_results(tm, items)


def _check_dimensions(tm: TokenizerManager, dimensions: int | None) -> None:
    if (error := check_dimensions(dimensions, tm.hidden_size)) is not None:
        raise RequestError(error)


def _encoded(v: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


async def embeddings(tm: TokenizerManager, request: Request) -> dict[str, Any]:
    req = await parse_body(request, EmbeddingRequest)
    log_identity(request, user=req.user)
    if (adapter := model_adapter(tm, req.model)) is not None:
        raise RequestError(f"model `{req.model}` is LoRA adapter {adapter!r}: embeddings are "
                           f"the base model's (adapters apply to generation)")
    _check_dimensions(tm, req.dimensions)
    inputs = req.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    prompts = await _tokenized(tm, inputs, "input")
    results = await embed(tm, prompts, "input", _rids(req.rid, len(prompts)))
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(embedding_vector(r["embedding"], req.dimensions, req.normalize),
                                   req.encoding_format)}
            for i, r in enumerate(results)]
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {"object": "list", "data": data, "model": req.model or tm.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


async def encode(tm: TokenizerManager, request: Request) -> dict[str, Any] | list[Any]:
    req = await parse_body(request, EncodeRequest)
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("exactly one of text and input_ids must be given")
    _check_dimensions(tm, req.dimensions)
    if req.text is not None:
        batch = isinstance(req.text, list)
        field, inputs = "text", req.text if batch else [req.text]
    else:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        field, inputs = "input_ids", req.input_ids if batch else [req.input_ids]
    prompts = await _tokenized(tm, inputs, field)
    rids = req.rid if isinstance(req.rid, list) else _rids(req.rid, len(prompts))
    if len(rids) != len(prompts):
        raise RequestError(f"rid has {len(rids)} entries for {len(prompts)} prompt(s)")
    results = await embed(tm, prompts, field, rids)
    for r in results:
        r["embedding"] = embedding_vector(r["embedding"], req.dimensions).tolist()
    return results if batch else results[0]


def add_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request):
        return await embeddings(tm, request)

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode_route(request: Request):
        return await encode(tm, request)
