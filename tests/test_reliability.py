"""Reliability end to end, on a real server (tiny random-weight model, loopback): every failure
of the reliability issue as a regression (a clear 4xx, and the server still serves with all
processes alive), the security defaults, a seeded `hypothesis` fuzz of every route's body with
zero 5xx, and the load / disconnect / KV-exhaustion / killed-child phases of the campaign at CI
size, each followed by the invariants (`reliability_invariants.py`; the long campaign:
`reliability_campaign.py`)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import requests
from reliability_fuzz import CLASSES, ROUTES, URL_ROUTES, run_fuzz, run_url_fuzz
from reliability_invariants import check_invariants
from reliability_phases import (
    child_pids,
    disconnect_phase,
    exhaustion_phase,
    kill_child_phase,
    load_phase,
)
from safetensors.numpy import save_file
from server_harness import REPO_ROOT, launch_server

pytestmark = pytest.mark.slow

KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
CAPACITY = 1024
MAX_BODY = 2**20
FLAGS = ("--skip-warmup", "--api-key", KEY, "--max-total-tokens", str(CAPACITY),
         "--max-running-requests", "16", "--chunked-prefill-size", "256",
         "--max-request-bytes", str(MAX_BODY), "--dtype", "float32")
FUZZ_EXAMPLES = 40  # per route and input class: 240 bodies per route
HUGE_VOCAB_ID = 10**6


@pytest.fixture(scope="module")
def server(tiny_model):
    handle = launch_server(*FLAGS, model_path=tiny_model)
    yield handle
    handle.stop()


def post(server, path: str, body=None, *, data: str | bytes | None = None,
         headers: dict[str, str] | None = None) -> requests.Response:
    """`body` as JSON (or `data` as it is) with the API key."""
    return server.post(path, data=json.dumps(body) if data is None else data,
                       headers=JSON if headers is None else headers, timeout=120)


def assert_serving(server) -> None:
    """All processes alive and clean: the launcher runs, /health is 200 (503 if a child died),
    idle, integrity ok, no KV page held, a small request answered."""
    assert server.proc.poll() is None, server.log_tail()
    check_invariants(server.base_url, AUTH)


def surrogate(field_json: str) -> str:
    return field_json.replace("SURROGATE", "\\ud800")


# (name, route, JSON text or body, expected status, words the message must contain)
BIG_SCHEMA = {"type": "object",
              "properties": {f"field_{i}": {"type": "integer"} for i in range(1000)}}
REGRESSIONS = [
    ("stop id beyond vocab + min_new_tokens", "/generate",
     {"text": "hi", "sampling_params": {"stop_token_ids": [HUGE_VOCAB_ID], "min_new_tokens": 2,
                                        "max_new_tokens": 4}}, 400, ("stop_token_ids",)),
    ("chat stop id beyond vocab + min_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [HUGE_VOCAB_ID],
      "min_tokens": 2, "max_tokens": 4}, 400, ("stop_token_ids",)),
    ("skip_special_tokens not a bool", "/generate",
     {"text": "hi", "sampling_params": {"skip_special_tokens": "no"}}, 400,
     ("skip_special_tokens",)),
    ("surrogate in prompt", "/generate", surrogate('{"text": "SURROGATE"}'), 400, ("text",)),
    ("surrogate in chat content", "/v1/chat/completions",
     surrogate('{"messages": [{"role": "user", "content": "aSURROGATE"}]}'), 400,
     ("messages[0].content",)),
    ("surrogate in stop", "/generate",
     surrogate('{"text": "hi", "sampling_params": {"stop": ["SURROGATE"]}}'), 400, ("stop",)),
    ("surrogate in rid", "/generate", surrogate('{"text": "hi", "rid": "SURROGATE"}'), 400,
     ("rid",)),
    ("surrogate in session_id", "/generate",
     surrogate('{"text": "hi", "session_id": "SURROGATE"}'), 400, ("session_id",)),
    ("surrogate in regex", "/generate",
     surrogate('{"text": "hi", "sampling_params": {"regex": "SURROGATE"}}'), 400, ("regex",)),
    ("surrogate in a key", "/generate", surrogate('{"SURROGATE": 1, "text": "hi"}'), 400,
     ("Unicode",)),
    ("JSON nested 5,000 deep", "/generate", "[" * 5000 + "]" * 5000, 400, ("nested",)),
    ("JSON nested 5,000 deep (chat)", "/v1/chat/completions",
     '{"messages": ' + "[" * 5000 + "]" * 5000 + "}", 400, ("nested",)),
    ("sampling_params: []", "/generate", {"text": "hi", "sampling_params": []}, 400,
     ("sampling_params",)),
    ("batch with a short sampling_params list", "/generate",
     {"text": ["a", "b", "c"], "sampling_params": [{"max_new_tokens": 1}]}, 400,
     ("sampling_params", "3")),
    ("batch with a short rid list", "/generate", {"text": ["a", "b"], "rid": ["x"]}, 400,
     ("rid",)),
    ("stop_token_ids beyond 64 bits", "/generate",
     {"text": "hi", "sampling_params": {"stop_token_ids": [2**70]}}, 400, ("64-bit",)),
    ("min_new_tokens beyond 64 bits", "/generate",
     {"text": "hi", "sampling_params": {"min_new_tokens": 2**70}}, 400, ("64-bit",)),
    ("custom_params beyond 64 bits", "/generate",
     {"text": "hi", "sampling_params": {"custom_params": {"a": 2**70}}}, 400, ("64-bit",)),
    ("logit_bias beyond 64 bits", "/v1/completions",
     {"prompt": "hi", "logit_bias": {"5": 2**70}}, 400, ("64-bit",)),
    ("NaN", "/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}', 400,
     ("NaN",)),
    ("self-referencing $ref", "/generate",
     {"text": "{", "sampling_params": {"max_new_tokens": 8,
                                       "json_schema": json.dumps({"$ref": "#"})}}, 400,
     ("recurses",)),
    ("mutually recursive $ref", "/generate",
     {"text": "{", "sampling_params": {"max_new_tokens": 8, "json_schema": json.dumps(
         {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
          "$ref": "#/$defs/a"})}}, 400, ("recurses",)),
    ("required self-reference", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
      "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {
          "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}}, 400,
     ("recurses",)),
    ("more chat messages than the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}] * 5000, "max_tokens": 1}, 400,
     ("messages",)),
    ("multi-megabyte prompt", "/generate",
     {"text": "word " * 180_000, "sampling_params": {"max_new_tokens": 1}}, 400,
     ("characters",)),
    ("Anthropic: no max_tokens", "/v1/messages",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 400, ("max_tokens",)),
    ("Anthropic: image block", "/v1/messages",
     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}, 400,
     ("image",)),
    ("Anthropic: tool_result content not text", "/v1/messages",
     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}]}]}, 400,
     ("messages[0].content[0].content",)),
    ("Anthropic: tool_use input not an object", "/v1/messages",
     {"model": "m", "max_tokens": 1, "messages": [
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                            "input": "[]"}]},
         {"role": "user", "content": "ok"}]}, 400, ("input",)),
    ("Anthropic: invalid input_schema", "/v1/messages",
     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": 5}}]}, 400, ("tools[0].input_schema",)),
    ("Anthropic: tool_choice names no tool", "/v1/messages",
     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, 400, ("'g'",)),
    ("Anthropic: five cache_control breakpoints", "/v1/messages/count_tokens",
     {"model": "m", "messages": [{"role": "user", "content": [
         {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}] * 5}]}, 400,
     ("cache_control",)),
    ("Anthropic: unknown cache_control ttl", "/v1/messages",
     {"model": "m", "max_tokens": 1, "system": [
         {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
      "messages": [{"role": "user", "content": "hi"}]}, 400, ("ttl",)),
    ("Anthropic: priority not an integer", "/v1/messages",
     {"model": "m", "max_tokens": 1, "priority": 1.5,
      "messages": [{"role": "user", "content": "hi"}]}, 400, ("priority",)),
    ("Responses: unknown include", "/v1/responses", {"input": "hi", "include": ["all"]}, 400,
     ("include",)),
    ("Responses: unknown truncation", "/v1/responses",
     {"input": "hi", "truncation": "sometimes"}, 400, ("truncation",)),
    ("Responses: unknown reasoning effort", "/v1/responses",
     {"input": "hi", "reasoning": {"effort": "max"}}, 400, ("reasoning.effort",)),
    ("Responses: top_logprobs 21", "/v1/responses", {"input": "hi", "top_logprobs": 21}, 400,
     ("top_logprobs",)),
    ("Responses: empty prompt_cache_key", "/v1/responses",
     {"input": "hi", "prompt_cache_key": ""}, 400, ("prompt_cache_key",)),
    ("Responses: truncation auto, the input alone too long", "/v1/responses",
     {"input": "word " * 3000, "truncation": "auto", "max_output_tokens": 1}, 400,
     ("prompt",)),
    ("chat: prompt_cache_key of 300 characters", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
      "prompt_cache_key": "k" * 300}, 400, ("prompt_cache_key",)),
    ("Anthropic: surrogate in system", "/v1/messages/count_tokens",
     surrogate('{"model": "m", "system": "SURROGATE", "messages": '
               '[{"role": "user", "content": "hi"}]}'), 400, ("system",)),
]


@pytest.mark.parametrize("route, body, status, words", [r[1:] for r in REGRESSIONS],
                         ids=[r[0] for r in REGRESSIONS])
def test_regression_is_a_clear_4xx(server, route, body, status, words):
    r = post(server, route, data=body if isinstance(body, str) else None,
             body=None if isinstance(body, str) else body)
    assert r.status_code == status, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message
    if route.startswith("/v1/messages"):  # Anthropic's error shape
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": message}}


def test_anthropic_routes_take_x_api_key(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for headers, status in (({"x-api-key": KEY}, 200), ({"x-api-key": "wrong"}, 401), ({}, 401)):
        r = post(server, "/v1/messages/count_tokens", body,
                 headers={"Content-Type": "application/json", **headers})
        assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == "authentication_error"


def test_server_serves_after_every_regression(server):
    for _, route, body, _, _ in REGRESSIONS:  # all again, back to back
        r = post(server, route, data=body if isinstance(body, str) else None,
                 body=None if isinstance(body, str) else body)
        assert 400 <= r.status_code < 500
    assert_serving(server)


@pytest.mark.parametrize("route, body", [
    ("/generate", {"text": "{", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "json_schema": json.dumps(BIG_SCHEMA)}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON"}],
                              "max_tokens": 12, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}}),
])
def test_thousand_property_schema_generates(server, route, body):
    """It used to hit the parser's row limit after `{"` (200 + an 'internal error' abort
    natively, a 500 through response_format)."""
    r = post(server, route, body)
    assert r.status_code == 200, r.text[:300]
    data = r.json()
    text = data["text"] if "text" in data else data["choices"][0]["message"]["content"]
    reason = data["meta_info"]["finish_reason"]["type"] if "text" in data \
        else data["choices"][0]["finish_reason"]
    assert reason in ("length", "stop") and text.startswith("{")


@pytest.mark.parametrize("headers, status", [
    ({"Content-Type": "text/plain"}, 415),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({}, 415),
])
def test_json_content_type_required(server, headers, status):
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    r = post(server, "/generate", data=body, headers={**AUTH, **headers})
    assert r.status_code == status and "application/json" in r.json()["error"]["message"]


def test_body_size_limit(server):
    big = json.dumps({"text": "a" * (MAX_BODY + 10)})
    r = post(server, "/generate", data=big)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds on the stream itself
        yield b'{"text": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = requests.post(server.base_url + "/generate", data=chunks(), headers=JSON, timeout=60)
    assert r.status_code == 413


def test_api_key_and_cors_defaults(server):
    url = server.base_url
    assert requests.get(url + "/health", timeout=10).status_code == 200  # open: liveness only
    for path in ("/metrics", "/server_info", "/get_model_info", "/v1/models"):
        r = requests.get(url + path, timeout=10)
        assert r.status_code == 401 and KEY not in r.text
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = requests.get(url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"},
                         timeout=10)
        assert r.status_code == 200
    r = requests.get(url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=10)
    assert r.status_code == 401
    # No --allow-origins: no CORS headers, preflights are not approved.
    r = requests.options(url + "/generate", timeout=10, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}
    r = requests.get(url + "/v1/models", headers={**AUTH, "Origin": "http://evil.example"},
                     timeout=10)
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_unsupported_model_is_one_line_and_nonzero_exit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode"}))
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    proc = subprocess.run([sys.executable, "-m", "sgl_tpu.launch_server", "--model-path",
                           str(tmp_path), "--port", "1"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env={"JAX_PLATFORMS": "cpu",
                                                           "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gpt_bigcode" in errors[0], proc.stderr


# ---- fuzz --------------------------------------------------------------------------------
def _sender(server):
    session = requests.Session()

    def send(route: str, data: bytes, content_type: str) -> int:
        # Anthropic's clients send the key as x-api-key
        headers = {"x-api-key": KEY} if route.startswith("/v1/messages") else dict(AUTH)
        if content_type:
            headers["Content-Type"] = content_type
        return session.post(server.base_url + route, data=data, headers=headers,
                            timeout=120).status_code

    return send


@pytest.mark.parametrize("route", list(ROUTES))
def test_fuzz_route_no_5xx(server, route):
    send = _sender(server)
    statuses: Counter = Counter()
    for kind in CLASSES:
        statuses += run_fuzz(send, route, kind, FUZZ_EXAMPLES, seed=1234)
        statuses += run_fuzz(send, route, kind, 2, seed=None)  # a few fresh examples per run
    print(route, dict(statuses))
    assert sum(statuses.values()) >= 0.8 * len(CLASSES) * FUZZ_EXAMPLES
    assert statuses["4xx"] > 0 and not statuses["5xx"]
    # Some generated bodies were valid (validation does not refuse everything); /flush_cache
    # ignores any JSON body.
    if route != "/flush_cache":
        assert statuses["2xx"] > 0
    assert_serving(server)


@pytest.mark.parametrize("method, path, params", URL_ROUTES,
                         ids=[f"{m} {p}" for m, p, _ in URL_ROUTES])
def test_fuzz_url_routes_no_5xx(server, method, path, params):
    """Odd ids and paging parameters in the URL (a stored response's id among them)."""
    stored = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2}).json()["id"]
    session = requests.Session()

    def send(method: str, url: str) -> int:
        return session.request(method, server.base_url + url, headers=AUTH,
                               timeout=120).status_code

    statuses = run_url_fuzz(send, method, path, params, [stored], 3 * FUZZ_EXAMPLES, seed=1234)
    statuses += run_url_fuzz(send, method, path, params, [stored], 5, seed=None)
    print(method, path, dict(statuses))
    assert statuses["4xx"] > 0 and statuses["2xx"] > 0 and not statuses["5xx"]
    assert_serving(server)


