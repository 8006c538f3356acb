"""End-to-end tests of the OpenAI API and `/metrics`, driven by the real `openai` client against
a real server (a tiny random-weight model: outputs are gibberish but deterministic under greedy
decoding, which is all these tests compare).

The server is the session's pooled float32 tiny-model server (TINY_F32 in
tests/server_harness.py), shared with tests/test_server_native.py and tests/test_structured.py.

Tests marked `backend_independent` run on the default backend only (`make test`'s JAX pass
deselects them): name routing, request validation, auth and metrics are answered by the HTTP
process whatever the executor, and so are the OpenAI layer's translations whose executor side
runs on JAX in tests/test_server_native.py (streaming equal to non-streaming, list prompts,
cached tokens, stop strings, a disconnect) and tests/test_structured.py (response_format,
json_schema); chat logprobs format the top log-probs test_completion_logprobs checks on JAX.
The default-model chat's path (ChatML template, greedy chat, streaming equal to
non-streaming) runs on JAX in tests/test_frontend.py on the same model.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import TINY_API_KEY, TINY_F32, TINY_NOCACHE_KEYED, TINY_SERVED_NAME

from sgl_tpu.detokenize import stop_safe_len as _safe_len

pytestmark = pytest.mark.slow

MODEL = TINY_SERVED_NAME
HELLO = [{"role": "user", "content": "Hello world! How are you today?"}]
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)


@pytest.fixture(scope="module")
def server(server_pool, tiny_model):
    """The session's float32 tiny-model server (tests/server_harness.py TINY_F32; float32:
    several tests compare greedy outputs across cache hits, streaming and batch sizes)."""
    return server_pool.get(*TINY_F32, model_path=tiny_model)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def greedy_chat(client: openai.OpenAI, max_tokens: int = 12, **kw):
    return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=max_tokens,
                                          temperature=0, **kw)


@pytest.mark.backend_independent
def test_models(client, tiny_model):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # the model path is accepted as a name too
    resp = client.completions.create(model=tiny_model, prompt="Hello", max_tokens=2)
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.isa_invariance
def test_chat_completion(client):
    resp = greedy_chat(client)
    assert resp.object == "chat.completion" and resp.model == MODEL
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert "<|im_end|>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.prompt_tokens > 10
    assert 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # greedy decoding is deterministic
    assert greedy_chat(client).choices[0].message.content == choice.message.content


@pytest.mark.backend_independent
@pytest.mark.isa_invariance
def test_chat_stream_matches_non_stream(client):
    expected = greedy_chat(client).choices[0].message.content
    chunks = list(greedy_chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("stop", "length") and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_n(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, n=2,
                                          temperature=1.0, seed=7)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert 2 <= resp.usage.completion_tokens <= 12
    assert resp.usage.prompt_tokens == greedy_chat(client, max_tokens=1).usage.prompt_tokens
    # the choices of a new prompt share its KV: one prefills, the other hits the radix cache
    prompt = "Hello world! " * 40
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2)
    assert len(resp.choices) == 2
    assert resp.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.backend_independent
@pytest.mark.isa_invariance
def test_completions_list_prompt_and_stream(client):
    prompts = ["The quick brown", "Hello world"]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                       temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5
    # streaming with n=2 per prompt: four choices, each equal to its prompt's greedy text
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                       temperature=0, stream=True)
    texts = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    expected = [c.text for c in resp.choices]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]


def test_completions_echo(client):
    resp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True,
                                     temperature=0, logprobs=1)
    choice = resp.choices[0]
    assert choice.text.startswith("Hello world")
    lp = choice.logprobs
    num_prompt = resp.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.token_logprobs[-1] <= 0


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n == 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # tokens that decode alike share a key
        assert chosen <= 0 and max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy


@pytest.mark.backend_independent
def test_chat_logprobs(client):
    resp = greedy_chat(client, max_tokens=4, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert greedy_chat(client, max_tokens=2).choices[0].logprobs is None


@pytest.mark.backend_independent
def test_cached_tokens(client):
    def run():
        return client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)

    first, second = run(), run()
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 100
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens


@pytest.mark.backend_independent
@pytest.mark.isa_invariance
def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = full[3:5]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    cut = full[: full.index(stop)]
    resp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12,
                                     temperature=0, stop=[stop])
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12,
                                       temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == cut


@pytest.mark.backend_independent
def test_response_format(client):
    resp = greedy_chat(client, max_tokens=4, response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="schema"):
        greedy_chat(client, response_format={"type": "json_schema", "json_schema": {}})


@pytest.mark.backend_independent
def test_completions_json_schema_extension(client):
    """SGLang's `json_schema` extension field constrains /v1/completions too."""
    schema = {"type": "object", "properties": {"tool": {"enum": ["search", "calc"]}},
              "required": ["tool"], "additionalProperties": False}
    resp = client.completions.create(model=MODEL, prompt="Call a tool:", max_tokens=40,
                                     temperature=0, extra_body={"json_schema": json.dumps(schema)})
    assert json.loads(resp.choices[0].text)["tool"] in ("search", "calc")
    with pytest.raises(openai.BadRequestError, match="(?i)schema|json"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"json_schema": "{not json"})


