"""End-to-end tests of SGLang's native API against real launched servers (tiny random model).

Servers (launched on first use, shared by the tests that follow):

    roomy       page 16, radix cache on, context 512      the reference for most checks
    nocache     --disable-radix-cache, --context-length 256, --api-key   (bad input, auth)
    tight       --max-total-tokens 512 --max-running-requests 16   (forces retraction),
                --stream-interval 3
    page1       --page-size 1; the last test kills its scheduler (a dying child)

roomy and nocache are the session's pooled tiny-model servers (TINY_F32, TINY_NOCACHE_KEYED in
tests/server_harness.py), which other modules use too; tight and page1 are this module's own.

All run float32. The tiny model's outputs are gibberish but deterministic, so greedy runs are
compared token for token (across cache hits too: float32, not bfloat16, which `--dtype auto`
is on CPUs with AMX). After traffic every server must be idle with `integrity == "ok"` and no page
held by a request (`/server_info`), which catches KV page leaks and double frees.

Tests marked `backend_independent` run on the default backend only; `make test`'s JAX pass
deselects them: request validation, auth and info routes (answered before the executor runs),
and what the host processes do alike whatever computes the tokens (batch and `n` expansion,
stop strings, abort, disconnect, flush, a request's own stream interval, a dying scheduler).
On JAX the executor's side runs in the rest: greedy equality across cache hits, batches,
streams and retraction, cached tokens, logprobs, stop tokens with `min_new_tokens`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from server_harness import (
    TINY_API_KEY,
    TINY_F32,
    TINY_NOCACHE_KEYED,
    ServerHandle,
    launch_server,
)

pytestmark = pytest.mark.slow

TIMEOUT = 180  # seconds per HTTP call (a first call may compile a new batch shape)
API_KEY = TINY_API_KEY
GREEDY = {"temperature": 0.0}


# ---- servers --------------------------------------------------------------------------------
@dataclass
class Server:
    handle: ServerHandle
    model_path: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.handle.base_url

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=TIMEOUT, **kw)

    def post(self, path: str, body: Any = None, *, data: str | bytes | None = None,
             **kw: Any) -> requests.Response:
        headers = {**self.headers, "Content-Type": "application/json; charset=utf-8"}
        if data is None and body is not None:
            data = json.dumps(body)
        return requests.post(self.url + path, data=data, headers=headers, timeout=TIMEOUT,
                             **kw)

    def generate(self, **body: Any) -> Any:
        r = self.post("/generate", body)
        assert r.status_code == 200, (r.status_code, r.text, self.handle.log_tail())
        return r.json()

    def info(self) -> dict[str, Any]:
        r = self.get("/server_info")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll /server_info until no request is queued or running (integrity is reported)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                    and "integrity" in info):
                return info
            assert time.monotonic() < deadline, f"server not idle after {timeout} s: {info}"
            time.sleep(0.05)

    def assert_clean(self) -> dict[str, Any]:
        """Idle, page accounting and tree intact, no page held by a request."""
        info = self.wait_idle()
        mem = info["memory"]
        assert info["integrity"] == "ok", info["integrity"]
        assert mem["num_pages_requests"] == 0, mem
        assert mem["num_pages_free"] + mem["num_pages_tree"] == mem["num_pages_total"], mem
        assert mem["tree_protected_tokens"] == 0, mem  # nothing left locked
        return info


def _launch(model_path: str, *flags: str) -> Server:
    return Server(launch_server("--skip-warmup", *flags, model_path=model_path), model_path)


# Greedy outputs are compared across servers and batch compositions (retraction recomputes a
# sequence's KV by prefill where it was first written by decode steps; the cache skips a
# prefix's prefill). That is exact in float32; in bfloat16 the computations round differently
# and a random tiny model's near-ties flip, so the servers that are compared run float32 on
# either backend.
@pytest.fixture(scope="module")
def roomy(server_pool, tiny_model) -> Server:
    return Server(server_pool.get(*TINY_F32, model_path=tiny_model), tiny_model)


@pytest.fixture(scope="module")
def nocache(server_pool, tiny_model) -> Server:
    return Server(server_pool.get(*TINY_NOCACHE_KEYED, model_path=tiny_model), tiny_model,
                  {"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def tight(tiny_model):
    server = _launch(tiny_model, "--page-size", "16", "--max-total-tokens", "512",
                     "--max-running-requests", "16", "--dtype", "float32",
                     "--stream-interval", "3")
    yield server
    server.handle.stop()


@pytest.fixture(scope="module")
def page1(tiny_model):
    server = _launch(tiny_model, "--page-size", "1", "--dtype", "float32")
    yield server
    server.handle.stop()


# ---- helpers --------------------------------------------------------------------------------
def ids(n: int, seed: int) -> list[int]:
    """n random non-special token ids of the tiny vocabulary (400 tokens, 0-2 special)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def stream(server: Server, body: dict[str, Any], *, on_event=None
           ) -> tuple[list[dict[str, Any]], bool]:
    """POST a streaming /generate; return (events, saw [DONE] as the last line).

    `on_event(event, response)` runs after each event (it may close the response)."""
    events: list[dict[str, Any]] = []
    done = False
    with server.post("/generate", {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        try:
            for line in r.iter_lines(chunk_size=None):
                if not line:
                    continue
                assert not done, f"data after [DONE]: {line!r}"
                assert line.startswith(b"data: "), line
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                events.append(event)
                if on_event is not None and on_event(event, r):
                    break
        except requests.exceptions.ChunkedEncodingError:
            pass  # the server went away mid-stream (dying-child test)
    return events, done


def assert_error(r: requests.Response, *words: str, status: int = 400) -> None:
    """A JSON error with `status` whose message names every one of `words`."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    for w in words:
        assert w.lower() in message.lower(), (w, message)


# ---- 1. greedy output with and without the radix cache --------------------------------------
def _cache_prompts(seed: int) -> list[list[int]]:
    shared = ids(150, seed)
    return ([shared + ids(k, seed + 10 + k) for k in (3, 9, 20)]
            + [shared[:100] + ids(5, seed + 30)]
            + [ids(n, seed + 40 + n) for n in (1, 7, 33)] + [shared + ids(3, seed + 13)])


def test_greedy_identical_with_and_without_radix_cache(roomy, nocache):
    one_by_one, all_at_once = _cache_prompts(1), _cache_prompts(2)
    sp = {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}
    runs = {}
    for name, server in (("cache", roomy), ("nocache", nocache)):
        seq = [server.generate(input_ids=p, sampling_params=sp) for p in one_by_one]
        batch = server.generate(input_ids=all_at_once, sampling_params=sp)
        runs[name] = ([o["output_ids"] for o in seq], [o["output_ids"] for o in batch])
        cached = [o["meta_info"]["cached_tokens"] for o in seq + batch]
        if name == "cache":  # the shared prefix was really reused, also within the batch
            assert cached[1] >= 144 and cached[2] >= 144 and cached[7] >= 144, cached
            assert max(cached[9:11]) >= 144, cached
        else:
            assert cached == [0] * len(cached)
    assert runs["cache"][0] == runs["nocache"][0]  # one at a time
    assert runs["cache"][1] == runs["nocache"][1]  # all at once (in-batch prefix sharing)
    again = roomy.generate(input_ids=all_at_once, sampling_params=sp)  # now all cached
    assert [o["output_ids"] for o in again] == runs["cache"][1]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again[:4])
    roomy.assert_clean()
    nocache.assert_clean()


# ---- 2. cached_tokens for a shared prefix ---------------------------------------------------
@pytest.mark.isa_invariance
@pytest.mark.parametrize("which, page_size", [("roomy", 16), ("page1", 1), ("nocache", 16)])
def test_cached_tokens_for_shared_prefix(request, which, page_size):
    server: Server = request.getfixturevalue(which)
    prefix = ids(200, 100 + page_size)
    sp = {**GREEDY, "max_new_tokens": 2}
    first = server.generate(input_ids=prefix + ids(3, 7), sampling_params=sp)
    second = server.generate(input_ids=prefix + ids(2, 8), sampling_params=sp)
    assert first["meta_info"]["cached_tokens"] == 0
    cached = second["meta_info"]["cached_tokens"]
    if which == "nocache":
        assert cached == 0
    else:
        assert 200 // page_size * page_size <= cached <= 201, cached
    # the very same prompt again: all but the last token can come from the cache
    again = server.generate(input_ids=prefix + ids(2, 8), sampling_params=sp)
    assert again["output_ids"] == second["output_ids"]
    if which != "nocache":
        assert again["meta_info"]["cached_tokens"] == 201 // page_size * page_size
    server.assert_clean()


# ---- 3 + 4. many concurrent streams ---------------------------------------------------------
def test_64_concurrent_streams_match_non_streamed_greedy(roomy):
    before = roomy.info()["stats"]
    texts = [f"Question {i}: how are you today? {'fox ' * (i % 5)}" for i in range(64)]
    sp = {**GREEDY, "max_new_tokens": 16, "ignore_eos": True}
    reference = roomy.generate(text=texts, sampling_params=sp)
    assert [r["meta_info"]["prompt_tokens"] > 0 for r in reference] == [True] * 64

    barrier = threading.Barrier(64)

    def client(i: int) -> tuple[list[dict[str, Any]], bool]:
        barrier.wait(timeout=60)
        return stream(roomy, {"text": texts[i], "sampling_params": sp})

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(client, range(64)))

    for i, (events, done) in enumerate(results):
        assert done, f"stream {i} did not end with data: [DONE]"
        assert events, f"stream {i} had no events"
        prev_text, prev_tokens = "", 0
        for ev in events[:-1]:
            assert ev["meta_info"]["finish_reason"] is None
        for ev in events:
            assert ev["text"].startswith(prev_text), (i, prev_text, ev["text"])
            assert ev["meta_info"]["completion_tokens"] >= prev_tokens
            prev_text, prev_tokens = ev["text"], ev["meta_info"]["completion_tokens"]
        last = events[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
        assert last["text"] == reference[i]["text"], i
        assert last["output_ids"] == reference[i]["output_ids"], i
    after = roomy.assert_clean()["stats"]
    assert after["num_requests_finished"] - before["num_requests_finished"] == 128


# ---- 5. retraction under a tiny KV pool -----------------------------------------------------
def test_retraction_under_memory_pressure(tight, roomy):
    prompts = [ids(100, 500 + i) for i in range(16)]
    sp = {**GREEDY, "max_new_tokens": 120, "ignore_eos": True}
    reference = roomy.generate(input_ids=prompts, sampling_params=sp)
    before = tight.info()["stats"]["num_retractions"]

    def client(i: int) -> dict[str, Any]:
        return tight.generate(input_ids=prompts[i], sampling_params=sp)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(client, range(16)))
    for i, out in enumerate(outs):
        assert out["meta_info"]["completion_tokens"] == 120
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
        assert out["output_ids"] == reference[i]["output_ids"], i
    info = tight.assert_clean()
    assert info["stats"]["num_retractions"] > before


@pytest.mark.parametrize("which, sp, interval", [
    pytest.param("tight", {}, 3, id="server-flag"),
    pytest.param("roomy", {"stream_interval": 5}, 5, id="request-param",
                 marks=pytest.mark.backend_independent),
    pytest.param("tight", {"stream_interval": 6}, 6, id="request-overrides-flag",
                 marks=pytest.mark.backend_independent)])
def test_stream_interval(request, roomy, which, sp, interval):
    """A streamed request gets its first update, then one per `interval` new tokens or more
    (several can arrive in one step: drafts, jump-forward), then its final result; the text
    is the non-streamed one. A request's own interval overrides --stream-interval."""
    sp = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True, **sp}
    prompt = ids(20, 1900)
    reference = roomy.generate(input_ids=prompt, sampling_params=sp)
    events, done = stream(request.getfixturevalue(which), {"input_ids": prompt,
                                                           "sampling_params": sp})
    assert done
    counts = [ev["meta_info"]["completion_tokens"] for ev in events]
    assert counts[0] >= 1 and counts[-1] == 40, counts
    assert all(b - a >= interval for a, b in zip(counts[:-2], counts[1:-1], strict=True)), counts
    assert events[-1]["text"] == reference["text"]
    assert events[-1]["output_ids"] == reference["output_ids"]


# ---- 6. native API details ------------------------------------------------------------------
@pytest.mark.backend_independent
def test_batch_text_answers_a_list_in_order(roomy):
    texts = ["alpha", "The quick brown fox", "Hello world! How are", "0123"]
    sp = {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}
    singles = [roomy.generate(text=t, sampling_params=sp) for t in texts]
    batch = roomy.generate(text=texts, sampling_params=sp)
    assert isinstance(batch, list) and len(batch) == len(texts)
    for b, s in zip(batch, singles, strict=True):
        assert b["output_ids"] == s["output_ids"]
        assert b["text"] == s["text"]
        assert b["meta_info"]["prompt_tokens"] == s["meta_info"]["prompt_tokens"]
    assert len({b["meta_info"]["id"] for b in batch}) == len(texts)


@pytest.mark.backend_independent
def test_input_ids_single_and_batch(roomy):
    prompts = [ids(5, 1000), ids(12, 1001), ids(1, 1002)]
    sp = {**GREEDY, "max_new_tokens": 5, "ignore_eos": True}
    single = roomy.generate(input_ids=prompts[0], sampling_params=sp)
    assert isinstance(single, dict)
    assert single["meta_info"]["prompt_tokens"] == 5
    assert len(single["output_ids"]) == 5
    batch = roomy.generate(input_ids=prompts, sampling_params=sp)
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [5, 12, 1]
    assert batch[0]["output_ids"] == single["output_ids"]
    # per-prompt sampling params in a batch
    batch2 = roomy.generate(input_ids=prompts[:2], sampling_params=[
        {**sp, "max_new_tokens": 2}, {**sp, "max_new_tokens": 4}])
    assert [b["meta_info"]["completion_tokens"] for b in batch2] == [2, 4]


def test_max_new_tokens_zero_prefills_into_the_cache(roomy):
    prompt = ids(40, 1100)
    out = roomy.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert out["text"] == ""
    assert out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] == 40
    assert out["meta_info"]["completion_tokens"] == 0
    nxt = roomy.generate(input_ids=prompt + [7, 8], sampling_params={**GREEDY,
                                                                      "max_new_tokens": 1})
    assert nxt["meta_info"]["cached_tokens"] >= 32
    text = roomy.generate(text="Hello world! How are you", sampling_params={"max_new_tokens": 0})
    assert text["text"] == "" and text["meta_info"]["prompt_tokens"] > 0
    roomy.assert_clean()


