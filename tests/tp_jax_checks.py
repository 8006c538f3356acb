"""Tensor-parallel JAX checks that need several devices, run in a child process by
tests/test_tp_jax.py (the test process's JAX is already initialised with one CPU device):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python tests/tp_jax_checks.py OUT.json [TINY_MODEL_DIR [SMOLLM2_MODEL]]

SMOLLM2_MODEL (default: the default model) is what the "default" check serves; the test module
passes SmolLM2-135M cut to its first layers (checkpoints.truncate_gguf).

Each check records what it observed (ids, log-probs, shapes, error messages) into one JSON
document; the assertions live in the test module.
"""

from __future__ import annotations

import json
import re
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sgl_tpu.backends.jax.forward_batch import build_forward_batch
from sgl_tpu.backends.jax.mesh import HEADS_SPEC, KV_POOL_SPEC, TP_AXIS
from sgl_tpu.backends.jax.runner import sample_inputs
from sgl_tpu.backends.jax.shard_ops import replicated, shard_attention
from sgl_tpu.engine import Engine
from sgl_tpu.executor.attention_registry import get_attention_backend
from sgl_tpu.executor.step import ForwardMode, warmup_step
from sgl_tpu.kernels import paged_attention_ref as ref

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
SMALL = dict(backend="jax", dtype="float32", page_size=4, max_total_tokens=1024,
             max_running_requests=1, max_extend_seqs=1, chunked_prefill_size=32,
             min_token_bucket=32, kv_tile=16, block_q=16)


def _serve(eng: Engine, prompts: list[str]) -> dict:
    """Greedy ids of each prompt (the first alone, so the others hit its cached prefix), the
    first prompt's input log-probs, and the prompts' embeddings."""
    first = eng.generate(prompts[0], GREEDY, return_logprob=True, logprob_start_len=0)
    rest = eng.generate(prompts[1:], GREEDY)
    outs = [first, *rest]
    return {
        "ids": [o["output_ids"] for o in outs],
        "cached": [o["meta_info"]["cached_tokens"] for o in outs],
        "input_logprobs": [lp[0] for lp in first["meta_info"]["input_token_logprobs"][1:]],
        "embeddings": [e["embedding"] for e in eng.encode(prompts)],
    }


def _local_shapes(eng: Engine) -> dict:
    r = eng.scheduler.runner
    layer = r.params["layers"][0]
    shapes = {name: list(layer[name].addressable_shards[0].data.shape)
              for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm")}
    shapes["embed"] = list(r.params["embed"].addressable_shards[0].data.shape)
    shapes["k_pool"] = list(r.kv_pools[0][0].addressable_shards[0].data.shape)
    return shapes


def check_default_model(model_path: str | None = None) -> dict:
    """SmolLM2-135M (or its first layers) at TP 1 and TP 3 (9 query / 3 KV heads): ids,
    log-probs, shards, compilations after warm-up."""
    prefix = "The history of the city begins with a small settlement by the river, where"
    prompts = [prefix + " fishermen", prefix + " the first bridge", prefix + " merchants"]
    base = Engine(model_path, skip_warmup=True, **SMALL)
    out = {"tp1": _serve(base, prompts)}
    base.shutdown()
    eng = Engine(model_path, tp_size=3, **SMALL)
    warm = eng.scheduler.runner.num_compilations()
    out["tp3"] = _serve(eng, prompts)
    out["tp3_compilations"] = [warm, eng.scheduler.runner.num_compilations()]
    out["tp3_shapes"] = _local_shapes(eng)
    out["tp3_devices"] = eng.scheduler.runner.mesh.size
    out["num_layers"] = eng.model_config.num_layers
    eng.shutdown()
    return out


def check_refusals() -> dict:
    """Sizes the heads or the devices do not allow: the message of each refusal."""
    out = {}
    for tp in (2, 9):
        try:
            Engine(None, tp_size=tp, **SMALL)
            out[f"tp{tp}"] = "accepted"
        except ValueError as e:
            out[f"tp{tp}"] = str(e)
    return out


def _decode_collectives(runner) -> dict[str, int]:
    """Collective ops in the compiled decode step and its sampler (one sequence), counted from
    their HLO."""
    steps = [warmup_step()]
    fb = build_forward_batch(steps, runner.batch_shape(ForwardMode.DECODE, steps),
                             runner.config.page_size)
    step = runner._step.lower(runner.params, runner.kv_pools, runner._last_token_ids, fb,
                              mode=ForwardMode.DECODE)
    logits = jax.ShapeDtypeStruct((fb.sample_idx.shape[0], runner.vocab_size), jnp.float32,
                                  sharding=replicated(runner.mesh))
    sampler = runner._sample.lower(logits, runner.token_counts, runner._last_token_ids,
                                   sample_inputs(fb), reset_rows=False)
    hlo = step.compile().as_text() + sampler.compile().as_text()
    ops = re.findall(r" (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
                     r"(?:-start)?\(", hlo)
    return {op: ops.count(op) for op in sorted(set(ops))}


def check_tiny(model_dir: str) -> dict:
    """The tiny checkpoint (4 query / 2 KV heads) at TP 1, 2 and 4 (KV heads replicated)."""
    prompts = ["Hello world! How are", "Hello world! The quick", "Hello world! JSON"]
    out = {}
    for tp in (1, 2, 4):
        eng = Engine(model_dir, tp_size=tp, skip_warmup=True, **SMALL)
        out[f"tp{tp}"] = _serve(eng, prompts)
        out[f"tp{tp}_kv_heads_per_device"] = eng.scheduler.runner.kv_pools[0][0] \
            .addressable_shards[0].data.shape[0]
        if tp == 2:
            out["num_layers"] = eng.model_config.num_layers
            out["tp2_decode_collectives"] = _decode_collectives(eng.scheduler.runner)
        eng.shutdown()
    return out


def check_decode_state(model_dir: str) -> dict:
    """The device-resident decode state (forced on, its debug check on every step) at TP 2:
    the test script of tests/test_jax_decode_state.py on the packing path, then on the state,
    then once more (nothing may compile), with the compilations its grammar-masked steps
    caused in each pass."""
    import numpy as np
    from test_jax_decode_state import GREEDY, SAMPLED, Driver, _runner, _script

    from sgl_tpu.loader import load_model

    loaded = load_model(model_dir)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (3, 3, 7, 7)]
    params = [GREEDY, SAMPLED, SAMPLED, GREEDY]
    runner = _runner(loaded, state=True, tp_size=2)
    state, runner.decode_state = runner.decode_state, None
    ids, masked_compilations = {}, {}
    for name in ("packing", "state", "again"):
        if name == "again":
            compiled = runner.num_compilations()
        d = Driver(runner, prompts, params)
        _script(d)
        ids[name] = [r["ids"] for r in d.reqs]
        masked_compilations[name] = d.masked_compilations
        runner.decode_state = state
    return {"same_ids": ids["packing"] == ids["state"] == ids["again"],
            "rows_copied": state.mirror.rows_copied,
            "compiled_again": runner.num_compilations() - compiled,
            "masked_compilations": masked_compilations,
            "state_spec": str(state.arrays.pages.sharding.spec)}


