"""Random-weight checkpoints of a model's shape (tools/random_checkpoint.py, and its command
line): the shape files load back as the same model config and
tokenizer, the random weights fill every tensor the loader expects, an Engine serves the result,
and shapes it cannot write are refused. The accelerator bench, which times such checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import checkpoints as ck
import gemma_checkpoints as gck
import pytest
from tool_scripts import TOOLS_DIR, load_tool

from sgl_tpu import Engine
from sgl_tpu.loader import load_model

rc = load_tool("random_checkpoint")


@pytest.mark.parametrize("tied", [False, True])
def test_shape_and_weights_load_as_the_same_model(tmp_path, tied):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama", tie_word_embeddings=tied)
    out = rc.write_shape(tmp_path / "rand", src)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    weights = rc.write_weights(out, seed=3)
    original, rand = load_model(src), load_model(str(out))
    assert rand.config == original.config
    text = "<|im_start|>user hello 12345 world<|im_end|>"
    assert rand.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert rand.tokenizer.chat_template == original.tokenizer.chat_template
    assert rand.tokenizer.eos_token_ids == original.tokenizer.eos_token_ids
    # random, not copied: the embedding differs from the source's
    assert (rand.params["embed"] != original.params["embed"]).any()
    stamp = weights.stat().st_mtime_ns
    assert rc.write_weights(out, seed=4).stat().st_mtime_ns == stamp  # kept, not rewritten


def test_command_line_writes_shape_then_weights(tmp_path):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    script = [sys.executable, str(TOOLS_DIR / "random_checkpoint.py")]
    out = tmp_path / "rand"
    subprocess.run([*script, "shape", str(out), "--model-path", str(src), "--minimal"],
                   check=True, capture_output=True)
    subprocess.run([*script, "weights", str(out)], check=True, capture_output=True)
    assert load_model(str(out)).config.num_layers == 1


def test_engine_serves_a_random_checkpoint(tmp_path):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    out = rc.write_shape(tmp_path / "rand", src)
    rc.write_weights(out)
    eng = Engine(str(out), backend="torch", dtype="float32", torch_compile="off",
                 torch_threads=1, skip_warmup=True, max_total_tokens=512, page_size=4)
    try:
        res = eng.generate(prompt="hello world", sampling_params={
            "temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
        assert len(res["output_ids"]) == 5
    finally:
        eng.shutdown()


def test_minimal_shape_keeps_the_vocabulary_and_tokenizer(tmp_path):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    out = rc.write_shape(tmp_path / "min", src, minimal=True)
    rc.write_weights(out)
    original, small = load_model(src), load_model(str(out))
    assert (small.config.num_layers, small.config.hidden_size) == (1, 64)
    assert small.config.vocab_size == original.config.vocab_size
    text = "<|im_start|>user hello 12345 world<|im_end|>"
    assert small.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert small.params["embed"].shape == (original.config.vocab_size, 64)


def test_config_json_shapes_match_the_loader(tmp_path):
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    cfg = json.loads((rc.write_shape(tmp_path / "rand", src) / "config.json").read_text())
    shapes = rc.tensor_shapes(cfg)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2 * 16, 64)  # 2 KV heads
    assert "lm_head.weight" in shapes  # untied
    assert len(shapes) == 3 + 9 * cfg["num_hidden_layers"]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_other_shapes_are_refused_by_name(tmp_path, arch):
    if arch == "gemma3":
        src = gck.make_tiny_gemma(tmp_path / "src", "gemma3")
        match = "architecture 'gemma3'"
    else:
        src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "qwen2")
        match = "architecture 'qwen2'.*attention bias"
    with pytest.raises(ValueError, match=match):
        rc.write_shape(tmp_path / "rand", src)


@pytest.mark.slow
def test_accelerator_bench_runs_its_parts_on_a_random_checkpoint(tmp_path):
    """The accelerator table's driver on a CPU: every part of one backend runs as its own
    process and the summary carries their numbers (the host part's on a minimal model, the
    streams read by two client processes, the profile part by tools/torch_profile.py); a part
    that fails is recorded, not fatal, and a profile part without its script is skipped."""
    src = ck.make_tiny_hf_checkpoint(tmp_path / "src", "llama")
    model = rc.write_shape(tmp_path / "rand", src)
    rc.write_weights(model)
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, "-m", "sgl_tpu.bench.accelerator", "--model-path", str(model),
         "--out-dir", str(out), "--backends", "torch,nope", "--dtype", "float32",
         "--prefill", "16", "--batches", "1,2", "--context", "16", "--streams", "1,2",
         "--output-tokens", "4", "--rounds", "1", "--parts", "executor,servers,host,profile",
         "--client-procs", "2",
         "--server-flags=--skip-warmup --max-running-requests 4",
         "--timeout", "300"], check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())["backends"]
    row = summary["torch"]
    assert row["status"] == {"executor": "ok", "servers": "ok", "host": "ok", "profile": "ok"}
    assert row["prefill_tok_per_s"]["16"] > 0
    assert set(row["decode_step_ms"]) == {f"b{b} {path} {s}" for b in (1, 2)
                                          for path in ("packing", "static")
                                          for s in ("greedy", "temperature", "top-k", "sampled")}
    for key in ("server_output_tok_per_s", "host_ceiling_output_tok_per_s"):
        assert set(row[key]) == {"1 streams", "2 streams"}
        assert all(v["overlap"] > 0 and v["serial"] > 0 and v["client_busy_max"] >= 0
                   for v in row[key].values())
    servers = json.loads((out / "servers_torch.json").read_text())
    assert servers["args"]["server_flags"].endswith("--skip-warmup --max-running-requests 4")
    # two streams, two reader processes; every token arrived
    assert {(r["concurrency"], r["client_procs"]) for r in servers["runs"]} == {(1, 1), (2, 2)}
    assert all(r["requests"] == r["concurrency"] and r["output_tok_per_s"] > 0
               for r in servers["runs"])
    host = json.loads((out / "host_torch.json").read_text())
    assert host["args"]["model_path"] == str(out / "host_model")
    assert load_model(host["args"]["model_path"]).config.num_layers == 1
    profile = json.loads((out / "profile_torch.json").read_text())["runs"]
    assert profile and all(r["profile"]["host_ms_per_step"] > 0 for r in profile)
    assert summary["nope"]["status"]["executor"].startswith("exit")  # an unknown backend
    assert (out / "executor_nope.stderr.txt").read_text()


def test_accelerator_skips_a_profile_part_without_its_script(tmp_path):
    from sgl_tpu.bench import accelerator

    out = tmp_path / "out"
    accelerator.main(["--out-dir", str(out), "--backends", "jax", "--parts", "profile",
                      "--tools-dir", str(tmp_path / "no_tools")])
    status = json.loads((out / "summary.json").read_text())["backends"]["jax"]["status"]
    assert status["profile"].startswith("skipped: no jax profiler")


@pytest.mark.parametrize("budget, used, timeouts", [
    # executors end in 10 s, servers run to their timeout: each part gets an equal share of
    # what is left, so the time the executors did not use goes to the servers
    # (the last one's cut to what is left less the 15 s a part past its timeout may take)
    (200, {"executor": 10}, [50, 190 / 3, 90, 75]),
    # too little for all four: the first parts get MIN_PART_S (30 s), the rest are skipped
    (80, {}, [30, 30, None, None]),
])
def test_accelerator_budget_shares_the_time_left_among_the_parts(tmp_path, monkeypatch, budget,
                                                                 used, timeouts):
    """--budget: the parts run part by part (every backend's executor first), each with an
    equal share of the seconds left, and what no longer fits is skipped; the summary (at
    --summary) holds every part's own JSON."""
    from types import SimpleNamespace

    from sgl_tpu.bench import accelerator

    clock, calls = [0.0], []

    def run_part(cmd, output, timeout):
        calls.append((output.name, timeout))
        clock[0] += used.get(output.name.split("_")[0], timeout)
        return {"status": "ok", "seconds": 1.0, "json": {"runs": [], "part": output.name}}

    monkeypatch.setattr(accelerator, "run_part", run_part)
    monkeypatch.setattr(accelerator, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    accelerator.main(["--out-dir", str(tmp_path / "out"), "--backends", "torch,jax",
                      "--parts", "executor,servers", "--budget", str(budget),
                      "--summary", str(tmp_path / "run.json")])
    names = ["executor_torch", "executor_jax", "servers_torch", "servers_jax"]
    ran = [(n, t) for n, t in zip(names, timeouts, strict=True) if t is not None]
    assert [c[0] for c in calls] == [f"{n}.json" for n, _ in ran]
    assert [c[1] for c in calls] == pytest.approx([t for _, t in ran])
    summary = json.loads((tmp_path / "run.json").read_text())
    for name, timeout in zip(names, timeouts, strict=True):
        part = summary["parts"][name]
        if timeout is None:
            assert part["status"].startswith("skipped")
        else:
            assert part["json"]["part"] == f"{name}.json"
    assert summary["backends"]["jax"]["status"]["servers"] == summary["parts"]["servers_jax"][
        "status"]


def test_a_part_past_its_timeout_keeps_its_rows_and_leaves_no_process_behind(tmp_path):
    """A part killed at its timeout takes the processes it started with it (a servers part's
    servers would otherwise run on under the next parts), and the rows it printed so far
    (one JSON object a line, as the benches print them) are kept as a partial JSON."""
    import sys
    import time
    from pathlib import Path

    from sgl_tpu.bench import accelerator

    pid_file = tmp_path / "child.pid"
    child = "import time; time.sleep(120)"
    rows = [{"phase": "prefill", "tokens": 16, "tok_per_s": 5.0},
            {"phase": "decode", "batch": 1, "median_ms": 2.5}]
    part = (f"import json, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            f"{child!r}]); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
            f"[print(json.dumps(r), flush=True) for r in {rows!r}]; "
            f"print('{{', flush=True); time.sleep(120)")
    t0 = time.monotonic()
    result = accelerator.run_part([sys.executable, "-c", part], tmp_path / "part.json", 3)
    assert result["status"] == "timeout after 3 s" and time.monotonic() - t0 < 30
    assert result["json"] == {"partial": True, "runs": rows}
    pid = int(pid_file.read_text())

    def alive() -> bool:  # (an ended orphan may stay a zombie until its reaper gets to it)
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