def test_logprobs(roomy, nocache):
    prompt = ids(37, 1200)
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 5,
                                                     "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0}
    plain = roomy.generate(**body)["meta_info"]
    itl = plain["input_token_logprobs"]
    assert len(itl) == 37
    assert itl[0][0] is None
    assert [e[1] for e in itl] == prompt
    assert all(len(e) == 3 and e[2] is None for e in itl)
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in itl[1:])
    otl = plain["output_token_logprobs"]
    assert len(otl) == 5 and all(e[0] <= 0 and e[2] is None for e in otl)

    with_text = roomy.generate(**body, return_text_in_logprobs=True, top_logprobs_num=3)
    meta = with_text["meta_info"]
    assert all(isinstance(e[2], str) for e in meta["input_token_logprobs"])
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    # the same prompt again, now cached: prompt log-probs must still be computed, and agree
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt
    # (2e-3: the cached run's batch has another shape, so other GEMM/attention kernels run)
    for a, b in zip(meta["input_token_logprobs"][1:], itl[1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=2e-3)
    # top log-probs: that many entries, sorted, greedy picks the best
    assert len(meta["output_top_logprobs"]) == 5
    for tok, tops in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                         strict=True):
        assert len(tops) == 3
        assert [t[0] for t in tops] == sorted((t[0] for t in tops), reverse=True)
        assert tops[0][1] == tok[1] and tops[0][0] == pytest.approx(tok[0], abs=1e-4)
        assert all(isinstance(t[2], str) for t in tops)
    itop = meta["input_top_logprobs"]
    assert len(itop) == 37 and itop[0] is None
    for e, tops in zip(meta["input_token_logprobs"][1:], itop[1:], strict=True):
        assert len(tops) == 3 and e[0] <= tops[0][0] + 1e-5

    # a later start: positions [start, prompt_len), the first one null (as SGLang), the rest
    # the same values
    part = roomy.generate(**{**body, "logprob_start_len": 30})["meta_info"]
    assert [e[1] for e in part["input_token_logprobs"]] == prompt[30:]
    assert part["input_token_logprobs"][0][0] is None
    for a, b in zip(part["input_token_logprobs"][1:], itl[31:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    # the same numbers from a server without the radix cache
    cold = nocache.generate(**body)["meta_info"]
    for a, b in zip(cold["input_token_logprobs"][1:], itl[1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
    # logprob_start_len -1: no input log-probs (as SGLang)
    none = roomy.generate(**{**body, "logprob_start_len": -1})["meta_info"]
    assert none["input_token_logprobs"] == []
    assert len(none["output_token_logprobs"]) == 5
    # sgl.select's scoring call: prefill only, a batch, a start inside the prompt
    choices = [prompt + ids(3, 1300), prompt + ids(5, 1301)]
    scored = roomy.generate(input_ids=choices, sampling_params={**GREEDY, "max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=35,
                            return_text_in_logprobs=True)
    assert [len(s["meta_info"]["input_token_logprobs"]) for s in scored] == [5, 7]
    assert all(s["text"] == "" for s in scored)
    roomy.assert_clean()


def _clean_ascii_stop(text: str) -> tuple[int, str] | None:
    """A 2-character ASCII stop string first occurring at p >= 1 after clean text."""
    for p in range(1, len(text) - 1):
        s = text[p : p + 2]
        if "\ufffd" in text[: p + 2]:
            return None
        if all(33 <= ord(c) < 127 for c in s) and text.find(s) == p:
            return p, s
    return None


@pytest.mark.backend_independent
def test_stop_strings_trim_text(roomy):
    sp = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    for prompt in ("The quick brown fox", "Hello world", "def add(a, b):", "I am fine",
                   "JSON looks like", "How are you today?", "Tokenizers split text"):
        full = roomy.generate(text=prompt, sampling_params=sp)
        found = _clean_ascii_stop(full["text"])
        if found:
            break
    else:
        pytest.fail("no greedy output with a clean ASCII stop string candidate")
    p, stop = found
    out = roomy.generate(text=prompt, sampling_params={**sp, "stop": [stop, "never-seen-xyz"]})
    assert out["text"] == full["text"][:p]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    n = out["meta_info"]["completion_tokens"]
    assert n < 24 and out["output_ids"] == full["output_ids"][:n]
    # a single string (not a list) works too
    single = roomy.generate(text=prompt, sampling_params={**sp, "stop": stop})
    assert single["text"] == out["text"]


def test_stop_token_ids_min_and_max_new_tokens(roomy):
    prompt = ids(9, 1400)
    sp = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    full = roomy.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    assert len(full) == 24
    j = next(j for j in range(2, 24) if full[j] not in full[:j])
    tok = full[j]
    out = roomy.generate(input_ids=prompt, sampling_params={**sp, "stop_token_ids": [tok]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert out["output_ids"] == full[: j + 1]
    assert out["meta_info"]["completion_tokens"] == j + 1
    # the stop token's text is not part of the answer
    upto = roomy.generate(input_ids=prompt, sampling_params={**sp, "max_new_tokens": j})
    assert out["text"] == upto["text"]
    assert upto["meta_info"]["finish_reason"] == {"type": "length", "length": j}
    assert upto["output_ids"] == full[:j]
    # min_new_tokens: the stop token is masked (never sampled) before that many tokens, as
    # SGLang's min-new-tokens penalizer does; up to position j the output is unchanged
    late = roomy.generate(input_ids=prompt, sampling_params={
        **sp, "stop_token_ids": [tok], "min_new_tokens": j + 2})
    n = late["meta_info"]["completion_tokens"]
    assert n >= j + 2
    assert tok not in late["output_ids"][: j + 2]
    assert late["output_ids"][:j] == full[:j]


@pytest.mark.backend_independent
def test_n_2_returns_two(roomy):
    out = roomy.generate(text="Hello world", sampling_params={**GREEDY, "max_new_tokens": 4,
                                                              "n": 2, "ignore_eos": True})
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["output_ids"] == out[1]["output_ids"]
    assert out[0]["meta_info"]["id"] != out[1]["meta_info"]["id"]
    sampled = roomy.generate(text="Hello world", sampling_params={
        "temperature": 1.0, "max_new_tokens": 8, "n": 2, "seed": 5, "ignore_eos": True})
    assert len(sampled) == 2 and all(s["meta_info"]["completion_tokens"] == 8 for s in sampled)


@pytest.mark.backend_independent
def test_n_above_limit_rejected(roomy):
    r = roomy.post("/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 1, "n": 65}})
    assert_error(r, "n")


@pytest.mark.backend_independent
def test_flush_cache_get_and_post(roomy):
    prompt = ids(80, 1500)
    roomy.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert roomy.wait_idle()["memory"]["num_pages_tree"] > 0
    for method, kw in (("get", {}), ("post", {}), ("post", {"data": "{}"})):
        r = getattr(roomy, method)("/flush_cache", **kw)
        assert r.status_code == 200, (method, r.text)
    info = roomy.assert_clean()
    assert info["memory"]["num_pages_tree"] == 0
    again = roomy.generate(input_ids=prompt + [9], sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 0


@pytest.mark.backend_independent
def test_abort_request_ends_a_streaming_request(roomy):
    rid = f"abort-{uuid.uuid4().hex}"
    before = roomy.info()["stats"]["generated_tokens"]
    aborted = []

    def on_event(event, _response):
        if not aborted and event["meta_info"]["completion_tokens"] >= 1:
            r = roomy.post("/abort_request", {"rid": rid})
            aborted.append(r.status_code)
        return False

    events, done = stream(roomy, {"input_ids": ids(5, 1600), "rid": rid, "sampling_params": {
        **GREEDY, "max_new_tokens": 480, "ignore_eos": True}}, on_event=on_event)
    assert aborted == [200]
    assert done
    reason = events[-1]["meta_info"]["finish_reason"]
    assert reason is not None and reason["type"] == "abort", reason
    assert events[-1]["meta_info"]["completion_tokens"] < 480
    info = roomy.assert_clean()
    assert info["stats"]["generated_tokens"] - before < 480


@pytest.mark.backend_independent
def test_client_disconnect_frees_the_request(roomy):
    before = roomy.info()["stats"]["generated_tokens"]

    def on_event(event, response):
        if event["meta_info"]["completion_tokens"] >= 1:
            response.close()
            return True
        return False

    events, _ = stream(roomy, {"input_ids": ids(5, 1700), "sampling_params": {
        **GREEDY, "max_new_tokens": 480, "ignore_eos": True}}, on_event=on_event)
    assert events
    info = roomy.assert_clean()
    assert info["stats"]["generated_tokens"] - before < 480, "request ran to the end"


@pytest.mark.backend_independent
def test_info_and_health_routes(roomy, tiny_model):
    info = roomy.get("/get_model_info")
    assert info.status_code == 200
    assert info.json()["tokenizer_path"] == tiny_model
    assert info.json()["model_path"].startswith(tiny_model)
    assert info.json()["is_generation"] is True
    for path in ("/health", "/health_generate"):
        assert roomy.get(path).status_code == 200, path
    old = roomy.get("/get_server_info")
    assert old.status_code == 200 and "memory" in old.json()
    mem = old.json()["memory"]  # the KV pool's resolved element type and its bytes
    assert mem["kv_cache_dtype"] in ("float32", "bfloat16") and mem["kv_bytes"] > 0


def test_no_leaked_pages_after_all_roomy_traffic(roomy):
    info = roomy.assert_clean()
    assert info["stats"]["num_requests_finished"] > 0
    # flush after everything: the tree gives every page back
    assert roomy.post("/flush_cache").status_code == 200
    mem = roomy.assert_clean()["memory"]
    assert mem["num_pages_free"] == mem["num_pages_total"]


# ---- 7. bad input ---------------------------------------------------------------------------
BAD_INPUTS = [
    ("malformed json", '{"text": "hi", "sampling_params": {', ("json",)),
    ("not an object", "[1, 2]", ("object",)),
    ("max_new_tokens string", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
     ("max_new_tokens",)),
    ("max_new_tokens float", {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}},
     ("max_new_tokens",)),
    ("max_new_tokens negative", {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
     ("max_new_tokens",)),
    ("unknown sampling parameter", {"text": "hi", "sampling_params": {"temprature": 0.5}},
     ("temprature",)),
    ("negative temperature", {"text": "hi", "sampling_params": {"temperature": -1}},
     ("temperature",)),
    ("huge temperature", {"text": "hi", "sampling_params": {"temperature": 1e300}},
     ("temperature",)),
    ("infinite temperature", '{"text": "hi", "sampling_params": {"temperature": 1e999}}',
     ("temperature",)),
    ("NaN temperature", '{"text": "hi", "sampling_params": {"temperature": NaN}}', ()),
    ("top_p 0", {"text": "hi", "sampling_params": {"top_p": 0}}, ("top_p",)),
    ("top_p 2", {"text": "hi", "sampling_params": {"top_p": 2}}, ("top_p",)),
    ("stop not a list", {"text": "hi", "sampling_params": {"stop": 5}}, ("stop",)),
    ("sampling_params a string", {"text": "hi", "sampling_params": "greedy"},
     ("sampling_params",)),
    ("empty text", {"text": ""}, ("empty",)),
    ("empty input_ids", {"input_ids": []}, ("empty",)),
    ("empty batch", {"text": []}, ("empty",)),
    ("empty prompt in a batch", {"input_ids": [[5, 6], []]}, ("empty",)),
    ("out-of-vocab id", {"input_ids": [5, 6, 100000]}, ("input_ids",)),
    ("negative id", {"input_ids": [5, -1]}, ("input_ids",)),
    ("prompt longer than the context", {"input_ids": ids(300, 1800)}, ("context",)),
    ("max_new_tokens beyond the context",
     {"input_ids": ids(10, 1801), "sampling_params": {"max_new_tokens": 1000}}, ("context",)),
    ("text and input_ids", {"text": "hi", "input_ids": [5, 6]}, ("text", "input_ids")),
    ("neither text nor input_ids", {"sampling_params": {"max_new_tokens": 1}},
     ("text", "input_ids")),
    ("too many top logprobs", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6},
     ("top_logprobs_num",)),
    ("logprob_start_len past the prompt",
     {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},
     ("logprob_start_len",)),
    ("streaming a batch", {"text": ["a", "b"], "stream": True}, ("stream",)),
    ("stream_interval 0", {"text": "hi", "sampling_params": {"stream_interval": 0}},
     ("stream_interval",)),
    ("rid not a string", {"text": "hi", "rid": 5}, ("rid",)),
]


@pytest.mark.backend_independent
@pytest.mark.parametrize("body, words", [(b, w) for _, b, w in BAD_INPUTS],
                         ids=[name for name, _, _ in BAD_INPUTS])
def test_bad_input_is_a_4xx_naming_the_problem(nocache, body, words):
    data = body if isinstance(body, str) else json.dumps(body)
    r = nocache.post("/generate", data=data)
    assert_error(r, *words)


@pytest.mark.backend_independent
def test_server_keeps_serving_after_bad_input(nocache):
    for _, body, _ in BAD_INPUTS:  # all of them again, back to back
        data = body if isinstance(body, str) else json.dumps(body)
        assert 400 <= nocache.post("/generate", data=data).status_code < 500
    ok = nocache.generate(text="Hello world", sampling_params={**GREEDY, "max_new_tokens": 3,
                                                               "ignore_eos": True})
    assert ok["meta_info"]["completion_tokens"] == 3
    assert nocache.get("/health").status_code == 200
    nocache.assert_clean()


@pytest.mark.backend_independent
def test_api_key(nocache):
    url = nocache.url
    assert requests.get(url + "/health", timeout=30).status_code == 200  # open without a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = requests.post(url + "/generate", json={"text": "hi"}, headers=headers, timeout=30)
        assert_error(r, "key", status=401)
        r = requests.get(url + "/get_model_info", headers=headers, timeout=30)
        assert r.status_code == 401
    assert nocache.get("/get_model_info").status_code == 200
    assert nocache.generate(text="hi", sampling_params={"max_new_tokens": 1})["text"] is not None


# ---- 8. a dying child (these run last: they may take their server down) ---------------------
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


def test_huge_top_k_is_rejected_not_fatal(nocache):
    r = nocache.post("/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "top_k": 2**40}})
    ok = nocache.post("/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "top_k": 2**31 - 1}})
    # rejected (4xx) or clamped to the vocabulary (200); never a dead scheduler
    assert r.status_code < 500, r.text
    assert ok.status_code < 500, ok.text
    assert nocache.get("/health").status_code == 200
    assert nocache.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})


@pytest.mark.backend_independent
def test_dying_scheduler_takes_the_server_down_without_orphans(page1):
    server = page1
    assert server.get("/health").status_code == 200
    launcher = server.handle.proc
    children = _children(launcher.pid)
    schedulers = [server.get("/server_info").json()["scheduler_pid"]]
    assert schedulers[0] in children, children
    # a request in flight when the scheduler dies must end (with an error), not hang
    in_flight: dict[str, Any] = {}
    started = threading.Event()

    def on_event(event, _response):
        started.set()
        return False

    def client() -> None:
        try:
            in_flight["events"], in_flight["done"] = stream(server, {
                "input_ids": ids(5, 1900), "sampling_params": {
                    **GREEDY, "max_new_tokens": 480, "ignore_eos": True}}, on_event=on_event)
        except Exception as e:  # recorded, checked below
            in_flight["error"] = e

    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert started.wait(60), "the streaming request produced nothing"
    os.kill(schedulers[0], signal.SIGKILL)

    deadline = time.monotonic() + 10
    while True:  # unhealthy (or gone) within 10 s
        try:
            status = requests.get(server.url + "/health", timeout=5).status_code
        except requests.RequestException:
            status = None
        if status != 200:
            break
        assert time.monotonic() < deadline, "/health still 200 after the scheduler died"
        time.sleep(0.1)
    t.join(30)
    assert not t.is_alive(), "in-flight request hung after the scheduler died"
    assert "error" not in in_flight, in_flight["error"]
    events = in_flight["events"]
    assert in_flight["done"], "the failed stream was not closed with data: [DONE]"
    assert all(e.get("meta_info", {}).get("finish_reason") is None for e in events[:-1])
    assert "scheduler" in events[-1].get("error", {}).get("message", ""), events[-1]

    launcher.wait(timeout=30)  # the launcher exits by itself ...
    assert launcher.returncode != 0
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children):  # ... and leaves no child behind
        assert time.monotonic() < deadline, [c for c in children if _alive(c)]
        time.sleep(0.1)
