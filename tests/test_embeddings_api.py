"""`/v1/embeddings` and `/encode` on the default model, with the real `openai` client and
`requests`: the vectors against transformers' float32 forward of the same GGUF (its hidden
states after the final norm, pooled the same way), base64 and float encodings, batches,
prefix-cache hits, `dimensions`, `normalize`, and bad inputs (400 in OpenAI's error shape).

The float32 session server pools `last` (the default); one more small server pools `mean`, with
a prefill chunk small enough that the prompts here run in several chunks."""

from __future__ import annotations

import base64
import os
import uuid

import numpy as np
import openai
import pytest
import requests
from server_harness import DEFAULT_MODEL_F32_FLAGS, SERVED_F32, launch_server

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.",
         "Radix trees share prefixes between requests.",
         "hello",
         "A much longer sentence about agents that call tools, read their outputs and then "
         "decide what to do next, many times over."]
MIN_COSINE = 0.999  # against the float32 reference (measured: 1 - 1e-7)
SAME = dict(rtol=0, atol=2e-5)  # one server, one vector computed two ways (unit vectors)


@pytest.fixture(scope="module")
def tokenizer():
    from sgl_tpu.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def reference():
    """ids -> float32 hidden states [P, D] after the final norm, from transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_tpu.loader import default_model_path

    path = default_model_path()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()

    return hidden


@pytest.fixture(scope="module")
def server(default_model_server_f32):
    return default_model_server_f32


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def mean_server():
    handle = launch_server(*DEFAULT_MODEL_F32_FLAGS, "--max-total-tokens", "4096",
                           "--chunked-prefill-size", "64", "--pooling", "mean")
    yield handle
    handle.stop()


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.base_url + path, json=body, timeout=120)


def test_openai_client_float_and_base64(client, tokenizer, reference):
    """The client's default (base64, decoded by the client) and `float` give the same unit
    vectors, one per input with its index, close to the float32 reference's last row."""
    default = client.embeddings.create(model=SERVED_F32, input=TEXTS)
    floats = client.embeddings.create(model=SERVED_F32, input=TEXTS, encoding_format="float")
    ids = [tokenizer.encode(t) for t in TEXTS]
    for resp in (default, floats):
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
        assert resp.model == SERVED_F32
    for d_default, d_float, prompt in zip(default.data, floats.data, ids, strict=True):
        assert len(d_float.embedding) == 576  # SmolLM2-135M's hidden size
        assert abs(np.linalg.norm(d_float.embedding) - 1) < 1e-5
        np.testing.assert_allclose(d_default.embedding, d_float.embedding, **SAME)
        assert cosine(d_float.embedding, reference(prompt)[-1]) >= MIN_COSINE


def test_base64_is_little_endian_float32(server):
    body = {"input": TEXTS[0]}
    encoded = post(server, "/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    floats = post(server, "/v1/embeddings", body).json()
    raw = encoded["data"][0]["embedding"]
    assert isinstance(raw, str)
    decoded = np.frombuffer(base64.b64decode(raw), "<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats["data"][0]["embedding"], "<f4"))


def test_token_id_inputs_match_text(client, tokenizer):
    """A list of ids, and a list of id lists, embed as their text does."""
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=SERVED_F32, input=TEXTS[:2])
    by_ids = client.embeddings.create(model=SERVED_F32, input=ids)
    one = client.embeddings.create(model=SERVED_F32, input=ids[1])
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, **SAME)
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[1].embedding, **SAME)


def test_alone_and_in_a_batch_agree(client):
    alone = client.embeddings.create(model=SERVED_F32, input=TEXTS[1]).data[0].embedding
    batch = client.embeddings.create(model=SERVED_F32, input=[TEXTS[3], TEXTS[0], TEXTS[1]])
    np.testing.assert_allclose(batch.data[2].embedding, alone, **SAME)


def test_prefix_cache_hit_gives_the_cold_vector(server):
    """The second request of a prompt finds it in the radix cache (`last` pooling reuses
    prefixes) and pools the same vector."""
    text = f"Session {uuid.uuid4().hex}: " + TEXTS[3] * 2
    cold = post(server, "/encode", {"text": text}).json()
    warm = post(server, "/encode", {"text": text}).json()
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= 16  # at least a page
    assert warm["meta_info"]["prompt_tokens"] == cold["meta_info"]["prompt_tokens"]
    np.testing.assert_allclose(warm["embedding"], cold["embedding"], **SAME)


