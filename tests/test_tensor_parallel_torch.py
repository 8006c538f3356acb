"""Torch tensor parallelism (`--backend torch --tp-size N`, sgl_tpu/parallel): local follower
processes over gloo produce the greedy output of one device, refusals come before any follower
starts, and no follower outlives its leader (closed engine, killed scheduler, failed start-up).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid

import checkpoints as ck
import numpy as np
import pytest
import requests
from parallel_helpers import descendants, wait_gone
from server_harness import REPO_ROOT, free_port, launch_server

from sgl_tpu import Engine
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.loader import load_model
from sgl_tpu.parallel.head_split import check_tp_size
from sgl_tpu.parallel.leader import FollowerLost
from sgl_tpu.parallel.shard_params import shard_params

SMALL = dict(backend="torch", dtype="float32", max_total_tokens=2048, max_running_requests=4,
             min_token_bucket=16, chunked_prefill_size=64, log_level="warning")
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = ["hello world", "def add(a, b):", "the quick brown"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """4 query / 2 KV heads, untied head (a vocabulary-parallel lm_head of its own)."""
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_tp"), "llama")


def _run(path: str | None, prompts, **kw
         ) -> tuple[list[list[int]], list, list[int], np.ndarray]:
    """(greedy output ids, input log-probs of the first prompt, follower pids while up, the
    prompts' embeddings)."""
    before = set(descendants(os.getpid()))  # e.g. compile workers of earlier tests
    with Engine(path, **{**SMALL, **kw}) as engine:
        followers = sorted(set(descendants(os.getpid())) - before)
        outs = engine.generate(prompts, GREEDY)
        lp = engine.generate(prompts[0], {**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                             logprob_start_len=0, top_logprobs_num=2)
        vectors = np.array([e["embedding"] for e in engine.encode(prompts)])
    return ([o["output_ids"] for o in outs], lp["meta_info"]["input_token_logprobs"],
            followers, vectors)


def test_shards_cover_the_model_and_replicate_kv(tiny):
    loaded = load_model(tiny)
    cfg, lw = loaded.config, loaded.params["layers"][0]
    d = cfg.head_dim
    for tp in (2, 4):
        split = check_tp_size(cfg, tp)
        shards = [shard_params(loaded.params, cfg, split, r) for r in range(tp)]
        local = shards[0][1]
        assert local.num_heads == cfg.num_heads // tp and local.num_kv_heads == 1
        l0 = [s[0]["layers"][0] for s in shards]
        np.testing.assert_array_equal(np.concatenate([x["wq"] for x in l0], 1), lw["wq"])
        np.testing.assert_array_equal(np.concatenate([x["wo"] for x in l0], 0), lw["wo"])
        np.testing.assert_array_equal(np.concatenate([x["w_down"] for x in l0], 0),
                                      lw["w_down"])
        for r, x in enumerate(l0):  # rank r's query heads read KV head (its first head) // 2
            kv = (r * cfg.num_heads // tp) // (cfg.num_heads // cfg.num_kv_heads)
            np.testing.assert_array_equal(x["wk"], lw["wk"][:, kv * d : (kv + 1) * d])
        vocab = np.concatenate([s[0]["lm_head"] for s in shards], 1)
        np.testing.assert_array_equal(vocab[:, : cfg.vocab_size], loaded.params["lm_head"])
        assert not vocab[:, cfg.vocab_size :].any()  # zero padding rows


def test_tiny_model_tp2_and_tp4_match_one_device(tiny):
    ref_ids, ref_lp, _, ref_vectors = _run(tiny, PROMPTS)
    for tp in (2, 4):  # 4: more ranks than KV heads, each KV head on two ranks
        ids, lp, followers, vectors = _run(tiny, PROMPTS, tp_size=tp)
        np.testing.assert_allclose(vectors, ref_vectors, atol=1e-5)  # rank 0's hidden rows
        assert len(followers) == tp - 1
        assert ids == ref_ids, tp
        assert [t for _, t, _ in lp] == [t for _, t, _ in ref_lp]
        np.testing.assert_allclose([v for v, _, _ in lp[1:]], [v for v, _, _ in ref_lp[1:]],
                                   atol=1e-4)
        assert wait_gone(followers) == [], "a follower outlived Engine.shutdown()"


@pytest.mark.parametrize("model, kw, message", [
    (None, {"tp_size": 2}, r"--tp-size 2 does not fit this model's heads \(9 query heads, "
                           r"3 KV heads\).*allows: 1, 3, 9"),
    ("tiny", {"tp_size": 8}, r"4 query heads do not divide by 8"),
    ("tiny", {"tp_size": 2, "torch_compile": "on"}, "runs eagerly"),
    ("tiny", {"tp_size": 2, "quantization": "int8"}, "--quantization int8 with --tp-size > 1"),
    ("tiny", {"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:1"},
     "--tp-size 3 over --nnodes 2: every host runs the same number of torch ranks"),
])
def test_refusals_come_before_any_follower_starts(tiny, model, kw, message):
    before = set(descendants(os.getpid()))
    with pytest.raises(ValueError, match=message):
        Engine(tiny if model == "tiny" else model, **{**SMALL, **kw})
    assert set(descendants(os.getpid())) == before


def test_follower_that_cannot_connect_exits_with_a_clear_error(tmp_path):
    endpoint = f"ipc://{tempfile.gettempdir()}/sgl_tpu-test-{uuid.uuid4().hex[:12]}"
    spec = {"type": "TorchFollowerSpec", "rank": 1, "world_size": 2,
            "leader_endpoint": endpoint, "init_method": "tcp://127.0.0.1:1",
            "model_path": str(tmp_path / "never-loaded"), "server_args": {},
            "parent_pid": os.getpid(), "connect_timeout_s": 1.0}
    proc = subprocess.run([sys.executable, "-m", "sgl_tpu.backends.torch.tp_follower"],
                          input=json.dumps(spec), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"error: rank 1: no leader answered at {endpoint} within 1 s" in proc.stderr
    assert "never-loaded" not in proc.stderr  # it gave up before loading anything


def test_follower_failing_at_start_up_is_reported_and_reaped(tiny, tmp_path):
    from sgl_tpu.backends.torch.tp_launch import start_torch_tp

    before = set(descendants(os.getpid()))
    args = ServerArgs(model_path=tiny, tp_size=2, skip_warmup=True, **SMALL)
    loaded = load_model(tiny)
    cfg = runner_config(args, loaded.config.context_len)
    with pytest.raises(FollowerLost, match=r"follower rank 1 failed: FileNotFoundError: "
                                           r"model path does not exist"):
        start_torch_tp(args, loaded.config, loaded.params, str(tmp_path / "gone"), cfg)
    assert wait_gone(sorted(set(descendants(os.getpid())) - before), 10) == []


@pytest.mark.slow
def test_server_tp3_default_model_matches_tp1_and_dies_with_its_scheduler():
    prompts = ["The capital of France is", "def fibonacci(n):"]
    body = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    server = launch_server("--backend", "torch", "--dtype", "float32", "--tp-size", "3",
                           "--max-total-tokens", "4096", "--max-running-requests", "4",
                           "--chunked-prefill-size", "128", "--min-token-bucket", "16")
    try:
        r = requests.post(server.base_url + "/generate",
                          json={"text": prompts, "sampling_params": body}, timeout=300)
        assert r.status_code == 200, r.text
        texts = [o["text"] for o in r.json()]
        assert server.info()["tp_size"] == 3
        tree = descendants(server.proc.pid)
        scheduler = next(p for p in tree if len(descendants(p)) == 2)  # its two followers
        followers = descendants(scheduler)
        os.kill(scheduler, signal.SIGKILL)  # no clean shutdown: the followers must notice
        assert wait_gone(followers) == [], "a follower outlived its scheduler"
        assert server.proc.wait(timeout=30) != 0  # the launcher reports the dead child
    finally:
        server.stop()
    # one device with the weights the ranks slice: `auto` is `none` under TP (dense float32),
    # while one device's `auto` would take the int8-activation kernels and drift from it
    with Engine(None, **{**SMALL, "max_total_tokens": 4096, "skip_warmup": True,
                         "quantization": "none"}) as engine:
        ref = [o["text"] for o in engine.generate(prompts, body)]
    assert texts == ref


TWO_HOSTS = ("--backend", "torch", "--dtype", "float32", "--max-total-tokens", "1024",
             "--max-running-requests", "2", "--chunked-prefill-size", "32",
             "--min-token-bucket", "16", "--tp-size", "2", "--nnodes", "2")


@pytest.mark.slow
def test_two_hosts_serve_like_one_device_and_end_together(tiny, tmp_path):
    """`--nnodes 2`, simulated with two launches on this machine: host 1 starts its rank and
    no server; host 0 serves; SIGTERM to host 0 ends host 1's rank too."""
    want, _, _, _ = _run(tiny, PROMPTS[:2], skip_warmup=True)
    addr = f"127.0.0.1:{free_port(2)}"
    with open(tmp_path / "host1.log", "wb") as log:
        host1 = subprocess.Popen(
            [sys.executable, "-m", "sgl_tpu.launch_server", "--model-path", tiny, *TWO_HOSTS,
             "--node-rank", "1", "--dist-init-addr", addr], stdout=log,
            stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO_ROOT)
    server = None
    try:
        server = launch_server(*TWO_HOSTS, "--node-rank", "0", "--dist-init-addr", addr,
                               model_path=tiny)
        r = requests.post(server.base_url + "/generate",
                          json={"text": PROMPTS[:2],
                                "sampling_params": GREEDY}, timeout=120)
        assert [o["output_ids"] for o in r.json()] == want
        assert host1.poll() is None
        server.stop()  # SIGTERM to host 0 only
        assert host1.wait(timeout=60) == 0, (tmp_path / "host1.log").read_text()[-2000:]
    finally:
        if server is not None:
            server.stop()
        if host1.poll() is None:
            host1.kill()
            host1.wait()


def test_host_without_leader_names_the_address(tiny):
    port = free_port(2)
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_tpu.launch_server", "--model-path", tiny, *TWO_HOSTS,
         "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "2"],
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 1
    assert f"rank 1: no leader answered at tcp://127.0.0.1:{port + 1} within 2 s" in proc.stderr