def check_sharded_pallas() -> dict:
    """The Pallas kernel (TPU interpret mode) under shard_map on 2 devices vs the unsharded
    reference: KV write, extend over cached prefixes, decode."""
    from test_pallas_attention import _batch

    mesh = Mesh(np.asarray(jax.devices()[:2]), (TP_AXIS,))
    sharded = shard_attention(get_attention_backend("pallas-interpret"), mesh)
    rng = np.random.default_rng(0)
    kvh, group, d, ps, num_pages, kv_tile = 4, 2, 64, 16, 24, 32
    pool_shape = (kvh, num_pages, ps, d)
    pools = [jnp.asarray(rng.standard_normal(pool_shape), jnp.float32) for _ in range(2)]
    put = partial(jax.device_put, device=NamedSharding(mesh, KV_POOL_SPEC))
    heads = NamedSharding(mesh, HEADS_SPEC)
    kw = dict(kv_tile=kv_tile, scale=d**-0.5)
    out = {}
    for mode, seqs in ((ForwardMode.EXTEND, [(10, 7), (0, 5), (33, 20)]),
                       (ForwardMode.DECODE, [(37, 1), (0, 1), (70, 1)])):
        fb = _batch(rng, mode, seqs, page_size=ps, kv_tile=kv_tile, block_q=8,
                    num_pages=num_pages)
        t = fb.input_ids.shape[0]
        q = jnp.asarray(rng.standard_normal((t, kvh * group, d)), jnp.float32)
        k_new, v_new = (jnp.asarray(rng.standard_normal((t, kvh, d)), jnp.float32)
                        for _ in range(2))
        if mode == ForwardMode.DECODE:
            batch = (fb.page_table, fb.seq_lens)
            attend, attend_ref = sharded.decode_attention, ref.decode_attention
        else:
            batch = (fb.page_table, fb.block_rows, fb.block_seq, fb.block_q_start,
                     fb.seq_lens, fb.item_block, fb.item_tile, fb.num_items)
            attend, attend_ref = sharded.extend_attention, ref.extend_attention

        def step(k_pool, v_pool, q, k_new, v_new, slots, batch, attend=attend, write=None):
            k_pool, v_pool = (write or sharded.write_kv)(k_pool, v_pool, k_new, v_new, slots)
            return attend(q, k_pool, v_pool, *batch, **kw), k_pool, v_pool

        got = jax.jit(step)(put(pools[0]), put(pools[1]), jax.device_put(q, heads),
                            jax.device_put(k_new, heads), jax.device_put(v_new, heads),
                            fb.out_slots, batch)
        want = jax.jit(partial(step, attend=attend_ref, write=ref.write_kv))(
            pools[0], pools[1], q, k_new, v_new, fb.out_slots, batch)
        rows = sum(new for _, new in seqs)
        out[mode.name.lower()] = {
            "max_abs_diff": float(np.abs(np.asarray(got[0][:rows]) - np.asarray(want[0][:rows]))
                                  .max()),
            "pools_equal": bool(all(np.array_equal(np.asarray(a), np.asarray(b))
                                    for a, b in zip(got[1:], want[1:], strict=True))),
            "out_sharding": str(got[0].sharding.spec),
        }
    return out


def main() -> None:
    out_path = sys.argv[1]
    checks = {"pallas": check_sharded_pallas, "refusals": check_refusals,
              "default": partial(check_default_model, *sys.argv[3:4])}
    if len(sys.argv) > 2:
        checks["tiny"] = partial(check_tiny, sys.argv[2])
        checks["decode_state"] = partial(check_decode_state, sys.argv[2])
    result: dict = {"devices": jax.device_count(), "seconds": {}}
    for name, check in checks.items():
        t0 = time.perf_counter()
        result[name] = check()
        result["seconds"][name] = round(time.perf_counter() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