def test_dimensions_and_normalize(client, server, tokenizer, reference):
    """`normalize: false` (vLLM's field) is the raw pooled state; `dimensions` keeps its first
    values and normalizes them again."""
    raw = post(server, "/v1/embeddings", {"input": TEXTS[0], "normalize": False}).json()
    raw = np.asarray(raw["data"][0]["embedding"])
    expected = reference(tokenizer.encode(TEXTS[0]))[-1]
    assert abs(np.linalg.norm(raw) - np.linalg.norm(expected)) < 1e-3 * np.linalg.norm(expected)
    short = client.embeddings.create(model=SERVED_F32, input=TEXTS[0], dimensions=32,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 32
    np.testing.assert_allclose(short, unit(raw[:32]), **SAME)


def test_encode_single_and_batch(server, tokenizer):
    """SGLang's `/encode`: one dict for a prompt, a list in order for a batch."""
    one = post(server, "/encode", {"text": TEXTS[2]})
    assert one.status_code == 200
    one = one.json()
    assert set(one) == {"embedding", "meta_info"}
    assert one["meta_info"]["prompt_tokens"] == len(tokenizer.encode(TEXTS[2]))
    assert abs(np.linalg.norm(one["embedding"]) - 1) < 1e-5
    batch = post(server, "/encode", {"text": TEXTS[:3], "rid": ["a1", "a2", "a3"]}).json()
    assert [r["meta_info"]["id"] for r in batch] == ["a1", "a2", "a3"]
    np.testing.assert_allclose(batch[2]["embedding"], one["embedding"], **SAME)
    by_ids = post(server, "/encode", {"input_ids": tokenizer.encode(TEXTS[2])}).json()
    np.testing.assert_allclose(by_ids["embedding"], one["embedding"], **SAME)


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input list is empty"),
    ({"input": ""}, "input is empty"),
    ({"input": ["fine", ""]}, "input[1] is empty"),
    ({"input": [[1, 2], []]}, "input[1] is empty"),
    ({"input": [[1, 10**7]]}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions must be in [1, 576]"),
    ({"input": "hi", "dimensions": 577}, "dimensions must be in [1, 576]"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "model": f"{SERVED_F32}:lora1"}, "adapter"),
    ({"input": [1.5]}, "input"),
])
def test_bad_embedding_inputs_are_400(server, body, message):
    resp = post(server, "/v1/embeddings", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and message in error["message"], error


def test_input_longer_than_the_context_is_400(client, server):
    context_len = requests.get(server.base_url + "/server_info", timeout=30).json()["context_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=SERVED_F32, input=[[1, 2], [1] * (context_len + 1)])
    assert "input[1]" in str(e.value) and "context length" in str(e.value)
    resp = post(server, "/encode", {"text": "a", "input_ids": [1]})
    assert resp.status_code == 400 and "exactly one" in resp.json()["error"]["message"]
    server.wait_idle()  # nothing was left running


def test_mean_pooling_across_chunks(mean_server, tokenizer, reference):
    """`--pooling mean` over prompts longer than the prefill chunk (64 tokens): the mean of
    the reference's rows; a repeated prompt matches no cached prefix and gives the same
    vector."""
    client = openai.OpenAI(base_url=mean_server.base_url + "/v1", api_key="x", max_retries=0)
    texts = [TEXTS[3] * 6, TEXTS[0]]
    ids = [tokenizer.encode(t) for t in texts]
    assert len(ids[0]) > 2 * 64
    resp = client.embeddings.create(model="m", input=texts, encoding_format="float")
    for d, prompt in zip(resp.data, ids, strict=True):
        assert cosine(d.embedding, reference(prompt).mean(axis=0)) >= MIN_COSINE
    again = post(mean_server, "/encode", {"text": texts[0]}).json()
    assert again["meta_info"]["cached_tokens"] == 0
    np.testing.assert_allclose(again["embedding"], resp.data[0].embedding, **SAME)
