"""Multi-host JAX tensor parallelism, simulated on this machine: three `launch_server`
processes with one CPU device each (`--nnodes 3 --node-rank R --dist-init-addr`) form one
`jax.distributed` group and serve `/generate` at TP 3.

Shown: the greedy text equals TP 1 (an in-process engine on the same checkpoint); only rank 0
listens (the followers are given ports too, and nothing answers there); `/server_info` reports
tp_size 3; one SIGTERM to rank 0 ends the followers; a follower whose leader never comes exits
with a message naming the address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import checkpoints as ck
import pytest
from server_harness import REPO_ROOT, free_port, launch_server

from sgl_tpu.engine import Engine
from sgl_tpu.server.replicas import http_status

pytestmark = pytest.mark.slow
NNODES = 3
PROMPTS = ["Hello world! How are", "The quick brown fox"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
SMALL = ("--backend", "jax", "--dtype", "float32", "--page-size", "4", "--max-total-tokens",
         "1024", "--max-running-requests", "1", "--chunked-prefill-size", "32",
         "--min-token-bucket", "32")


def _env() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    return env


def _follower(rank: int, addr: str, model: str, port: int, log, flags=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sgl_tpu.launch_server", "--model-path", model, *SMALL, *flags,
           "--tp-size", str(NNODES), "--nnodes", str(NNODES), "--node-rank", str(rank),
           "--dist-init-addr", addr, "--port", str(port)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama",
                                      heads=(6, 3))


@pytest.mark.parametrize("state", ["off", "on"])
def test_three_processes_serve_like_tp1(model_dir, tmp_path, state):
    """`state`: --jax-decode-state on every rank (on: each rank's mirror of the device batch
    state must make the same diffs as the others', or their collectives would part)."""
    with Engine(model_dir, skip_warmup=True, backend="jax", dtype="float32", page_size=4,
                max_total_tokens=1024, max_running_requests=1, chunked_prefill_size=32,
                min_token_bucket=32) as eng:
        want = [o["text"] for o in eng.generate(PROMPTS, GREEDY)]

    coordinator = free_port(2)
    addr = f"127.0.0.1:{coordinator}"
    follower_ports = [free_port() for _ in range(1, NNODES)]
    logs = [open(tmp_path / f"rank{r}.log", "wb") for r in range(1, NNODES)]
    flags = ("--jax-decode-state", state)
    followers = [_follower(r, addr, model_dir, port, log, flags)
                 for r, port, log in zip(range(1, NNODES), follower_ports, logs, strict=True)]
    server = None
    try:
        server = launch_server(*SMALL, *flags, "--tp-size", str(NNODES), "--nnodes",
                               str(NNODES), "--node-rank", "0", "--dist-init-addr", addr,
                               model_path=model_dir)
        got = [server.post_ok("/generate", {"text": p, "sampling_params": GREEDY})["text"]
               for p in PROMPTS]
        assert got == want
        info = server.info()
        assert info["tp_size"] == NNODES
        assert info["jax_decode_state"] == state
        assert info["device_decode_state"] is (state == "on")
        for port in follower_ports:  # only rank 0 serves HTTP
            assert http_status(f"http://127.0.0.1:{port}/health") is None
        assert all(p.poll() is None for p in followers)
        t0 = time.monotonic()
        server.stop()  # one SIGTERM to rank 0
        for p in followers:
            assert p.wait(timeout=60) == 0, "a follower must leave on the leader's shutdown"
        assert time.monotonic() - t0 < 60
    finally:
        if server is not None:
            server.stop()
        for p in followers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def test_follower_without_leader_names_the_address(model_dir):
    port = free_port(2)
    addr = f"127.0.0.1:{port}"
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_tpu.launch_server", "--model-path", model_dir, *SMALL,
         "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
         "--dist-timeout", "5"], env=_env(), cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 1
    assert f"rank 1: no leader answered at tcp://127.0.0.1:{port + 1} within 5 s" in proc.stderr
