"""What SGLang's router adds to each request: one sgl-tpu server, the sglang-router in front of
it, and the same short requests sent alternately to each, in one run.

    python -m sgl_tpu.bench.router_overhead [--requests 100] [--max-new-tokens 1]
        [--model-path PATH] [--output FILE]

Each round sends one request directly and one through the router (order alternating), so drift
of a shared machine hits both alike. Reports per path the median and p90 latency of a
non-streamed `/generate` and the time to the first streamed chunk, and the router's added
median (router - direct), as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import requests

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serving import Server, free_port


def start_router(*worker_urls: str) -> tuple[subprocess.Popen, str]:
    """The sglang-router on a free local port over `worker_urls`; returns once it has
    registered a worker (its /v1/models answers)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
         str(port), "--worker-urls", *worker_urls, "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url  # up, with the worker registered
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router did not register the worker within 60 s")


def _time_request(url: str, body: dict, stream: bool) -> float:
    start = time.perf_counter()
    with requests.post(url + "/generate", json={**body, "stream": stream}, stream=stream,
                       timeout=120) as resp:
        resp.raise_for_status()
        if stream:
            next(resp.iter_lines())  # the first chunk
        else:
            resp.content  # noqa: B018 - the whole body
    return time.perf_counter() - start


def _summary(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"p50_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=1)
    p.add_argument("--model-path", default=None)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    flags = ["--model-path", args.model_path] if args.model_path else []
    log = tempfile.NamedTemporaryFile(prefix="router_overhead_", suffix=".log", delete=False)
    server = Server(flags, log.name)
    router = None
    try:
        server.wait_ready()
        router, router_url = start_router(server.url)
        body = {"text": "The capital of France is", "sampling_params": {
            "max_new_tokens": args.max_new_tokens, "temperature": 0}}
        times: dict[tuple[str, bool], list[float]] = {}
        paths = {"direct": server.url, "router": router_url}
        for i in range(args.requests):
            for name in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                for stream in (False, True):
                    times.setdefault((name, stream), []).append(
                        _time_request(paths[name], body, stream))
        out = {name: {"generate": _summary(times[(name, False)]),
                      "first_chunk": _summary(times[(name, True)])} for name in paths}
        out["router_added_p50_ms"] = {
            kind: out["router"][kind]["p50_ms"] - out["direct"][kind]["p50_ms"]
            for kind in ("generate", "first_chunk")}
        emit({"args": {k: v for k, v in vars(args).items() if k != "output"}, **out},
             args.output)
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        server.stop()


if __name__ == "__main__":
    main()
