"""Programs through a real server (the default model, `--schedule-policy program`): each API's
way of naming an agent becomes one program in `/server_info`, a Responses chain stays one
program, `/metrics` exports the program gauges, and no client's key appears in `/server_info`,
`/metrics` or the server's log. Unit tests: tests/test_programs.py."""

from __future__ import annotations

import pytest
import requests

# debug: the client identifiers' log line (http_common.log_identity) is written, as a digest
FLAGS = ("--skip-warmup", "--max-total-tokens", "2048", "--schedule-policy", "program",
         "--log-level", "debug")


@pytest.fixture(scope="module")
def server():
    from server_harness import launch_server

    handle = launch_server(*FLAGS)
    yield handle
    handle.stop()


def _programs(server) -> dict:
    info = requests.get(server.base_url + "/server_info", timeout=60).json()
    return info["programs"]


@pytest.mark.slow
def test_each_api_names_its_program(server):
    chat = {"model": "default", "max_tokens": 2, "temperature": 0}
    msg = [{"role": "user", "content": "Say hi."}]
    sp = {"max_new_tokens": 2, "temperature": 0}
    server.post_ok("/generate", {"text": "One", "sampling_params": sp, "session_id": "p-native"})
    server.post_ok("/generate", {"text": "Two", "sampling_params": sp,
                                 "session_params": {"id": "p-params"}})
    server.post_ok("/v1/chat/completions", {**chat, "messages": msg,
                                            "prompt_cache_key": "p-cache-key"})
    server.post_ok("/v1/completions", {**chat, "prompt": "Three"},
                   headers={"X-SMG-Routing-Key": "p-header"})
    server.post_ok("/v1/messages", {**chat, "messages": msg, "metadata": {"user_id": "p-user"}})
    first = server.post_ok("/v1/responses", {**chat, "input": "Hello", "max_output_tokens": 2})
    server.post_ok("/v1/responses", {**chat, "input": "Again", "max_output_tokens": 2,
                                     "previous_response_id": first["id"]})
    server.post_ok("/generate", {"text": "Four", "sampling_params": sp})  # names no program
    programs = _programs(server)
    recent = programs["recent"]  # by public id (a keyed hash), never the client's key
    assert sorted(p["num_requests"] for p in recent.values()) == [1, 1, 1, 1, 1, 2], recent
    for listed in recent.values():  # the Responses chain is the one with 2 requests
        assert listed["decode_tokens"] >= 1 and listed["admitted"]
        assert listed["state"] in ("paused", "idle")
    assert programs["num_programs"] == 6 and programs["num_active"] == 0
    assert programs["admission_control"] and programs["num_held"] == 0


@pytest.mark.slow
def test_a_bad_program_id_is_a_400_and_metrics_export_programs(server):
    r = requests.post(server.base_url + "/v1/completions",
                      json={"model": "default", "prompt": "x", "max_tokens": 1,
                            "program_id": "p" * 300}, timeout=60)
    assert r.status_code == 400 and "program_id" in r.text
    # an Anthropic user_id that names no valid program is ignored, not refused
    r = requests.post(server.base_url + "/v1/messages",
                      json={"model": "default", "max_tokens": 1, "metadata": {"user_id": 7},
                            "messages": [{"role": "user", "content": "x"}]}, timeout=60)
    assert r.status_code == 200, r.text
    text = requests.get(server.base_url + "/metrics", timeout=60).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sglang:") and "program" in line.split("{")[0]}
    assert values["sglang:num_programs"] == _programs(server)["num_programs"] >= 1
    for name in ("num_programs_active", "num_programs_paused", "num_programs_held",
                 "programs_held_total", "program_held_seconds_total",
                 "program_working_set_tokens"):
        assert "sglang:" + name in values, sorted(values)


@pytest.mark.slow
def test_no_client_key_leaves_the_server(server):
    """Each way of naming a program, with keys no other output could contain: none appears in
    `/server_info`, `/metrics` or the server's log (programs are listed by keyed hash)."""
    chat = {"model": "default", "max_tokens": 2, "temperature": 0}
    msg = [{"role": "user", "content": "Say hi."}]
    sp = {"max_new_tokens": 2, "temperature": 0}
    keys = {name: f"zq{name}9x4k7" for name in ("session", "params", "cachekey", "header",
                                                 "userid", "programid", "opened")}
    r = requests.post(server.base_url + "/open_session", json={"session_id": keys["opened"]},
                      timeout=60)
    assert r.status_code == 200, r.text
    server.post_ok("/generate", {"text": "Open", "sampling_params": sp,
                                 "session_id": keys["opened"]})
    server.post_ok("/generate", {"text": "One", "sampling_params": sp,
                                 "session_id": keys["session"]})
    server.post_ok("/generate", {"text": "Two", "sampling_params": sp,
                                 "session_params": {"id": keys["params"]}})
    server.post_ok("/v1/chat/completions", {**chat, "messages": msg,
                                            "prompt_cache_key": keys["cachekey"]})
    server.post_ok("/v1/completions", {**chat, "prompt": "Three"},
                   headers={"X-SMG-Routing-Key": keys["header"]})
    server.post_ok("/v1/completions", {**chat, "prompt": "Four", "program_id": keys["programid"]})
    server.post_ok("/v1/messages", {**chat, "messages": msg,
                                    "metadata": {"user_id": keys["userid"]}})
    first = server.post_ok("/v1/responses", {**chat, "input": "Hello", "max_output_tokens": 2})
    second = server.post_ok("/v1/responses", {**chat, "input": "Again", "max_output_tokens": 2,
                                              "previous_response_id": first["id"]})
    keys["conversation"], keys["response"] = first["id"], second["id"]
    info = requests.get(server.base_url + "/server_info", timeout=60).text
    metrics = requests.get(server.base_url + "/metrics", timeout=60).text
    log = server.log_tail(num_chars=10**8)
    assert "/v1/messages user_id=" in log  # the identifier's debug line, as a digest
    for name, key in keys.items():
        for where, text in (("/server_info", info), ("/metrics", metrics), ("log", log)):
            assert key not in text, (name, where)
    assert requests.post(server.base_url + "/close_session", json={"session_id": keys["opened"]},
                         timeout=60).status_code == 200


@pytest.mark.slow
def test_a_chat_without_max_tokens_counts_the_outputs_seen(server):
    """The server sets such a chat's max_new_tokens to the rest of the context; its program's
    working set counts the outputs seen instead (max_new_tokens_defaulted), so it is not held
    as a whole context."""
    before = _programs(server)["num_programs_held"]
    server.post_ok("/v1/chat/completions", {
         "model": "default", "temperature": 0, "stop": [" ", ".", "\n"],
         "messages": [{"role": "user", "content": "Say hi."}],
         "prompt_cache_key": "p-no-max-tokens"})
    programs = _programs(server)
    newest = next(iter(programs["recent"].values()))
    assert newest["num_requests"] == 1 and newest["working_set_tokens"] < 1024, newest
    assert programs["num_programs_held"] == before
