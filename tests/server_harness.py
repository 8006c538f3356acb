"""Launch a real sgl-tpu server as a subprocess for end-to-end tests.

    with launch_server("--max-total-tokens", "4096", model_path=ckpt_dir) as server:
        server.get("/health")
        server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}})

Tests that can share a server take it from the session's pool instead (`server_pool` in
tests/conftest.py, `ServerPool` below).

Each launch picks a free port, runs `python -m sgl_tpu.launch_server` with `JAX_PLATFORMS=cpu`
and this process's environment (under pytest, the session's JAX compilation cache: see
tests/conftest.py), and waits until `/health` answers 200 and the
ready line naming its port is in its log (a `--dp-size` router answers /health before it has
registered the replicas, whose own ready lines share the log). If the server exits first, the
launch fails with the tail of its log.
`SGL_TPU_TEST_BACKEND=jax|torch` adds `--backend` to every launch (the Makefile runs the
end-to-end suites once more on the backend `auto` does not pick).
`SGL_TPU_TEST_SPECULATIVE=SUFFIX|NGRAM|none` adds `--speculative-algorithm` to every launch
whose flags do not set it: drafts forced on (a drafter by name: no timing gate) or off,
whatever `auto` would do on this host (tests/test_isa.py reruns the token comparisons both
ways).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from sgl_tpu.server.ready import ready_line
from sgl_tpu.server.replicas import http_status

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 20.0
HTTP_TIMEOUT_S = 180.0
LOG_TAIL_CHARS = 4000
# A launch polls /health and its log this often: a poll costs a millisecond or two, and each
# launch waits half a period on average past its ready line (the suite launches many).
READY_POLL_S = 0.1
# The session's default-model servers (tests/conftest.py).
SERVED_F32 = "smol"  # the float32 one's --served-model-name
_DEFAULT_MODEL_COMMON = ("--skip-warmup", "--chunked-prefill-size", "512")
DEFAULT_MODEL_FLAGS = (*_DEFAULT_MODEL_COMMON, "--max-total-tokens", "8192",
                       "--max-running-requests", "8")
# The float32 server computes exactly what the file holds, for the tests that compare tokens
# across cache hits, batches and streams: on the torch backend the exact block kernels (`auto`
# takes int8 activations where the kernels have the tiles: AVX512-VNNI, AVX-VNNI, AVX2) and,
# where the compiled attention is built,
# float32 attention products (`auto` multiplies bfloat16 pairs on AVX512-BF16 CPUs, whose
# rounding turns the float32 summation order of two paths into differences of 1e-3); the JAX
# backend (SGL_TPU_TEST_BACKEND=jax) has dense weights only.
def _exact_weights() -> tuple[str, ...]:
    if os.environ.get("SGL_TPU_TEST_BACKEND") == "jax":
        return ()
    from sgl_tpu.backends.torch.kernels import cpu_extension

    fused = ("--attention-backend", "torch-cpu-fused") if cpu_extension.load() else ()
    return ("--quantization", "gguf", *fused)


_EXACT_WEIGHTS = _exact_weights()
DEFAULT_MODEL_F32_FLAGS = (*_DEFAULT_MODEL_COMMON, "--max-total-tokens", "16384",
                           "--max-running-requests", "16", "--dtype", "float32",
                           *_EXACT_WEIGHTS, "--served-model-name", SERVED_F32)

# The tiny model's servers that several modules share. float32: tests compare greedy outputs
# across cache hits, batches, streams and servers, which bfloat16 (`--dtype auto` on CPUs with
# AMX) does not promise for a random model's near-ties.
TINY_SERVED_NAME = "tiny-llama"
TINY_F32 = ("--skip-warmup", "--dtype", "float32", "--served-model-name", TINY_SERVED_NAME)
TINY_API_KEY = "tiny-key"
# no radix cache, a 256-token context and an API key: bad input, auth
TINY_NOCACHE_KEYED = (*TINY_F32, "--disable-radix-cache", "--context-length", "256",
                      "--api-key", TINY_API_KEY)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """A port P with P..P+count-1 free now, below the kernel's ephemeral range.

    Tests dial ports before anything listens there (health polls, a follower host dialing rank
    0's `--dist-init-addr` port + 1). Dialing a loopback port inside the ephemeral range can
    pick that very port as the source and connect to itself (TCP simultaneous open); the
    server's bind then fails with "address already in use". Ports below the range are never
    picked as sources.
    """
    high = min(_ephemeral_low(), 65536) - count
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, high - 12000), high)
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} adjacent free ports below the ephemeral range")


@dataclass
class ServerHandle:
    base_url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def post(self, path: str, body: Any = None, *, timeout: float = HTTP_TIMEOUT_S,
             **kw: Any) -> requests.Response:
        """POST `body` as JSON to `path` (e.g. "/generate"); `kw` goes to `requests.post`
        (headers, data, stream)."""
        return requests.post(self.base_url + path, json=body, timeout=timeout, **kw)

    def get(self, path: str, *, timeout: float = HTTP_TIMEOUT_S, **kw: Any
            ) -> requests.Response:
        return requests.get(self.base_url + path, timeout=timeout, **kw)

    def post_ok(self, path: str, body: Any = None, **kw: Any) -> Any:
        """`post` that must answer 200 (else AssertionError with the answer and the server's
        log tail); its JSON (the text where the body is not JSON)."""
        r = self.post(path, body, **kw)
        assert r.status_code == 200, (path, r.status_code, r.text, self.log_tail())
        try:
            return r.json()
        except ValueError:
            return r.text

    def info(self) -> dict:
        """`/server_info`."""
        with urllib.request.urlopen(self.base_url + "/server_info", timeout=30) as resp:
            return json.loads(resp.read())

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """`/server_info` once no request is running or waiting (AssertionError after
        `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return info
            assert time.monotonic() < deadline, "requests are still running"
            time.sleep(0.1)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if the server has not exited after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            self.log_path.unlink()
        except OSError:
            pass


def launch_server(*flags: str, model_path: str | None = None, timeout: float = 300
                  ) -> ServerHandle:
    """Start a server with extra CLI `flags`; return once `/health` is 200.

    `model_path=None` serves the default model (SmolLM2-135M). Raises RuntimeError with the
    server's log tail if it exits or is not healthy within `timeout` seconds.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "sgl_tpu.launch_server", "--port", str(port), *flags]
    if os.environ.get("SGL_TPU_TEST_BACKEND"):
        cmd += ["--backend", os.environ["SGL_TPU_TEST_BACKEND"]]
    if os.environ.get("SGL_TPU_TEST_SPECULATIVE") and "--speculative-algorithm" not in flags:
        cmd += ["--speculative-algorithm", os.environ["SGL_TPU_TEST_SPECULATIVE"]]
    if model_path is not None:
        cmd += ["--model-path", str(model_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    log_fd, log_name = tempfile.mkstemp(prefix=f"sgl_tpu_server_{port}_", suffix=".log")
    with os.fdopen(log_fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT)
    server = ServerHandle(f"http://127.0.0.1:{port}", proc, Path(log_name))
    atexit.register(server.stop)  # no server outlives an interrupted test run
    ready = ready_line(port)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"server exited with code {proc.returncode} before it was "
                               f"healthy; log tail:\n{tail}")
        if (http_status(server.base_url + "/health") == 200
                and ready.search(server.log_tail(num_chars=10**6))):
            return server
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"server not healthy after {timeout} s; log tail:\n{tail}")
        time.sleep(READY_POLL_S)


class ServerPool:
    """Running servers keyed by (model path, flags); see the `server_pool` fixture."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str | None, tuple[str, ...]], ServerHandle] = {}

    def get(self, *flags: str, model_path: str | None = None) -> ServerHandle:
        key = (model_path, flags)
        server = self._servers.get(key)
        if server is None:
            server = self._servers[key] = launch_server(*flags, model_path=model_path)
        assert server.proc.poll() is None, (
            f"a pooled server ({' '.join(flags)}) has exited; a test that stops or kills a "
            f"server must launch its own. Log tail:\n{server.log_tail()}")
        return server

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
