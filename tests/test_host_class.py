"""`python -m sgl_tpu.bench.host_class`: the commands it plans per host, size and ISA level, the
ratios it takes from the agent-loop results (the runs themselves are the agent loop's, tested
end to end in test_agent_loop.py and test_bench_entry_points.py), and `bench.faithfulness` on
our side in a tiny size (its llama.cpp side needs a llama-perplexity build: the format it reads
is checked here)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu.bench import faithfulness, host_class


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
    assert "widen_gguf.py" in out[0] and len(out) == 1 + 2 * len(host_class.RUN_NAMES)
    assert "sgl_tpu.bench.faithfulness" in out[-1]
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


def test_isa_levels_map_to_our_caps_and_refuse_what_the_cpu_lacks():
    env = host_class.isa_env("avx2", {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert env == {"PATH": "/bin", "SGL_TPU_CPU_KERNELS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    vnni = host_class.isa_env("avx2-vnni", {})
    assert vnni == {"SGL_TPU_CPU_KERNELS": "avx2-vnni", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}
    wide = host_class.isa_env("avx512", {"SGL_TPU_CPU_KERNELS": "avx2"})
    assert wide == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert host_class.isa_env(None, {"SGL_TPU_CPU_KERNELS": "avx2"}) == {
        "SGL_TPU_CPU_KERNELS": "avx2"}
    zen4 = ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
    assert host_class.isa_refusal("avx512", zen4) is None
    assert host_class.isa_refusal("avx2", zen4) is None
    why = host_class.isa_refusal("avx2-vnni", zen4)
    assert "avx_vnni" in why and "SIGILL" in why
    assert "avx512_vnni" in host_class.isa_refusal("avx512", ["avx2", "avx512f", "avx512bw",
                                                              "avx512vl", "avx512_bf16"])
    assert host_class.isa_refusal("avx2-vnni", ["avx2", "avx_vnni"]) is None


def test_dry_run_plans_the_isa_build_and_caps(tmp_path):
    flags = host_class.cpu_info()["flags"]
    isa = "avx2" if "avx2" in flags else None
    if isa is None:
        pytest.skip("no AVX2 on this CPU")
    out = subprocess.run([sys.executable, "-m", "sgl_tpu.bench.host_class", "--isa", isa,
                          "--llama-build-dir", str(tmp_path / "llama"), "--sizes", "135m",
                          "--runs", "single,faithfulness", "--out-dir", str(tmp_path / "o"),
                          "--dry-run"], capture_output=True, text=True, check=True
                         ).stdout.splitlines()
    assert out[0] == ("# our servers' environment: SGL_TPU_CPU_KERNELS=avx2 "
                      "ONEDNN_MAX_CPU_ISA=AVX2")
    assert out[1].endswith(f"build_llama_server.sh avx2 {tmp_path / 'llama'}")
    assert f"llama-server:{tmp_path / 'llama' / 'bin' / 'llama-server'}" in out[2]
    assert out[3].endswith(f"--llama-perplexity {tmp_path / 'llama' / 'bin' / 'llama-perplexity'}")
    if "avx_vnni" not in flags:
        refused = subprocess.run([sys.executable, "-m", "sgl_tpu.bench.host_class", "--isa",
                                  "avx2-vnni", "--dry-run"], capture_output=True, text=True)
        assert refused.returncode != 0 and "avx_vnni" in refused.stderr
    with pytest.raises(SystemExit, match="--llama-server"):
        host_class.main(["--dry-run"])


def test_loaded_isa_reports_whether_the_kernels_are_the_level_asked_for():
    compute = {"cpu": {"compiled_kernels": {"a": {"flavour": "native", "simd": "avx512f"},
                                            "b": {"unavailable": "not built"}},
                       "onednn": {"isa": "Intel AVX2", "max_cpu_isa": "AVX2"}},
               "quantization": {"simd": "avx512f", "vnni": True}}
    loaded = host_class.loaded_isa(compute, "avx2")
    assert loaded["kernel_flavours"] == {"a": "native", "b": None}
    assert loaded["as_requested"] is False and loaded["onednn_max_cpu_isa"] == "AVX2"
    assert host_class.loaded_isa(compute, "native")["as_requested"] is True
    assert "as_requested" not in host_class.loaded_isa(compute, None)


def test_bandwidth_floor_counts_the_weights_a_step_reads(tmp_path):
    import gguf

    untied = ck.make_tiny_gguf(tmp_path / "untied.gguf")
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(untied).tensors}
    assert "output.weight" in tensors
    assert host_class.weight_bytes(untied) == sum(tensors.values()) - tensors[
        "token_embd.weight"]
    tied = ck.make_tiny_gguf(tmp_path / "tied.gguf", tie_word_embeddings=True)
    assert host_class.weight_bytes(tied) == sum(
        int(t.n_bytes) for t in gguf.GGUFReader(tied).tensors)
    assert host_class.floor_ratios({"auto": 5.0, "llama-server": None}, 2.5) == {
        "auto": 2.0, "llama-server": None}


def test_reference_logits_in_llama_perplexity_base_format(tmp_path):
    """The reference's 16-bit log-probabilities decode to the float32 ones within a step of
    the 16-nat range, and the file's header and tokens are llama-perplexity's."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 11)) * 4).astype(np.float32)
    logits[1] = 0.0  # a flat row: scale 0
    enc = faithfulness.encode_base(logits)
    assert enc.shape == (3, 2 * 6 + 4) and enc.dtype == np.uint16
    scale, min_lp = enc[:, :4].copy().view(np.float32).T
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    decoded = scale[:, None] * enc[:, 4:15] + min_lp[:, None]
    shown = logp > logp.max(1, keepdims=True) - 16
    assert np.abs(decoded - logp)[shown].max() <= 16 / 65535 + 1e-5
    assert list(faithfulness.base_argmax(enc, 11)) == [logits[0].argmax(), 0,
                                                       logits[2].argmax()]
    chunks = faithfulness.chunks(list(range(20)), 8, bos=99)
    assert chunks == [[99, *range(1, 8)], [99, *range(9, 16)]]
    assert list(faithfulness.targets_of(chunks)) == [5, 6, 7, 13, 14, 15]
    with pytest.raises(ValueError, match="at least 16"):
        faithfulness.chunks(list(range(15)), 8, bos=None)
    path = tmp_path / "base.kld"
    faithfulness.write_base(path, 8, 11, chunks, np.zeros((6, 16), np.uint16))
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_" and struct.unpack("<iii", raw[8:20]) == (8, 11, 2)
    assert np.frombuffer(raw[20:84], np.int32).tolist() == [t for c in chunks for t in c]
    assert len(raw) == 84 + 6 * 16 * 2


