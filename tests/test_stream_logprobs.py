"""Streamed log-probs when one chunk carries several decode steps: every chunk of every API's
stream (native `/generate`, SGLang's frontend reading it, OpenAI chat and completions) carries
the log-probs and top log-probs of exactly its new tokens, in order.

Several steps reach a client as one chunk when the HTTP process's consumer of a request is
woken late: `--stream-interval`, a busy event loop, the queue of an `n > 1` request, and a
speculative step that emits several tokens. The server here streams every third token
(`--stream-interval 3`: the OpenAI routes take no per-request interval), so every stream has
such chunks; the clients read slowly as well. It is the session's float32 server's
configuration otherwise (tests/server_harness.py): greedy answers are exact, so the streamed
entries are compared with the non-streamed ones.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import openai
import pytest
import requests
from server_harness import DEFAULT_MODEL_F32_FLAGS, ServerHandle, launch_server
from server_harness import SERVED_F32 as SERVED
from sglang_frontend import sgl

from sgl_tpu.loader import default_model_path

pytestmark = pytest.mark.slow

STREAM_INTERVAL = 3
READ_DELAY_S = 0.02  # the slow reader's pause after each chunk
TOP_K = 2
COUNT_PROMPT = "Count from 1 to 30: 1, 2, 3,"  # ASCII digits: each token's text is its own
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    handle = launch_server(*DEFAULT_MODEL_F32_FLAGS, "--stream-interval", str(STREAM_INTERVAL))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def slowly(chunks):
    for chunk in chunks:
        yield chunk
        time.sleep(READ_DELAY_S)


def check_native_chunks(metas: list[dict], whole_entries: list, top_k: int = 0) -> list[int]:
    """SGLang's streamed form, chunk by chunk: the new tokens' entries (and `top_k` top
    entries each), the running length; returns the number of new tokens of each chunk."""
    prev, entries, news = 0, [], []
    for meta in metas:
        new = meta["completion_tokens"] - prev
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == new, (new, meta["output_token_logprobs"])
        if top_k:
            assert [len(t) for t in meta["output_top_logprobs"]] == [top_k] * new
        prev = meta["completion_tokens"]
        entries += meta["output_token_logprobs"]
        news.append(new)
    assert [e[1] for e in entries] == [e[1] for e in whole_entries]
    return news


def test_native_stream(server: ServerHandle) -> None:
    body = {"text": COUNT_PROMPT, "return_logprob": True, "top_logprobs_num": TOP_K,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
    whole = requests.post(server.base_url + "/generate", json=body, timeout=120).json()
    with requests.post(server.base_url + "/generate", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        chunks = [json.loads(line[5:]) for line in slowly(r.iter_lines(decode_unicode=True))
                  if line.startswith("data:") and line != "data: [DONE]"]
    news = check_native_chunks([c["meta_info"] for c in chunks],
                               whole["meta_info"]["output_token_logprobs"], TOP_K)
    # the first token, then at least every third (a speculative step may emit more), the last
    assert news[0] == 1 and min(news[1:-1]) >= STREAM_INTERVAL and sum(news) == 16
    for chunk, meta in zip(chunks, [c["meta_info"] for c in chunks], strict=True):
        tail = chunk["output_ids"][len(chunk["output_ids"]) - len(meta["output_token_logprobs"]):]
        assert [e[1] for e in meta["output_token_logprobs"]] == tail


@sgl.function
def qa_logprobs(s, question: str):
    """SGLang's test_stream_logprobs program (sglang/test/test_programs.py)."""
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


