"""Background responses (`background: true`) with the real `openai` client: on the session's
float32 server (tests/conftest.py, exact outputs) a background run polled to `completed`
answers what the same request answers in the foreground, also streamed and resumed after a
hang-up; a long run shows its output as it grows, `cancel` stops it (`cancelled`, idempotent)
and the scheduler frees its KV; the 4xx cases. On a tiny model's servers of their own, a run
whose scheduler dies reads `failed`, never `in_progress` forever, and a server stopped while
runs are running exits cleanly.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
import requests
from checkpoints import make_tiny_hf_checkpoint
from server_harness import ServerHandle, launch_server

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
RUNNING = ("queued", "in_progress")
QUESTION = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def server(default_model_server_f32) -> ServerHandle:
    return default_model_server_f32


def make_client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return make_client(server)


def poll(client: openai.OpenAI, rid: str, until, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if until(r):
            return r
        assert time.monotonic() < deadline, f"response still {r.status}"
        time.sleep(0.05)


def test_background_answers_what_the_foreground_answers(client):
    kw = dict(model="default", input=QUESTION, max_output_tokens=24, **GREEDY)
    started = client.responses.create(**kw, background=True)
    assert started.status in RUNNING and started.background is True
    assert started.id.startswith("resp_")
    done = poll(client, started.id, lambda r: r.status not in RUNNING)
    fore = client.responses.create(**kw)
    assert fore.background is False
    assert done.status == fore.status and done.output_text == fore.output_text
    assert done.output_text
    assert done.usage.output_tokens == fore.usage.output_tokens
    assert done.usage.input_tokens == fore.usage.input_tokens
    # a stored response like any other: the next turn continues it
    again = client.responses.cancel(started.id)  # an ended one is returned as it is
    assert again.status == done.status and again.output_text == done.output_text
    follow = client.responses.create(model="default", input="Again.", max_output_tokens=4,
                                     previous_response_id=started.id, **GREEDY)
    assert follow.status in ("completed", "incomplete")


def test_cancel_stops_a_long_run_and_frees_its_kv(client, server):
    before = server.info()["stats"]["generated_tokens"]
    started = client.responses.create(model="default", input=QUESTION, background=True,
                                      max_output_tokens=4000, extra_body={"ignore_eos": True},
                                      **GREEDY)
    # the output grows while it runs: what GET shows is a prefix of what comes next
    first = poll(client, started.id, lambda r: r.status == "in_progress" and r.output_text)
    assert first.output[0].status == "in_progress" and first.usage is None
    later = poll(client, started.id, lambda r: len(r.output_text) > len(first.output_text))
    assert later.output_text.startswith(first.output_text)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert cancelled.output_text.startswith(later.output_text)
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # idempotent
    info = server.wait_idle()
    mem = info["memory"]
    assert mem["num_pages_requests"] == 0, mem  # the aborted request's KV is back
    assert mem["num_pages_free"] + mem["num_pages_tree"] == mem["num_pages_total"], mem
    assert info["stats"]["generated_tokens"] - before < 4000  # stopped, not run to the end


def test_a_streamed_background_run_resumes_after_a_hang_up(client):
    """`background` with `stream`: the run goes on when the client hangs up, and
    `retrieve(stream=True, starting_after=n)` goes on from the last event it saw; the text of
    both parts is the foreground answer."""
    kw = dict(model="default", input=QUESTION, max_output_tokens=24, **GREEDY)
    fore = client.responses.create(**kw)
    stream = client.responses.create(**kw, background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break  # hang up after the first text
    stream.close()
    assert [e.type for e in seen[:3]] == ["response.created", "response.queued",
                                          "response.in_progress"]
    assert seen[0].response.status == "queued" and seen[0].response.background is True
    rid, last = seen[0].response.id, seen[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last))
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == fore.output_text
    assert rest[-1].type == f"response.{fore.status}"  # completed or incomplete
    assert rest[-1].response.output_text == text
    # the ended run replays from any point; one created without stream cannot be streamed
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(seen) + len(rest)))
    plain = client.responses.create(**kw, background=True)
    with pytest.raises(openai.BadRequestError, match="stream=true"):
        list(client.responses.retrieve(plain.id, stream=True))


def test_a_running_response_cannot_be_continued_and_delete_stops_it(client, server):
    started = client.responses.create(model="default", input=QUESTION, background=True,
                                      max_output_tokens=4000, extra_body={"ignore_eos": True},
                                      **GREEDY)
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.responses.create(model="default", input="And?", max_output_tokens=2,
                                previous_response_id=started.id)
    client.responses.delete(started.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(started.id)
    info = server.wait_idle()  # the deleted run's request was aborted
    assert info["memory"]["num_pages_requests"] == 0, info["memory"]


def test_background_4xx(client, server):
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="default", input="hi", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model="default", input="hi", background=True,
                                max_output_tokens=0)
    fore = client.responses.create(model="default", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(fore.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    r = requests.post(f"{server.base_url}/v1/responses/resp_unknown/cancel", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


@pytest.fixture(scope="module")
def long_context_tiny_model(tmp_path_factory) -> str:
    """A tiny model with a context long enough for a run of many seconds, however fast it
    decodes."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama",
                                   max_position_embeddings=8192)


def start_long_runs(server: ServerHandle, num_runs: int) -> list[str]:
    client = make_client(server)
    ids = [client.responses.create(model="default", input=QUESTION, background=True,
                                   max_output_tokens=4000, extra_body={"ignore_eos": True},
                                   **GREEDY).id for _ in range(num_runs)]
    poll(client, ids[0], lambda r: r.status == "in_progress")
    return ids


def launch_tiny(model: str) -> ServerHandle:
    return launch_server("--skip-warmup", "--max-total-tokens", "8192", "--dtype", "float32",
                         model_path=model)


def test_a_run_whose_scheduler_dies_reads_failed(long_context_tiny_model):
    own = launch_tiny(long_context_tiny_model)
    try:
        [rid] = start_long_runs(own, 1)
        os.kill(own.info()["scheduler_pid"], signal.SIGKILL)
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the server has exited
            try:
                r = requests.get(f"{own.base_url}/v1/responses/{rid}", timeout=5)
            except requests.RequestException:
                break
            if r.status_code != 200:
                break
            seen.append(r.json())
            time.sleep(0.02)
        assert seen and seen[-1]["status"] == "failed", [s["status"] for s in seen]
        assert "scheduler process died" in seen[-1]["error"]["message"], seen[-1]["error"]
        assert seen[-1]["error"]["code"] == "server_error"
    finally:
        own.stop()


def test_shutdown_with_running_runs_is_clean(long_context_tiny_model):
    """SIGTERM while background runs are running (one decoding, one queued behind it): they
    are stopped while the scheduler still listens, and the server exits 0 without a
    traceback."""
    own = launch_tiny(long_context_tiny_model)
    try:
        start_long_runs(own, 2)
        own.proc.send_signal(signal.SIGTERM)
        assert own.proc.wait(30) == 0, own.log_tail()
        assert "Traceback" not in own.log_tail(num_chars=10**6), own.log_tail()
    finally:
        own.stop()
