"""The Responses API's conversation routes and request options end to end with the real
`openai` client on the session's float32 server (tests/conftest.py): `input_items` pages over a
conversation, `DELETE`, output-text log-probs (`include`), `truncation` (auto drops the oldest
turn and says so; disabled is a 400), and `prompt_cache_key` naming the session on the chat,
completions and Responses routes, as the `X-SMG-Routing-Key` header does (seen as an open
session's pinned tokens), with `user`,
`safety_identifier` and `priority` accepted.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(default_model_server_f32) -> ServerHandle:
    return default_model_server_f32


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def test_input_items_list_the_conversation_and_delete_removes_it(client, server):
    first = client.responses.create(model="default", input=QUESTION, max_output_tokens=8,
                                    **GREEDY)
    second = client.responses.create(model="default", input="And of Germany?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     **GREEDY)
    items = client.responses.input_items.list(second.id)  # newest first
    assert [(it.type, getattr(it, "role", None)) for it in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[0].content[0].text == "And of Germany?"
    assert items.data[1].id == first.output[0].id  # the first turn's output, as returned
    assert items.data[2].content[0].type == "input_text"
    asc = client.responses.input_items.list(second.id, order="asc")
    assert [it.id for it in asc.data] == [it.id for it in reversed(items.data)]
    # one item per page; the client follows `after` / `has_more` through all of them
    paged = client.responses.input_items.list(second.id, limit=1)
    assert len(paged.data) == 1 and paged.has_more
    assert [it.id for it in paged] == [it.id for it in items.data]
    assert [it.id for it in client.responses.input_items.list(first.id).data] == [
        items.data[2].id]
    for query, needle in [("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")]:
        r = requests.get(f"{server.base_url}/v1/responses/{second.id}/input_items?{query}",
                         timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.input_items.list(second.id)
    r = requests.delete(f"{server.base_url}/v1/responses/{first.id}", timeout=30)
    assert r.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    r = requests.delete(f"{server.base_url}/v1/responses/{first.id}", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_include_output_text_logprobs(client):
    kw = dict(model="default", input=QUESTION, max_output_tokens=8, top_logprobs=2,
              include=["message.output_text.logprobs"], **GREEDY)
    r = client.responses.create(**kw)
    logprobs = r.output[0].content[0].logprobs
    assert logprobs and "".join(lp.token for lp in logprobs) == r.output_text
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)
    assert logprobs[0].top_logprobs[0].token == logprobs[0].token  # greedy: the best one
    events = list(client.responses.create(**kw, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.logprob for lp in done.logprobs] == pytest.approx(
        [lp.logprob for lp in logprobs], abs=1e-4)
    plain = client.responses.create(model="default", input=QUESTION, max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_turn_and_disabled_is_400(client, server):
    """The second turn asks for so many output tokens that the first turn no longer fits
    beside them: `auto` drops it (the stream's first event says so; the answer is abandoned
    after it), `disabled` (the default) is a 400 before anything runs."""
    context_len = server.info()["context_len"]
    first = client.responses.create(model="default", input=QUESTION, max_output_tokens=8,
                                    **GREEDY)
    alone = client.responses.create(model="default", input="And of Germany?",
                                    max_output_tokens=1, store=False)
    body = {"input": "And of Germany?", "previous_response_id": first.id,
            "max_output_tokens": context_len - alone.usage.input_tokens, "temperature": 0}
    with requests.post(server.base_url + "/v1/responses", timeout=120, stream=True,
                       json={**body, "truncation": "auto", "stream": True}) as r:
        assert r.status_code == 200, r.text
        line = next(ln for ln in r.iter_lines() if ln.startswith(b"data: "))
    created = json.loads(line[len(b"data: "):])
    assert created["type"] == "response.created"
    assert created["response"]["truncation"] == "auto"
    assert created["response"]["truncated_input_items"] == 2  # the first question and answer
    for extra in ({}, {"truncation": "disabled"}):
        r = requests.post(server.base_url + "/v1/responses", json={**body, **extra},
                          timeout=120)
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    # a conversation that fits is not truncated
    kept = client.responses.create(model="default", input="And of Germany?",
                                   previous_response_id=first.id, truncation="auto",
                                   max_output_tokens=4)
    assert kept.truncation == "auto" and "truncated_input_items" not in kept.model_extra
    assert len(client.responses.input_items.list(kept.id).data) == 3
    server.wait_idle()


def test_prompt_cache_key_names_the_session(client, server):
    """An open session pins the KV of every request that names it by `prompt_cache_key`;
    `user`, `safety_identifier` and `priority` are accepted on every route."""
    def listed() -> dict[str, int]:  # by public id (a keyed hash): never the session's id
        info = requests.get(server.base_url + "/server_info", timeout=30).json()
        return {s["id"]: s["pinned_tokens"] for s in info["sessions"]["open"]}

    ids = {"user": "u-1", "safety_identifier": "sid-hash"}
    for route in ("chat", "completions", "responses", "responses-header"):
        sid = f"pck-{route}"
        before = listed()
        r = requests.post(server.base_url + "/open_session", json={"session_id": sid},
                          timeout=30)
        assert r.json() == sid, r.text
        (public_id,) = set(listed()) - set(before)
        assert listed()[public_id] == 0 and sid not in str(listed())
        if route == "chat":
            client.chat.completions.create(
                model="default", max_tokens=2, prompt_cache_key=sid, **ids,
                messages=[{"role": "user", "content": QUESTION}], extra_body={"priority": 3})
        elif route == "completions":
            client.completions.create(model="default", prompt=QUESTION * 3, max_tokens=2,
                                      extra_body={"prompt_cache_key": sid, "priority": 3,
                                                  **ids})
        elif route == "responses":
            client.responses.create(model="default", input=QUESTION, max_output_tokens=2,
                                    prompt_cache_key=sid, store=False, **ids,
                                    extra_body={"priority": 3})
        else:  # the router's routing header names the session too
            client.responses.create(model="default", input=QUESTION, max_output_tokens=2,
                                    extra_headers={"X-SMG-Routing-Key": sid})
        assert listed()[public_id] > 0, route
        assert requests.post(server.base_url + "/close_session", json={"session_id": sid},
                             timeout=30).status_code == 200
    r = requests.post(server.base_url + "/v1/responses", timeout=30,
                      json={"input": "hi", "priority": "high"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]
