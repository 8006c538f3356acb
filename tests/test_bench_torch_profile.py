"""The torch step profile of the executor bench (sgl_tpu/bench/torch_profile.py) on a CPU:
per-step numbers from torch.profiler, ranked by CPU time where no device ran."""

from __future__ import annotations

import torch

from sgl_tpu.bench.torch_profile import profile_step


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