def test_sglang_frontend_stream_events(server: ServerHandle) -> None:
    """SGLang's test_stream_logprobs through the real frontend, its checks made on every event
    the frontend's backend receives while a slow `text_async_iter` reader falls behind. What
    that reader gets is left unchecked: the frontend pairs several events' text with the last
    event's meta_info (tests/test_frontend.py, SKIPPED_PROGRAMS)."""
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    events: list[tuple[str, dict]] = []
    receive = endpoint.generate_stream

    def recording(s, sampling_params):  # observes the unmodified method's events
        for text, meta in receive(s, sampling_params):
            events.append((text, meta))
            yield text, meta

    endpoint.generate_stream = recording
    kw = dict(question="Write two sentences about Hawaii.", temperature=0, max_new_tokens=16,
              backend=endpoint)

    async def read_slowly() -> str:
        state = qa_logprobs.run(**kw, stream=True)
        async for _text, _meta in state.text_async_iter("answer", return_meta_data=True):
            await asyncio.sleep(0.05)
        return state["answer"]

    answer = asyncio.run(read_slowly())
    whole = qa_logprobs.run(**kw).get_meta_info("answer")["output_token_logprobs"]
    news = check_native_chunks([meta for _, meta in events], whole)
    assert max(news) >= STREAM_INTERVAL
    assert "".join(text for text, _ in events) == answer


def test_chat_stream(client: openai.OpenAI) -> None:
    """With continuous usage stats every chunk says how many tokens its answer has: the log-prob
    entries streamed up to a chunk that carries some are exactly that many."""
    kw = dict(model=SERVED, messages=CHAT, max_tokens=16, temperature=0, logprobs=True,
              top_logprobs=TOP_K)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    stream = client.chat.completions.create(
        **kw, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    entries, news = [], []
    for chunk in slowly(stream):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is None or not lp.content:
            continue
        news.append(chunk.usage.completion_tokens - len(entries))
        entries += lp.content
        assert len(entries) == chunk.usage.completion_tokens
        assert all(len(e.top_logprobs) == TOP_K for e in lp.content)
    assert chunk.usage.completion_tokens == len(entries) == len(whole)  # the usage chunk
    assert [e.token for e in entries] == [e.token for e in whole]
    assert max(news) >= STREAM_INTERVAL


def test_completions_stream(client: openai.OpenAI) -> None:
    """Two choices (one's results wait in the HTTP process while the other's are sent): each
    chunk's log-prob tokens spell its text, with offsets that continue the choice's."""
    kw = dict(model=SERVED, prompt=COUNT_PROMPT, max_tokens=16, temperature=0, logprobs=TOP_K,
              n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    tokens: dict[int, list[str]] = {0: [], 1: []}
    news = []
    for chunk in slowly(stream):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text
        assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens)
        assert lp.text_offset == [sum(map(len, tokens[choice.index] + lp.tokens[:i]))
                                  for i in range(len(lp.tokens))]
        tokens[choice.index] += lp.tokens
        news.append(len(lp.tokens))
    assert tokens[0] == tokens[1] == whole.tokens
    assert usage.completion_tokens == 2 * len(whole.tokens) == 32
    assert max(news) >= STREAM_INTERVAL


def test_responses_stream(client: openai.OpenAI) -> None:
    """Each text delta carries the log-probs of the tokens that wrote it (ASCII: their texts
    spell it), all of the answer's tokens in all, as the non-streamed response has them."""
    kw = dict(model=SERVED, input=COUNT_PROMPT, max_output_tokens=16, temperature=0,
              top_logprobs=TOP_K, include=["message.output_text.logprobs"])
    whole = client.responses.create(**kw).output[0].content[0].logprobs
    tokens, news = [], []
    for event in slowly(client.responses.create(**kw, stream=True)):
        if event.type == "response.output_text.delta":
            assert "".join(lp.token for lp in event.logprobs) == event.delta
            assert all(len(lp.top_logprobs) == TOP_K for lp in event.logprobs)
            tokens += [lp.token for lp in event.logprobs]
            news.append(len(event.logprobs))
        elif event.type in ("response.completed", "response.incomplete"):
            assert event.response.usage.output_tokens == len(tokens) == 16
    assert tokens == [lp.token for lp in whole]
    assert max(news) >= STREAM_INTERVAL