# ---- load / disconnect / exhaustion --------------------------------------------------------
def test_load_phase(server):
    result = asyncio.run(load_phase(server.base_url, AUTH, clients=48, requests_per_client=2))
    assert result.statuses == {200: 96}, result.to_dict()
    assert_serving(server)


def test_disconnect_and_abort_phase(server):
    result = asyncio.run(disconnect_phase(server.base_url, AUTH, clients=8))
    assert result.num_5xx == 0 and result.disconnects >= 8 and result.aborts == 8, \
        result.to_dict()
    assert_serving(server)


def test_kv_exhaustion_phase(server):
    result = asyncio.run(exhaustion_phase(server.base_url, AUTH, capacity_tokens=CAPACITY,
                                          clients=16))
    assert result.statuses == {200: 16, 400: 1}, result.to_dict()
    assert result.extra["wrong_token_counts"] == 0
    info = check_invariants(server.base_url, AUTH)
    assert info["stats"]["num_retractions"] > 0  # the pool really ran out
    assert_serving(server)


ALLOWED_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def second_server(tiny_model):
    """A server of its own (the last test kills its scheduler), with CORS for one origin and
    its executor's OpenMP threads sleeping at once."""
    handle = launch_server(*FLAGS, "--allow-origins", ALLOWED_ORIGIN, "--omp-spin-count", "0",
                           model_path=tiny_model)
    yield handle
    handle.stop()