def test_accelerator_summary_of_a_servers_part_cut_short():
    """A servers part that did not finish has no summary of its own: the row is made from
    the runs it printed, each loop's median of the rounds it ran; the ratio only where a
    round ran both loops."""
    from sgl_tpu.bench import accelerator

    def run(rnd, c, config, tput):
        return {"round": rnd, "concurrency": c, "config": config, "output_tok_per_s": tput,
                "client_busy": 0.1}

    runs = [run(0, 1, "overlap", 100.0), run(0, 1, "serial", 80.0), run(1, 1, "serial", 90.0),
            run(1, 1, "overlap", 120.0), run(0, 32, "overlap", 900.0)]
    row = accelerator.summarize("torch", {"servers": {"status": "timeout after 60 s",
                                                      "json": {"partial": True, "runs": runs}}})
    assert row["server_output_tok_per_s"] == {
        "1 streams": {"overlap": 110.0, "serial": 85.0, "client_busy_max": 0.1},
        "32 streams": {"overlap": 900.0, "serial": None, "client_busy_max": 0.1}}
    assert row["status"] == {"servers": "timeout after 60 s"}
    assert row["host_ceiling_output_tok_per_s"] == {}


def test_accelerator_summary_keeps_the_parts_done_when_a_run_is_cut_short(tmp_path,
                                                                           monkeypatch):
    """summary.json is rewritten after every part: a run killed mid-way (the accelerator
    host's time limit) still has the rows of the parts that finished."""
    from sgl_tpu.bench import accelerator

    calls = []

    def run_part(cmd, output, timeout):
        calls.append(output.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second part never ends
        return {"status": "ok", "seconds": 1.0}

    monkeypatch.setattr(accelerator, "run_part", run_part)
    with pytest.raises(KeyboardInterrupt):
        accelerator.main(["--out-dir", str(tmp_path), "--backends", "torch",
                          "--parts", "executor,servers"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert calls == ["executor_torch.json", "servers_torch.json"]
    assert summary["backends"]["torch"]["status"] == {"executor": "ok"}
