"""Mixture-of-experts throughput against dense models of the same active and of the same total
parameters (tiny random configs, no files), per executor backend.

    python -m sgl_tpu.bench.moe [--backends torch,jax] [--experts 8] [--top-k 2]
        [--expert-width 256] [--hidden 256] [--layers 4] [--prefill 512]
        [--decode-batches 1,8,32] [--context 128] [--threads 2] [--repeats 3] [--output F]

Three models share attention, embeddings and depth and differ in the MLP:

    moe           E experts of width f, each token routed to k          (mixtral layout)
    dense_active  one SwiGLU of width k * f: the MoE's active parameters (llama layout)
    dense_total   one SwiGLU of width E * f: the MoE's total parameters

Each runs the real runner step (paged KV, buckets, greedy sampler) for a prefill of
`--prefill` tokens and decode steps at each batch over `--context` cached tokens; best of
`--repeats`. A second section times one layer's expert MLP alone in JAX: the `tiled` dispatch
(the CPU default) and `ragged_dot` (native on TPU/GPU, a dense fallback on CPU) against the
dense SwiGLUs. Compare as ratios within one run (shared machines).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import numpy as np

from sgl_tpu.bench.executor import _steps
from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import best, interleaved


def _configs(args: argparse.Namespace) -> dict:
    from sgl_tpu.models.config import ModelConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                  num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4, rope_theta=1e4,
                  rms_norm_eps=1e-5, context_len=4096, tie_word_embeddings=False)
    e, k, f = args.experts, args.top_k, args.expert_width
    return {
        "moe": ModelConfig(arch="mixtral", intermediate_size=f, num_experts=e,
                           num_experts_per_tok=k, moe_intermediate_size=f, **common),
        "dense_active": ModelConfig(arch="llama", intermediate_size=k * f, **common),
        "dense_total": ModelConfig(arch="llama", intermediate_size=e * f, **common),
    }


def random_params(cfg, seed: int = 0) -> dict:
    """Canonical float32 params of `cfg` (loader/loaded.py shapes), scaled like an init."""
    from sgl_tpu.loader.loaded import check_params, expected_param_shapes

    rng = np.random.default_rng(seed)
    top, layer = expected_param_shapes(cfg)

    def make(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name.endswith("norm"):
            return np.ones(shape, np.float32)
        fan_in = shape[-2] if len(shape) >= 2 else shape[0]
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    params = {n: make(n, s) for n, s in top.items()}
    params["layers"] = [{n: make(n, s) for n, s in layer.items()} for _ in range(cfg.num_layers)]
    check_params(cfg, params, "bench")
    return params


def _params_per_token(cfg) -> dict:
    mlp = 3 * cfg.hidden_size
    if cfg.num_experts:
        return {"mlp_active": mlp * cfg.moe_intermediate_size * cfg.num_experts_per_tok,
                "mlp_total": mlp * cfg.moe_intermediate_size * cfg.num_experts}
    return {"mlp_active": mlp * cfg.intermediate_size, "mlp_total": mlp * cfg.intermediate_size}


def _runner_rows(args: argparse.Namespace, configs: dict) -> list[dict]:
    """Runner steps of the three models, interleaved (ABCABC...) so that load on a shared
    machine hits them alike; best of `--repeats` rounds."""
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode

    batches = [int(x) for x in args.decode_batches.split(",") if x]
    pool = max(args.prefill, max(batches) * (args.context + 16)) + 64
    rows = []
    for backend in args.backends.split(","):
        sargs = ServerArgs(dtype="float32", skip_warmup=True, max_total_tokens=pool,
                           chunked_prefill_size=args.prefill, max_extend_seqs=1,
                           max_running_requests=max(batches), backend=backend,
                           torch_threads=args.threads, torch_compile="off")
        runners = {name: create_model_runner(cfg, random_params(cfg), runner_config(sargs, 4096))
                   for name, cfg in configs.items()}
        ps, vocab = sargs.page_size, args.vocab
        rng = np.random.default_rng(0)
        phases = [("prefill", None, ForwardMode.EXTEND, _steps(1, args.prefill, 0, ps, rng, vocab))]
        phases += [("decode", b, ForwardMode.DECODE, _steps(b, 1, args.context, ps, rng, vocab))
                   for b in batches]
        for phase, batch, mode, steps in phases:
            times = interleaved({name: partial(r.forward, mode, steps)
                                 for name, r in runners.items()}, args.repeats)
            for name, cfg in configs.items():
                t = min(times[name])
                row = {"backend": backend, "model": name, **_params_per_token(cfg),
                       "phase": phase}
                if batch is None:
                    row.update(tokens=args.prefill, tok_per_s=round(args.prefill / t, 1))
                else:
                    row.update(batch=batch, context=args.context, step_ms=round(1e3 * t, 2),
                               tok_per_s=round(batch / t, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _layer_rows(args: argparse.Namespace, configs: dict) -> list[dict]:
    """One layer's MLP alone in JAX: the two grouped-expert implementations and the dense
    SwiGLUs, at a decode-sized and a prefill-sized token count."""
    import jax

    from sgl_tpu.models import llama, moe

    rows = []
    layers = {name: random_params(cfg)["layers"][0] for name, cfg in configs.items()}
    for num_tokens in (8, args.prefill):
        x = np.random.default_rng(1).standard_normal((num_tokens, args.hidden)).astype(
            np.float32)
        fns = {f"moe_{impl}": jax.jit(partial(moe.moe_mlp, cfg=configs["moe"], impl=impl))
               for impl in moe.GROUPED_IMPLS}
        for name in ("dense_active", "dense_total"):
            fns[name] = jax.jit(partial(llama.dense_mlp, cfg=configs[name]))
        for name, fn in fns.items():
            layer = layers["moe" if name.startswith("moe") else name]
            t = best(lambda fn=fn, x=x, layer=layer: jax.block_until_ready(fn(x, layer)),
                     args.repeats * 3)
            rows.append({"backend": "jax", "phase": "mlp_layer", "mlp": name,
                         "tokens": num_tokens, "us": round(1e6 * t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args: argparse.Namespace) -> dict:
    import jax
    import torch

    torch.set_num_threads(args.threads)
    configs = _configs(args)
    t0 = time.perf_counter()
    results = {"jax_platform": jax.default_backend(), "cpu_count": os.cpu_count(),
               "threads": args.threads, "experts": args.experts, "top_k": args.top_k,
               "expert_width": args.expert_width, "hidden": args.hidden, "layers": args.layers,
               "runs": _runner_rows(args, configs)}
    if "jax" in args.backends.split(","):
        results["runs"] += _layer_rows(args, configs)
    results["ratios"] = _ratios(results["runs"])
    results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


def _ratios(rows: list[dict]) -> list[dict]:
    """tok/s of the MoE over each dense model, per backend and phase/batch."""
    out = []
    keyed = {(r["backend"], r["phase"], r.get("batch"), r["model"]): r["tok_per_s"]
             for r in rows if "model" in r}
    for (backend, phase, batch, model), tps in keyed.items():
        if model != "moe":
            continue
        row = {"backend": backend, "phase": phase, "batch": batch}
        for dense in ("dense_active", "dense_total"):
            row[f"moe_over_{dense}"] = round(tps / keyed[(backend, phase, batch, dense)], 3)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