@pytest.mark.backend_independent
def test_any_model_name(client):
    """Any name is served by the one model (SGLang's docs send "default"); only SGLang's
    `served:adapter` form is parsed, and on a server without --enable-lora that is a 400;
    retrieving an unknown model 404s."""
    resp = client.chat.completions.create(model="default", messages=HELLO, max_tokens=2)
    assert resp.model == "default" and resp.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError,
                       match="adapter 'my-lora' requested, but LoRA is not enabled"):
        client.chat.completions.create(model=f"{MODEL}:my-lora", messages=HELLO, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.mark.backend_independent
@pytest.mark.parametrize("bad, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_values(client, bad, field):
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=MODEL, messages=HELLO, **bad)
    assert greedy_chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.backend_independent
def test_bad_messages(client, server):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    r = requests.post(server.base_url + "/v1/chat/completions", json={"model": MODEL},
                      timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = requests.post(server.base_url + "/v1/completions", data=b"{not json", timeout=30,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert greedy_chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.backend_independent
def test_metrics(client, server):
    greedy_chat(client, max_tokens=3)
    text = requests.get(server.base_url + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count"):
        assert samples[f"sglang:{name}"] > 0, name
    assert samples["sglang:num_running_reqs"] == 0
    assert 0 < samples["sglang:token_usage"] <= 1  # the radix tree holds finished prompts
    assert 0 <= samples["sglang:cache_hit_rate"] <= 1


@pytest.mark.backend_independent
def test_api_key(server_pool, tiny_model):
    keyed = server_pool.get(*TINY_NOCACHE_KEYED, model_path=tiny_model)
    assert requests.get(keyed.base_url + "/health", timeout=30).status_code == 200
    wrong = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=TINY_API_KEY, max_retries=0)
    assert right.models.list().data[0].id == MODEL
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]})):
        assert keyed.post(path, body, timeout=30).status_code == 401, path
        r = keyed.post(path, body, timeout=30, headers={"Authorization": f"Bearer {TINY_API_KEY}"})
        assert r.status_code == 200, (path, r.text)


@pytest.mark.backend_independent
def test_stream_disconnect_frees_the_request(client, server):
    generated_before = server.info()["stats"]["generated_tokens"]
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break  # hang up mid-stream
    info = server.wait_idle()  # the abandoned request ends
    assert info["stats"]["generated_tokens"] - generated_before < 400  # aborted, not finished
    assert info.get("integrity") == "ok"


@pytest.mark.backend_independent
def test_safe_len_holds_back_stop_prefixes():
    assert _safe_len("hello wor", ["world"]) == len("hello ")
    assert _safe_len("hello", ["xyz"]) == 5
    assert _safe_len("ab\n", ["\n\n", "b\nc"]) == 1
    assert _safe_len("", ["a"]) == 0


@pytest.mark.backend_independent
@pytest.mark.isa_invariance
def test_default_model_chat(default_model_server_f32):
    """The real default model (SmolLM2-135M; the session's float32 server of
    tests/conftest.py), where the text must make sense; the streamed answer (a cache hit) is
    the same text."""
    c = openai.OpenAI(base_url=default_model_server_f32.base_url + "/v1", api_key="x",
                      max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    kw = dict(model=model, max_tokens=24, temperature=0,
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    resp = c.chat.completions.create(**kw)
    content = resp.choices[0].message.content
    assert "Paris" in content and resp.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in content
    stream = c.chat.completions.create(**kw, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == content


@pytest.mark.backend_independent
@pytest.mark.isa_invariance
def test_default_model_length_forced_answer_holds_no_eos(default_model_server_f32):
    """A length-forced answer (`ignore_eos` with `min_new_tokens` = `max_new_tokens`, what
    benchmarks send) never samples EOS, as SGLang's min-new-tokens penalizer: the model's own
    answer ends in EOS within the length, `ignore_eos` alone keeps sampling past it (EOS
    included), `min_new_tokens` bans it, and the tokens before it are the same."""
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\n")

    def generate(**sp) -> dict:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                    **sp}}
        r = requests.post(default_model_server_f32.base_url + "/generate", json=body,
                          timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    natural = generate()
    reason = natural["meta_info"]["finish_reason"]
    assert reason["type"] == "stop", reason
    eos, k = reason["matched"], len(natural["output_ids"]) - 1
    assert natural["output_ids"][k] == eos and "Paris" in natural["text"]
    ignored = generate(ignore_eos=True)
    assert ignored["output_ids"][: k + 1] == natural["output_ids"]
    forced = generate(ignore_eos=True, min_new_tokens=32)
    assert len(forced["output_ids"]) == 32 and eos not in forced["output_ids"]
    assert forced["output_ids"][:k] == natural["output_ids"][:k]
