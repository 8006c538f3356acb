"""`python -m sgl_tpu.bench.host_class`: the commands it plans per host and size, and the
ratios it takes from the agent-loop results (the runs themselves are the agent loop's, tested
end to end in test_agent_loop.py and test_bench_entry_points.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sgl_tpu.bench import host_class


def test_cpu_info_reads_the_model_and_simd_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f "
                    "amx_bf16 amx_tile\n\nprocessor\t: 1\nmodel name\t: Some Xeon\n")
    assert host_class.cpu_info(str(info)) == {"model": "Some Xeon",
                                              "flags": ["avx2", "avx512f", "amx_bf16"]}
    assert host_class.cpu_info(str(tmp_path / "none"))["model"] == "unknown"


def test_commands_per_size_and_host():
    for run in host_class.RUNS:
        small = host_class.run_command(run, "135m", "/bin/llama", None,
                                       Path("d/135m_x.json"), amx=False)
        assert small[1:3] == ["-m", "sgl_tpu.bench.agent_loop"] and "--model-path" not in small
        assert not any("--no-repack" in a for a in small)
    single = host_class.run_command("single", "1.4b", "/bin/llama", "d/smollm2-w3.gguf",
                                    Path("d/1.4b_single.json"), amx=True)
    assert single[3:5] == ["--model-path", "d/smollm2-w3.gguf"]
    assert "react:num_programs=1,turns=2,output_tokens=128" in single
    assert "auto=launch:--max-total-tokens 16384" in single
    peer = [a for a in single if a.startswith("llama-server=")][0]
    assert "-np 1" in peer and "--no-repack" in peer
    cold = host_class.run_command("cold2k", "135m", "/bin/llama", None,
                                  Path("d/c.json"), amx=False)
    assert not any(a.startswith("none=") for a in cold)


def test_dry_run_lists_widening_then_every_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sgl_tpu.bench.host_class", "--llama-server",
                          "/bin/llama", "--out-dir", str(tmp_path), "--dry-run"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "widen_gguf.py" in out[0] and len(out) == 1 + 2 * len(host_class.RUNS)
    assert not (tmp_path / "summary.json").exists()
    with pytest.raises(SystemExit):
        host_class.main(["--llama-server", "x", "--runs", "nope", "--dry-run"])


def _row(itl_ms: float, programs_per_s: float = 0.1, ttft_s: float = 1.0) -> dict:
    return {"itl_s": {"p50": itl_ms / 1e3}, "ttft_s": {"p50": ttft_s},
            "programs_per_s": programs_per_s}


def test_summaries_take_the_criteria_ratios():
    result = {"runs": {"auto": {"react": _row(5, 0.8)}, "none": {"react": _row(10, 0.5)},
                       "llama-server": {"react": _row(20, 0.1)}}, "target_errors": {}}
    agent = host_class.summarize_run("agent", result)
    assert agent["none_over_llama"] == pytest.approx(0.5)
    assert agent["auto_over_none"] == pytest.approx(0.5)
    assert agent["auto_over_llama_programs"] == pytest.approx(8.0)
    c8 = host_class.summarize_run("c8_256", result)
    assert c8["decode_tok_s"]["llama-server"] == pytest.approx(400.0)
    cold = host_class.summarize_run("cold2k", {"runs": {
        "auto": {"w": _row(1, ttft_s=2.0)}, "llama-server": {"w": _row(1, ttft_s=8.0)}}})
    assert cold["auto_over_llama"] == pytest.approx(0.25)
    failed = host_class.summarize_run("single", {"runs": {"auto": {"react": _row(5)},
                                                          "llama-server": {}},
                                                 "target_errors": {"llama-server": "boom"}})
    assert failed["none_over_llama"] is None and failed["errors"] == {"llama-server": "boom"}


def test_memory_read_bandwidth_is_measured():
    """The summary's host memory bandwidth: sums over a tensor, timed (a small one here)."""
    from sgl_tpu.backends.torch.device import memory_read_gb_s

    assert memory_read_gb_s(gib=1 / 64, repeats=2) > 0.1
