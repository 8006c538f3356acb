"""Tensor parallelism on the JAX executor (`--tp-size`), on 4 forced host CPU devices.

The checks run in one child process (tests/tp_jax_checks.py) because this process's JAX is
already initialised with a single device; the assertions are here:

- SmolLM2-135M (9 query / 3 KV heads) at TP 3: greedy ids identical to TP 1 on prompts that
  share a prefix (the later ones hit the cache through the sharded pool), prompt log-probs
  within 1e-4, the local shard shapes, no compilation after warm-up. Its first
  SMOLLM2_LAYERS layers only (its GGUF cut by checkpoints.truncate_gguf: real weights,
  vocabulary and head counts): every layer is sharded alike, and the depth sets the compile
  and step time (the check takes 60 CPU s at 4 layers, 125 at 30).
  tests/test_tensor_parallel_torch.py serves the whole model at TP 3;
- head-count and device-count refusals, with messages naming the numbers;
- the tiny checkpoint (4 query / 2 KV heads) at TP 2 and TP 4 (KV heads replicated) identical
  to TP 1;
- the Pallas kernel in TPU interpret mode under shard_map equals the unsharded reference
  (KV write, extend over cached prefixes, decode);
- the device-resident decode state at TP 2 (replicated) equals the packing path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu.loader import default_model_path

HERE = Path(__file__).parent
NUM_DEVICES = 4
SMOLLM2_LAYERS = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    tiny = ck.make_tiny_hf_checkpoint(tmp / "llama", "llama")
    smol = ck.truncate_gguf(default_model_path(), tmp / "smollm2_cut.gguf", SMOLLM2_LAYERS)
    out = tmp / "results.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={NUM_DEVICES}"}
    proc = subprocess.run([sys.executable, str(HERE / "tp_jax_checks.py"), str(out), str(tiny),
                           smol], env=env, cwd=HERE, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_default_model_tp3_equals_tp1(results):
    r = results["default"]
    assert r["tp3_devices"] == 3 and r["num_layers"] == SMOLLM2_LAYERS
    assert r["tp3"]["ids"] == r["tp1"]["ids"]
    assert all(len(ids) == 12 for ids in r["tp3"]["ids"])
    assert min(r["tp3"]["cached"][1:]) > 0, "later prompts must hit the shared prefix"
    lp1, lp3 = np.array(r["tp1"]["input_logprobs"]), np.array(r["tp3"]["input_logprobs"])
    assert lp1.shape == lp3.shape and len(lp1) > 10
    np.testing.assert_allclose(lp3, lp1, atol=1e-4, rtol=0)
    np.testing.assert_allclose(r["tp3"]["embeddings"], r["tp1"]["embeddings"], atol=1e-5)


def test_default_model_tp3_local_shards(results):
    # hidden 576, 9 heads x 64, 3 KV heads x 64, FFN 1536, vocab 49152: a third of each split
    # axis per device; norms whole.
    s = results["default"]["tp3_shapes"]
    assert s["wq"] == [576, 192] and s["wk"] == [576, 64] and s["wv"] == [576, 64]
    assert s["wo"] == [192, 576]
    assert s["w_gate"] == [576, 512] and s["w_up"] == [576, 512] and s["w_down"] == [512, 576]
    assert s["embed"] == [16384, 576] and s["attn_norm"] == [576]
    assert s["k_pool"][0] == 1 and s["k_pool"][2:] == [4, 64]


def test_no_compilation_after_warmup(results):
    warm, after = results["default"]["tp3_compilations"]
    assert warm > 0 and after == warm


def test_refusals_name_the_numbers(results):
    r = results["refusals"]
    assert "9 query heads, 3 KV heads" in r["tp2"] and "allows: 1, 3, 9" in r["tp2"]
    # 9 fits the heads but not the devices
    assert f"--tp-size 9 needs 9 devices, but JAX sees {NUM_DEVICES} cpu" in r["tp9"]


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_checkpoint_tp_equals_tp1(results, tp):
    r = results["tiny"]
    assert r[f"tp{tp}"]["ids"] == r["tp1"]["ids"]
    np.testing.assert_allclose(r[f"tp{tp}"]["input_logprobs"], r["tp1"]["input_logprobs"],
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(r[f"tp{tp}"]["embeddings"], r["tp1"]["embeddings"], atol=1e-5)
    # 2 KV heads: one per device at TP 2, and at TP 4 each head stored twice, one per device.
    assert r[f"tp{tp}_kv_heads_per_device"] == 1


def test_decode_step_moves_only_activations(results):
    """The compiled TP 2 decode step's collectives (its model part and its sampler): one
    all-reduce of [S, D] after the embedding and after each layer's o- and down-projection,
    one all-gather of the logits; no weight or KV is ever moved between devices."""
    r = results["tiny"]
    assert r["tp2_decode_collectives"] == {"all-gather": 1,
                                           "all-reduce": 2 * r["num_layers"] + 1}


def test_decode_state_at_tp2(results):
    """The device-resident decode state, replicated, gives the packing path's tokens at TP 2
    (its check on every step) and compiles nothing on a second pass; a step with a grammar
    mask reuses the program of the maskless steps of its shape (its mask placed as theirs,
    replicated, not compiled again mid-traffic)."""
    r = results["decode_state"]
    assert r["same_ids"] and r["rows_copied"] > 0
    assert r["compiled_again"] == 0
    assert r["masked_compilations"] == {"packing": 0, "state": 0, "again": 0}
    assert r["state_spec"] in ("P()", "PartitionSpec()")  # replicated (by JAX version)


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_sharded_pallas_equals_reference(results, mode):
    r = results["pallas"][mode]
    assert r["pools_equal"], "the sharded KV write must write exactly the reference's slots"
    assert r["max_abs_diff"] < 1e-5
    assert "tp" in r["out_sharding"]


def test_server_refuses_tp_size_before_starting_processes():
    """`launch_server --tp-size 2` on the default model: one error line, exit 1, before the
    scheduler process (which would load the weights) is started."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "sgl_tpu.launch_server", "--backend", "jax",
                           "--tp-size", "2"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert "error: --tp-size 2 does not fit this model's heads (9 query heads, 3 KV heads)" \
        in proc.stderr
    assert "scheduler" not in proc.stderr
