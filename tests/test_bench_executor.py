"""`python -m sgl_tpu.bench.executor` in a tiny mode: one run per oneDNN ISA cap and weight
format, each in its own process (the cap is read once per process), rows tagged with both and
the `by_isa` ratios pairing each row with its twin under the other cap."""

from __future__ import annotations

import json
import subprocess
import sys

import checkpoints as ck
import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_executor_bench_runs_each_isa_cap_and_weight_format(tmp_path):
    model = ck.make_tiny_hf_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "sgl_tpu.bench.executor", "--model-path", str(model),
                    "--backends", "torch", "--dtypes", "bfloat16", "--prefill", "32",
                    "--decode-batches", "2", "--context", "16", "--repeats", "1",
                    "--onednn-isas", "default,AVX2", "--quantization", "none,int8",
                    "--output", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    variants = [(v["onednn_isa"], v["quantization"]) for v in result["variants"]]
    assert variants == [("default", "none"), ("AVX2", "none"), ("default", "int8"),
                        ("AVX2", "int8")]
    capped = [v["onednn"] for v in result["variants"] if v["onednn_isa"] == "AVX2"]
    assert all(o["isa"] == "Intel AVX2" and not o["amx"] for o in capped)
    for quantization in ("none", "int8"):
        for phase in ("prefill", "decode"):
            ratio = [r for r in result["by_isa"] if r["quantization"] == quantization
                     and r["phase"] == phase]
            assert len(ratio) == 1 and ratio[0]["other_isa"] == "AVX2"
            assert ratio[0]["tok_per_s_ratio"] > 0


@pytest.mark.slow
def test_executor_bench_deterministic_mode_times_the_flag_on_over_off(tmp_path):
    model = ck.make_tiny_hf_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "sgl_tpu.bench.executor", "--deterministic",
                    "--model-path", str(model), "--backends", "torch", "--dtypes", "bfloat16",
                    "--prefill", "32", "--decode-batches", "1,2", "--context", "16",
                    "--repeats", "1", "--torch-threads", "1", "--output", str(out)],
                   check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert [r["phase"] for r in result["runs"]] == ["prefill", "decode_b1", "decode_b2"]
    for r in result["runs"]:
        assert r["backend"] == "torch" and r["dtype"] == "bfloat16"
        assert r["on_ms"] > 0 and r["off_ms"] > 0
        assert r["on_over_off"] == pytest.approx(r["on_ms"] / r["off_ms"], rel=0.05)
    assert result["settings"]["torch-bfloat16-on"]["quantization"] == "none"
    on = result["compute"]["torch-bfloat16-on"]  # what each runner computes with
    assert on["gemm"] == "fixed-order" and on["cpu"]["onednn"]["isa"]


@pytest.mark.slow
def test_executor_bench_times_the_compiled_decode_layers_against_python(tmp_path):
    """`--torch-decode-paths packing,python-layers` on the default model's tile kernels: each
    decode row twice, the compiled layer loop (`packing`) and the Python one, which reports
    its median over the compiled loop's."""
    from sgl_tpu.backends.torch.kernels import quant_gemm_cpu

    if not quant_gemm_cpu.tiles_for(576):
        pytest.skip("this build has no tile kernels (AVX2 + F16C)")
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "sgl_tpu.bench.executor", "--backends", "torch",
                    "--dtypes", "float32", "--quantization", "gguf-a8", "--kv-cache-dtype",
                    "bfloat16", "--prefill", "", "--decode-batches", "1,2", "--context", "64",
                    "--repeats", "2", "--torch-decode-paths", "packing,python-layers",
                    "--output", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    rows = {(r["batch"], r["decode_path"]): r for r in result["runs"]}
    assert set(rows) == {(b, p) for b in (1, 2) for p in ("packing", "python-layers")}
    for b in (1, 2):
        python = rows[b, "python-layers"]
        assert python["median_over_packing"] == pytest.approx(
            python["median_ms"] / rows[b, "packing"]["median_ms"], rel=0.05)
    assert result["compute"]["torch-float32"]["decode_layers"] == "compiled"


def test_isa_twins_pair_whatever_their_timings():
    """Twins under two caps differ in every timing and in what is derived from one (the KV
    bytes over the step time): a loaded machine must not unpair them."""
    from sgl_tpu.bench.executor import pair_by_isa

    base = {"quantization": "none", "backend": "torch", "dtype": "bfloat16",
            "attention": "torch-cpu-fused", "compile": False, "phase": "decode", "batch": 2,
            "context": 16, "shared_prefix": 0, "decode_path": "packing", "sampling": "greedy",
            "kv_mb_per_step": 0.1}
    runs = [{**base, "onednn_isa": "default", "step_ms": 2.0, "median_ms": 2.1,
             "tok_per_s": 1000.0, "kv_gb_per_s_over_step": 0.05},
            {**base, "onednn_isa": "AVX2", "step_ms": 4.0, "median_ms": 9.0,
             "tok_per_s": 500.0, "kv_gb_per_s_over_step": 0.01},
            {**base, "onednn_isa": "AVX2", "batch": 8, "tok_per_s": 100.0}]
    pairs = pair_by_isa(runs, "default")
    assert [(p["batch"], p["other_isa"], p["tok_per_s_ratio"]) for p in pairs] == \
        [(2, "AVX2", 2.0)]


def test_kv_bytes_read_counts_windows():
    """Full-attention layers read the shared prefix once and each sequence's rest; a Gemma
    local layer (or a Mistral layer) each sequence's last `window` tokens only."""
    import dataclasses

    from sgl_tpu.bench.executor import kv_bytes_read
    from sgl_tpu.models.config import GemmaConfig, ModelConfig

    base = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                       num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32,
                       rope_theta=1e4, rms_norm_eps=1e-6, context_len=512,
                       tie_word_embeddings=True)
    per_token = 2 * 1 * 32 * 2  # K and V, one KV head of 32, bfloat16
    assert kv_bytes_read(base, "bfloat16", 4, 100, 60) == 3 * per_token * (60 + 4 * 40)
    mistral = dataclasses.replace(base, sliding_window=16)
    assert kv_bytes_read(mistral, "bfloat16", 4, 100, 60) == 3 * per_token * 4 * 16
    gemma = dataclasses.replace(base, arch="gemma3", gemma=GemmaConfig(
        sliding_window=16, sliding_layers=(True, False, True), rope_local_theta=1e4,
        query_pre_attn_scalar=32))
    assert kv_bytes_read(gemma, "bfloat16", 4, 100, 60) == per_token * (
        2 * 4 * 16 + 60 + 4 * 40)
