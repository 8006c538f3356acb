"""The torch step profile (tools/torch_profile.py) on a CPU: per-step numbers from
torch.profiler, ranked by CPU time where no device ran, and the script run on a tiny model
(the executor bench's decode rows, each with its profile)."""

from __future__ import annotations

import json
import subprocess
import sys

import checkpoints as ck
import pytest
import torch
from tool_scripts import TOOLS_DIR, load_tool

profile_step = load_tool("torch_profile").profile_step


def test_profile_step_counts_per_step_and_ranks_the_heavy_op():
    a = torch.randn(256, 256)

    def step():
        for _ in range(3):
            torch.mm(a, a)
        return a.sum()

    step()
    prof = profile_step(step, steps=4, top=5)
    assert prof["steps"] == 4 and prof["ranked_by"] == "cpu"
    assert prof["device_ms_per_step"] == 0 and prof["graph_replays_per_step"] == 0
    assert prof["host_ms_per_step"] > 0
    mm = next(t for t in prof["top"] if t["op"] == "aten::mm")
    assert mm["calls_per_step"] == 3
    assert prof["top"][0]["op"] == "aten::mm"  # 3 GEMMs of 256^3 outweigh one sum
    assert prof["op_calls_per_step"] >= 4


@pytest.mark.slow
def test_script_profiles_each_decode_row_of_the_executor_bench(tmp_path):
    model = ck.make_tiny_hf_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, str(TOOLS_DIR / "torch_profile.py"), "--model-path",
                    str(model), "--dtypes", "float32", "--prefill", "", "--decode-batches", "1,2",
                    "--context", "8", "--repeats", "2", "--count-calls",
                    "--torch-decode-paths", "packing,static", "--output", str(out)],
                   check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["runs"]
    assert {(r["batch"], r["decode_path"]) for r in rows} == {
        (b, p) for b in (1, 2) for p in ("packing", "static")}
    for r in rows:
        assert r["backend"] == "torch" and r["python_calls_per_step"] > 0
        assert r["profile"]["steps"] == 2 and r["profile"]["host_ms_per_step"] > 0
