"""The supported bench entry points that drive servers, each run in a tiny mode on a tiny random
checkpoint: `bench.serving` (its comparisons), `bench.structured`, the reliability
campaign (tests/reliability_campaign.py) and `bench.agent_loop --mixed-batch`.
(`bench.executor`: tests/test_bench_executor.py; the rest of `bench.agent_loop`:
tests/test_agent_loop.py; `bench.accelerator`: tests/test_random_checkpoint.py.)"""

from __future__ import annotations

import json

import checkpoints as ck
import pytest

SERVER_FLAGS = "--skip-warmup --dtype float32 --max-total-tokens 2048 --max-running-requests 4"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("bench") / "llama", "llama")


@pytest.mark.slow
def test_serving_compares_cache_on_and_off(model, tmp_path):
    from sgl_tpu.bench import serving

    out = tmp_path / "serving.json"
    serving.main(["--model-path", model, "--clients", "2", "--requests-per-client", "2",
                  "--prefix-tokens", "64", "--question-tokens", "8", "--output-tokens", "4",
                  f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"cache/shared", "cache/random", "nocache/shared",
                                   "nocache/random"}
    assert all(r["requests"] == 4 for r in result["runs"].values())
    assert result["runs"]["cache/shared"]["cache_hit_rate"] > 0
    assert result["runs"]["nocache/shared"]["cache_hit_rate"] == 0
    assert set(result["ratios"]) == {"shared", "random"}


@pytest.mark.slow
def test_serving_compares_overlap_on_and_off(model, tmp_path):
    from sgl_tpu.bench import serving

    out = tmp_path / "overlap.json"
    serving.main(["--compare", "overlap", "--model-path", model, "--concurrency", "1", "2",
                  "--rounds", "1", "--prompt-tokens", "16", "--output-tokens", "4",
                  f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    assert {(r["concurrency"], r["config"]) for r in result["runs"]} == {
        (c, name) for c in (1, 2) for name in ("overlap", "serial")}
    assert set(result["summary"]) == {"1", "2"}
    assert all(s["overlap_over_serial_median"] > 0 for s in result["summary"].values())


@pytest.mark.slow
def test_serving_compares_the_server_with_its_executor(model, tmp_path):
    from sgl_tpu.bench import serving

    out = tmp_path / "gap.json"
    serving.main(["--compare", "gap", "--model-path", model, "--concurrency", "1", "3",
                  "--rounds", "1", "--prompt-tokens", "16", "--output-tokens", "4",
                  f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    assert {(r["concurrency"], r["config"], r["requests"]) for r in result["runs"]} == {
        (c, name, c) for c in (1, 3) for name in ("server", "engine")}
    assert all(s["server_over_engine_median"] > 0 for s in result["summary"].values())


@pytest.mark.slow
def test_serving_compares_two_kv_cache_dtypes(model, tmp_path):
    from sgl_tpu.bench import serving

    out = tmp_path / "kv.json"
    serving.main(["--compare", "kv-cache-dtype", "--model-path", model, "--concurrency", "1",
                  "--rounds", "1", "--prompt-tokens", "64", "--output-tokens", "4",
                  f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    assert {(r["concurrency"], r["config"]) for r in result["runs"]} == {
        (1, "int8"), (1, "bfloat16")}
    assert all(r["itl_p50_ms"] > 0 for r in result["runs"])
    assert {m["kv_cache_dtype"] for m in result["memory"].values()} == {"int8", "bfloat16"}
    # the tiny model's head_dim 16: 18-byte int8 head rows against 32 bytes of bfloat16
    assert result["kv_tokens_per_gb_int8_over_bfloat16"] == pytest.approx(32 / 18, rel=1e-3)
    assert result["summary"]["1"]["itl_int8_over_bfloat16_median"] > 0


@pytest.mark.slow
def test_serving_compares_a_cold_server_with_a_restarted_one(model, tmp_path):
    from sgl_tpu.bench import serving

    out = tmp_path / "restart.json"
    serving.main(["--compare", "restart", "--model-path", model, "--prefix-tokens", "256",
                  "--output-tokens", "2", f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    cold, warm = result["runs"]["cold"], result["runs"]["warm_restart"]
    assert cold["cache_hit_rate"] == 0
    assert warm["cache_hit_rate"] > 0.9  # the prompt's whole pages came from disk
    assert result["ratios"]["ttft_cold_over_warm_restart"] > 0


@pytest.mark.slow
def test_structured_times_masks_and_jump_forward(model, tmp_path):
    from sgl_tpu.bench import structured

    out = tmp_path / "structured.json"
    structured.main(["--model-path", model, "--overhead-batches", "1", "--overhead-tokens", "4",
                     "--json-batches", "1", "--json-rounds", "1", "--repeats", "1",
                     f"--server-flags={SERVER_FLAGS}", "--output", str(out)])
    result = json.loads(out.read_text())
    overhead = result["overhead"]["batch1"]
    assert overhead["unconstrained"]["tokens_per_request"] == [4]
    assert overhead["constrained"]["output_tokens"] == 4
    assert "batch1" in result["json"]


@pytest.mark.slow
def test_reliability_campaign_in_a_tiny_size(model, tmp_path):
    from reliability_campaign import main

    out = tmp_path / "reliability.json"
    # every phase, each at a tiny size (tests/test_reliability*.py run them at CI size)
    main(["--model-path", model, "--clients", "2", "--requests-per-client", "1",
          "--exhaustion-clients", "2", "--fuzz-examples", "1", "--big-prompts", "1",
          "--big-prompt-chars", "2000", "--max-total-tokens", "512", "--flood-programs", "256",
          "--shared-key-parallel", "8", "--output", str(out)])
    totals = json.loads(out.read_text())["totals"]
    assert totals["num_5xx_outside_fatal_fault"] == 0
    assert totals["leaked_pages"] == 0
    assert totals["faults_injected"] >= 1


@pytest.mark.slow
def test_agent_loop_mixed_batch_runs_agents_alone_then_beside_a_batch(model, tmp_path):
    """`--mixed-batch`: the agents alone, then beside long completions without and with
    priorities sent (through the native API, to a server scheduling by them)."""
    from sgl_tpu.bench.agent_loop.__main__ import main

    out = tmp_path / "mixed.json"
    main(["--launch", f"{SERVER_FLAGS} --enable-priority-scheduling", "--model-path", model,
          "--workloads", "multi-turn-chat", "--num-programs", "2", "--turns", "2",
          "--output-tokens", "4", "--system-tokens", "30", "--observation-tokens", "10",
          "--warmup-programs", "0", "--no-progress", "--mixed-batch", "2",
          "--batch-prompt-tokens", "16", "--batch-output-tokens", "8", "--output", str(out)])
    result = json.loads(out.read_text())
    assert not result["target_errors"]
    mixed = result["mixed"]["sgl-tpu"]["multi-turn-chat"]
    for phase in ("alone", "without_priority", "with_priority"):
        agents = mixed[phase]["interactive"]
        assert (agents["requests"], agents["requests_failed"]) == (4, 0), agents["errors"]
        if phase != "alone":
            batch = mixed[phase]["batch"]
            assert (batch["requests"], batch["generated_tokens"]) == (2, 16), batch["errors"]
            # the server's counter was read (None when /server_info lacks it)
            assert type(mixed[phase]["priority_preemptions"]) is int
    assert mixed["without_priority"]["priority_preemptions"] == 0  # no priorities sent
    ratios = mixed["ratios"]
    assert ratios["ttft_p99_over_alone"]["with_priority"] > 0
    assert ratios["batch_gen_tok_per_s_with_over_without"] > 0
    assert set(result["runs"]["sgl-tpu"]) == {
        "multi-turn-chat", "multi-turn-chat+batch", "multi-turn-chat+batch+prio"}


@pytest.mark.slow
def test_agent_loop_stops_its_servers_when_terminated(model, tmp_path):
    """SIGTERM to `bench.agent_loop` while the server it launched serves: the harness exits and
    takes the server (and its child processes) with it, nothing left in its process group."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from sgl_tpu.server.ready import READY_MESSAGE

    cmd = [sys.executable, "-m", "sgl_tpu.bench.agent_loop", "--launch", SERVER_FLAGS,
           "--model-path", model, "--workloads", "multi-turn-chat", "--num-programs", "1",
           "--turns", "8", "--output-tokens", "4", "--system-tokens", "30",
           "--observation-tokens", "10",
           "--tool-latency", "10:10", "--warmup-programs", "0", "--no-progress",
           "--log-dir", str(tmp_path)]  # 70 s of tool calls: still running when terminated
    errors = tmp_path / "harness.err"
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=errors.open("w"))
    try:
        deadline = time.time() + 120
        while not any(READY_MESSAGE in log.read_text(errors="replace")
                      for log in tmp_path.glob("*.log")):
            assert proc.poll() is None, errors.read_text()[-2000:]
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.5)
        time.sleep(2.0)  # serving its first calls
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, errors.read_text()[-2000:]
        deadline = time.time() + 30
        while True:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break  # no process of the group is left
            assert time.time() < deadline, "the launched server outlived the harness"
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
