"""The state a server must be back in after every campaign phase:

* every process alive (`/health` is 200: the launcher's watchdog makes it 503 when a child died),
* idle: no request waiting or running (polled for at most `timeout_s`: nothing hangs),
* `check_integrity()` ok (page accounting and radix tree, run by `/server_info` when idle),
* no KV page held by a request (`memory.num_pages_requests == 0`),
* no program active or held by admission control (`programs` and `/metrics`: every request's
  end reached its program),
* and a small request is still answered correctly.
"""

from __future__ import annotations

import time
from typing import Any

import requests


class InvariantError(AssertionError):
    pass


def check_invariants(base_url: str, headers: dict[str, str], timeout_s: float = 60.0
                     ) -> dict[str, Any]:
    """Wait until the server is idle, then check everything above; returns /server_info.
    Raises InvariantError naming the first broken invariant."""
    health = requests.get(base_url + "/health", headers=headers, timeout=10)
    if health.status_code != 200:
        raise InvariantError(f"/health answered {health.status_code}: {health.text[:200]}")
    deadline = time.monotonic() + timeout_s
    while True:
        info = requests.get(base_url + "/server_info", headers=headers, timeout=10).json()
        idle = (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                and "integrity" in info)
        if idle:
            break
        if time.monotonic() > deadline:
            raise InvariantError(f"server not idle after {timeout_s} s: "
                                 f"{info['num_running_reqs']} running, "
                                 f"{info['num_waiting_reqs']} waiting")
        time.sleep(0.2)
    if info["integrity"] != "ok":
        raise InvariantError(f"check_integrity failed: {info['integrity']}")
    held = info["memory"]["num_pages_requests"]
    if held != 0:
        raise InvariantError(f"{held} KV pages still held by requests")
    programs = info.get("programs", {})
    if programs.get("num_active") or programs.get("num_held"):
        raise InvariantError(f"programs still active or held when idle: {programs}")
    metrics = requests.get(base_url + "/metrics", headers=headers, timeout=10)
    gauges = _gauges(metrics.text) if metrics.status_code == 200 else {}
    if gauges.get("sglang:num_programs") != programs.get("num_programs") or any(
            gauges.get(f"sglang:num_programs_{state}") for state in ("active", "held")):
        raise InvariantError(f"/metrics ({metrics.status_code}) disagrees with /server_info "
                             f"on programs: {gauges} against {programs}")
    r = requests.post(base_url + "/generate", headers=headers, timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                             "ignore_eos": True}})
    if r.status_code != 200 or r.json()["meta_info"]["completion_tokens"] != 2:
        raise InvariantError(f"a small request failed: {r.status_code} {r.text[:200]}")
    return info


def _gauges(text: str) -> dict[str, float]:
    """`/metrics` samples named sglang:num_programs*, without labels (Prometheus text)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang:num_programs"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = float(value)
    return out