def test_llama_perplexity_report_is_parsed():
    text = ("Mean PPL(Q)                   :  80.123456 ±   1.2\n"
            "Mean PPL(base)                :  78.300000 ±   1.1\n"
            "Mean    KLD:   0.012345 ±   0.001\nSame top p:  92.857 ±  2.3 %\n")
    assert faithfulness.parse_llama(text) == {"perplexity": 80.123456,
                                              "reference_perplexity": 78.3,
                                              "kld_mean": 0.012345, "top1_agreement": 0.9286}
    assert faithfulness.parse_llama("crashed")["top1_agreement"] is None


@pytest.mark.slow
def test_faithfulness_of_our_side_on_a_tiny_gguf(tmp_path):
    """Both runs of our side on a tiny Q4_0 GGUF: the reference agrees with itself, the
    default path's figures are in range, and the summary keeps them."""
    model = ck.make_tiny_gguf(tmp_path / "tiny.gguf", projection_type="Q4_0")
    out = tmp_path / "f.json"
    faithfulness.main(["--model-path", model, "--ctx", "8", "--chunks", "2", "--output",
                       str(out)])
    result = json.loads(out.read_text())
    assert result["chunks"] == 2 and result["reference"]["positions"] == 6
    assert result["reference"]["top1_agreement"] == 1.0
    ours = result["ours"]
    assert ours["positions"] == 6 and 0 <= ours["top1_agreement"] <= 1
    assert ours["perplexity"] > 1 and "llama" not in result
    summary = host_class.summarize_faithfulness(result)
    assert summary["ours"]["top1_agreement"] == ours["top1_agreement"]
    assert summary["reference"]["perplexity"] == result["reference"]["perplexity"]