def test_allow_origins_opens_cors_for_those_origins_only(second_server):
    url = second_server.base_url + "/generate"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = requests.options(url, headers={**preflight, "Origin": ALLOWED_ORIGIN}, timeout=10)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = requests.options(url, headers={**preflight, "Origin": "http://evil.example"},
                         timeout=10)
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}
    r = post(second_server, "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 1}}, headers={**JSON, "Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_omp_spin_count_reaches_the_scheduler_process(second_server):
    """`--omp-spin-count` is set in the scheduler process (before torch loads there) and
    reported by `/server_info`; the launcher's environment had the default."""
    info = requests.get(second_server.base_url + "/server_info", headers=AUTH, timeout=30).json()
    assert info["omp_wait"]["GOMP_SPINCOUNT"] == "0", info["omp_wait"]
    log = second_server.log_path.read_text(errors="replace")
    assert "OpenMP waiting: GOMP_SPINCOUNT=0" in log, second_server.log_tail()


def test_killed_scheduler_is_503_and_clean_exit(second_server):
    handle = second_server
    info = requests.get(handle.base_url + "/server_info", headers=AUTH, timeout=30).json()
    victim = info["scheduler_pid"]
    assert victim in child_pids(handle.proc.pid)
    result = asyncio.run(kill_child_phase(handle.base_url, AUTH, handle.proc.pid,
                                          victim=victim, clients=4))
    assert result.extra["server_exited"], handle.log_tail()
    assert handle.proc.wait(30) != 0
    # Streams end with an error event or a cut connection; a later request gets 503 (or a
    # refused connection once the server is gone).
    outcomes = result.statuses
    assert outcomes["error_event"] + outcomes["cut"] == 4, result.to_dict()
    assert outcomes[503] + outcomes[0] == 1, result.to_dict()
    assert result.extra["leftover_processes"] == []
