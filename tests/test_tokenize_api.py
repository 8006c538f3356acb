"""`/tokenize` and `/detokenize` on the session's float32 server (tests/conftest.py), in SGLang's
and vLLM's shapes: a prompt's ids are the ones `/generate` prefills, chat `messages` give exactly
the prompt a real chat completion reports as its `prompt_tokens` (the same template path), the
round trip through `/detokenize`, and bad input answered 400 in the OpenAI error shape. The
API key guard is checked in tests/test_openai_api.py (`test_api_key`).
"""

from __future__ import annotations

import openai
import pytest
import requests
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

TEXT = "The capital of France is Paris."
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(default_model_server_f32) -> ServerHandle:
    return default_model_server_f32


def post(server: ServerHandle, path: str, body: object) -> requests.Response:
    return requests.post(server.base_url + path, json=body, timeout=60)


def test_prompt_ids_are_what_generate_prefills(server):
    r = post(server, "/tokenize", {"prompt": TEXT})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == server.info()["context_len"]
    gen = post(server, "/generate", {"text": TEXT, "sampling_params": {"max_new_tokens": 0}})
    assert gen.json()["meta_info"]["prompt_tokens"] == out["count"]
    # vLLM's path and options: the same ids, and each token's vocabulary string
    v1 = post(server, "/v1/tokenize", {"model": "smol", "prompt": TEXT,
                                       "add_special_tokens": False, "return_token_strs": True})
    assert v1.json()["tokens"] == out["tokens"]  # this tokenizer adds no BOS
    assert len(v1.json()["token_strs"]) == out["count"]
    assert v1.json()["token_strs"][0] == "The"
    # SGLang's batch: one list per prompt
    batch = post(server, "/tokenize", {"prompt": [TEXT, "Hi"]}).json()
    assert batch["tokens"][0] == out["tokens"] and batch["count"] == [out["count"],
                                                                       len(batch["tokens"][1])]


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER_TOOL]}])
def test_messages_give_the_chat_completions_prompt(server, extra):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    chat = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=1,
                                          temperature=0, **extra)
    out = post(server, "/tokenize", {"model": "smol", "messages": MESSAGES, **extra}).json()
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    rendered = post(server, "/detokenize", {"tokens": out["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n")  # the generation prompt
    # add_generation_prompt false: the same conversation without the assistant's opening
    bare = post(server, "/v1/tokenize", {"messages": MESSAGES, **extra,
                                         "add_generation_prompt": False}).json()
    assert 0 < bare["count"] < out["count"]
    assert out["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trip_in_both_shapes(server):
    ids = post(server, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    out = post(server, "/detokenize", {"tokens": ids}).json()
    assert out == {"text": TEXT, "prompt": TEXT}
    end = post(server, "/tokenize", {"prompt": "<|im_end|>"}).json()["tokens"]
    assert len(end) == 1  # a special token
    out = post(server, "/v1/detokenize", {"tokens": ids + end}).json()
    assert out["text"] == TEXT  # SGLang: special tokens skipped by default
    assert out["prompt"] == TEXT + "<|im_end|>"  # vLLM: every token's text
    kept = post(server, "/detokenize", {"tokens": ids + end, "skip_special_tokens": False})
    assert kept.json()["text"] == TEXT + "<|im_end|>"
    batch = post(server, "/detokenize", {"tokens": [ids, ids[:1], []]}).json()
    assert batch["text"] == [TEXT, "The", ""]
    assert post(server, "/detokenize", {"tokens": []}).json() == {"text": "", "prompt": ""}


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", None, "JSON"),
    ("/tokenize", {}, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "exactly one of prompt and messages"),
    ("/v1/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, "role"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", None, "JSON"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens must be integers in [0, "),
    ("/v1/detokenize", {"tokens": [-1]}, "tokens must be integers in [0, "),
    ("/detokenize", {"tokens": [[1], [2, 10**6]]}, "tokens[1] must be integers"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
])
def test_bad_input_is_a_400_in_the_openai_shape(server, path, body, needle):
    if body is None:  # an empty body
        r = requests.post(server.base_url + path, data=b"",
                          headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert needle in error["message"], error