def test_report_reads_each_criterion_as_ours_better_by(tmp_path):
    from sgl_tpu.bench import host_class_report

    summary = {"host": {"model": "Some EPYC"}, "isa": {"name": "avx2"}, "runs": {"135m": {
        "single": {"itl_p50_ms": {"none": 5.0, "llama-server": 10.0}, "none_over_llama": 0.5,
                   "itl_over_floor": {"none": 2.0}},
        "c8_256": {"itl_p50_ms": {"auto": 20.0, "llama-server": 40.0}, "auto_over_llama": 0.5},
        "faithfulness": {"ours": {"perplexity": 80.0, "top1_agreement": 0.95, "kld_mean": 0.004},
                         "llama": {"perplexity": 78.0, "top1_agreement": 0.95, "kld_mean": 0.002},
                         "reference": {"perplexity": 77.0}}}}}
    got = host_class_report.factors(summary)
    assert got["one stream, drafts off: llama-server ITL / ours"]["135m"][0] == pytest.approx(2.0)
    assert got["perplexity: llama.cpp's / ours"]["135m"][0] == pytest.approx(78 / 80)
    assert got["cold 2k-token prompt: llama-server TTFT / ours"]["135m"] == (None, "-")
    table = host_class_report.markdown(summary).splitlines()
    assert table[0] == "| criterion (ours better by, target) | 135m |"
    rows = {line.split(" (")[0].lstrip("| "): line for line in table[2:]}
    assert "**2.00x** ✓" in rows["one stream, drafts off: llama-server ITL / ours"]
    assert "**2.00x** ✗" in rows["8 streams: llama-server per-stream ITL / ours"]
    assert "**0.50x** ✗" in rows["one stream, drafts off: bandwidth floor / ITL"]
    assert "**1.00x** ✓" in rows["top-1 agreement with float32: ours / llama.cpp's"]
    assert "**0.50x** (0.0040 / 0.0020)" in rows[
        "mean KL divergence from float32: llama.cpp's / ours"]
    host_class_report.plot(summary, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_keeps_finished_runs_and_writes_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_class, "_bandwidth", lambda: 50.0)  # measured in its own test
    single = {"runs": {"auto": {"react": _row(5)}, "none": {"react": _row(10)},
                       "llama-server": {"react": _row(20)}}, "target_errors": {}}
    (tmp_path / "1.4b_single.json").write_text(json.dumps(single))
    import gguf

    wide = tmp_path / "wide.gguf"  # the 1.4B-class model's stand-in: only its bytes are read
    writer = gguf.GGUFWriter(str(wide), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    host_class.main(["--llama-server", str(tmp_path / "no-such-llama-server"), "--sizes", "1.4b",
                     "--runs", "single", "--resume", "--out-dir", str(tmp_path),
                     "--wide-gguf", str(wide)])
    assert "kept" in capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"]["1.4b"]["single"]["none_over_llama"] == pytest.approx(0.5)
    assert "**2.00x** ✓" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "summary.png").exists()


def test_report_merges_one_host_class_run_per_size():
    from sgl_tpu.bench import host_class_report

    a = {"host": {"model": "A"}, "runs": {"135m": {"single": {"none_over_llama": 0.5}}}}
    b = {"host": {"model": "B"}, "runs": {"1.4b": {"single": {"none_over_llama": 0.25}},
                                          "135m": {"cold2k": {"auto_over_llama": 0.1}}}}
    m = host_class_report.merged([a, b])
    assert m["host"]["model"] == "A" and list(m["runs"]) == ["135m", "1.4b"]
    assert set(m["runs"]["135m"]) == {"single", "cold2k"}


def test_token_steps_score_the_next_token_alike_in_extend_and_decode_steps(tiny_model):
    """`token_steps` forces each step's token to the next id and reports its log-prob. With
    float32 weights and a float32 KV pool nothing is rounded to a coarser type, so a decode
    step scores each next token as an extend step of one row does and as a prefill of the whole
    sequence does, up to float32 sums taken in other orders (far below 1e-4 nats)."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    engine = faithfulness.make_engine(tiny_model, "none", "float32", 1)
    try:
        ids = np.random.default_rng(0).integers(3, 200, 40).astype(np.int32)
        extend = [float(r.logprobs[0]) for r in faithfulness.token_steps(engine, ids)]
        decode = [float(r.logprobs[0]) for r in faithfulness.token_steps(engine, ids, "decode")]
        runner = engine.scheduler.runner
        pages = np.arange(1, 1 + -(-len(ids) // engine.server_args.page_size), dtype=np.int32)
        prefill = runner.forward(ForwardMode.EXTEND, [SeqStep(
            token_ids=ids, prefix_len=0, pages=pages, sampling=SamplingParams(temperature=0.0),
            seed=0, num_output_tokens=0)])
        whole = runner.token_logprobs(prefill.hidden, ids[1:])[0][: len(ids) - 1]
    finally:
        engine.shutdown()
    assert len(decode) == len(extend) == len(ids) - 1
    assert np.abs(np.subtract(decode, extend)).max() < 1e-4
    assert np.abs(np.subtract(extend, whole)).max() < 1e-4
    assert min(decode) < -1.0  # a random model's next tokens are not certain: a real score
