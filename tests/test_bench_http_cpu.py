"""The HTTP-process CPU bench (sgl_tpu/bench/http_cpu.py) against a real server of a tiny
random checkpoint: every API streams every token, and the CPU per token comes back."""

from __future__ import annotations

import json
import subprocess
import sys

import checkpoints as ck
import pytest

from sgl_tpu.bench import random_checkpoint as rc


@pytest.mark.slow
def test_http_cpu_bench_measures_every_api(tmp_path):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    model = rc.write_shape(tmp_path / "min", src, minimal=True)
    rc.write_weights(model)
    out = tmp_path / "http_cpu.json"
    subprocess.run(
        [sys.executable, "-m", "sgl_tpu.bench.http_cpu", "--model-path", str(model),
         "--streams", "8", "--output-tokens", "64", "--rounds", "2", "--output", str(out),
         "--server-flags", "--skip-warmup --speculative-algorithm none"],
        check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [r["api"] for r in runs] == ["native", "chat", "completions",
                                        "chat", "completions", "native"]  # order rotated
    for r in runs:
        assert r["tokens"] == 8 * 64  # every token of every stream
        # about one event per token (held-back partial text merges some; chat adds its role)
        assert 0.5 < r["events_per_token"] < 1.5
    # /proc counts CPU in clock ticks (10 ms): a short run may read 0, all of them cannot
    assert all(r["http_cpu_ms_per_token"] >= 0 for r in runs)
    assert sum(r["http_cpu_ms_per_token"] for r in runs) > 0
    assert set(result["summary"]) == {"native", "chat", "completions"}


def test_http_cpu_bench_refuses_an_unknown_api():
    proc = subprocess.run([sys.executable, "-m", "sgl_tpu.bench.http_cpu", "--apis", "grpc"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown ['grpc']" in proc.stderr
