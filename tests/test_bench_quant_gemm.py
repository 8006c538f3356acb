"""`tools/quant_gemm_bench.py`: the tile kernels timed per shape and row count, beside
a baseline source compiled next to the built module (here the same source, so the two must
agree)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tool_scripts import TOOLS_DIR, load_tool  # noqa: E402

from sgl_tpu.backends.torch.kernels import cpu_extension, quant_gemm_cpu  # noqa: E402

bench = load_tool("quant_gemm_bench")


def test_shapes_parse_and_name_a_bad_kind():
    assert bench.parse_shapes("o=32x64:q4,head=48x32:q8") == [("o", 32, 64, "q4"),
                                                             ("head", 48, 32, "q8")]
    with pytest.raises(ValueError, match="shape o: kind must be q4 or q8"):
        bench.parse_shapes("o=32x64:q5")


@pytest.mark.slow
def test_quant_gemm_bench_times_both_kinds_against_a_baseline(tmp_path):
    if not quant_gemm_cpu.tile_dot():
        pytest.skip("this build has no tile kernels (AVX2 + F16C)")
    out = tmp_path / "gemm.json"
    subprocess.run([sys.executable, str(TOOLS_DIR / "quant_gemm_bench.py"),
                    "--shapes", "o=32x64:q4,head=48x32:q8", "--rows", "1,9", "--repeats", "2",
                    "--threads", "1", "--baseline-source", str(cpu_extension.QUANT_GEMM.source),
                    "--output", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["threads"] == 1
    assert [(r["shape"], r["kind"], r["rows"]) for r in result["rows"]] == [
        ("o", "q4", 1), ("o", "q4", 9), ("head", "q8", 1), ("head", "q8", 9)]
    # the same source on both sides: the bench checked the results agree before timing
    assert all(r["ms"] > 0 and r["baseline_ms"] > 0 and r["over_baseline"] > 0
               for r in result["rows"])
