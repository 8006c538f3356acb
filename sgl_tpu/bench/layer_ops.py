"""Decode steps of two torch runners A/B, otherwise identical, interleaved A B A B ... in each
round on the same steps: `--compare layer-ops` (default) the fused CPU layer ops off / on
(`RunnerConfig.cpu_layer_ops`), `--compare kv-cache-dtype` the KV pool in the model's dtype /
in bfloat16 (`--kv-cache-dtype`; with --dtypes float32 this halves the pool's bytes),
`--compare kv-fp8` bfloat16 / fp8 e5m2 pools (`--kv-cache-dtype fp8_e5m2`: half again).

    python -m sgl_tpu.bench.layer_ops [--compare layer-ops|kv-cache-dtype|kv-fp8]
        [--dtypes float32] [--quantization gguf] [--decode-batches 1,8] [--contexts 256,1300]
        [--shared 0] [--prefill 512] [--repeats 15]

`--shared N`: the decode sequences share their first N context tokens' pages (agents forking
one prompt; whole pages, at most the context).

Prints one JSON object: per dtype, workload and mode the min and median step time and the
B runner's `median_vs_<A>` / `min_vs_<A>` (A: torch_ops or kv_auto); per dtype the aten ops
one batch-1 decode step dispatches in each mode (torch profiler, `aten::` events counted,
nested ones included). The ops are CPU-only and built by `make install`
(kernels/layer_ops_cpu.py). The machine is shared: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from functools import partial

import numpy as np

from sgl_tpu.bench.executor import _steps
from sgl_tpu.bench.report import emit, model_label
from sgl_tpu.bench.timing import interleaved, ratio_rows

# --compare: mode name -> the RunnerConfig fields it changes; the first mode is the baseline
COMPARISONS = {
    "layer-ops": {"torch_ops": {"cpu_layer_ops": False}, "fused": {"cpu_layer_ops": True}},
    "kv-cache-dtype": {"kv_auto": {"kv_cache_dtype": "auto"},
                       "kv_bfloat16": {"kv_cache_dtype": "bfloat16"}},
    "kv-fp8": {"kv_bfloat16": {"kv_cache_dtype": "bfloat16"},
               "kv_fp8_e5m2": {"kv_cache_dtype": "float8_e5m2"}},
}


def _aten_ops_per_step(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.kernels import layer_ops_cpu
    from sgl_tpu.loader import load_model

    if layer_ops_cpu.load() is None:
        raise SystemExit(f"fused layer ops: {layer_ops_cpu.why_unavailable()}")
    loaded = load_model(args.model_path)
    cfg = loaded.config
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    max_tokens = max(prefills + [16])
    pool_tokens = max(max_tokens, max(batches) * (max(contexts) + 16)) + 64
    page_size = ServerArgs.page_size
    modes = COMPARISONS[args.compare]
    baseline = next(iter(modes))
    results: dict = {"model": model_label(loaded.model_path), "quantization": args.quantization,
                     "compare": args.compare,
                     "cpu_count": os.cpu_count(), "repeats": args.repeats,
                     "command": "python -m sgl_tpu.bench.layer_ops " + " ".join(sys.argv[1:]),
                     "aten_ops_per_decode_step_b1": {}, "runs": []}
    for dtype in args.dtypes.split(","):
        sargs = ServerArgs(model_path=args.model_path, dtype=dtype, skip_warmup=True,
                           max_total_tokens=pool_tokens, chunked_prefill_size=max_tokens,
                           max_running_requests=max(batches), max_extend_seqs=1,
                           backend="torch", torch_compile="off",
                           quantization=args.quantization)
        base = runner_config(sargs, cfg.context_len)
        runners = {m: create_model_runner(cfg, loaded.params,
                                          dataclasses.replace(base, **fields))
                   for m, fields in modes.items()}
        for m, r in runners.items():
            if r.layer_ops != modes[m].get("cpu_layer_ops", True):
                raise SystemExit(f"{dtype}: the model did not take the fused layer ops")
        rng = np.random.default_rng(0)

        def record(phase: dict, steps, mode: ForwardMode, runners=runners) -> None:
            times = interleaved({m: partial(r.forward, mode, steps) for m, r in runners.items()},
                                args.repeats)
            for m, stats in ratio_rows(times, baseline, baseline).items():
                row = {**phase, "mode": m, **stats}
                results["runs"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)

        for ctx in contexts:
            for b in batches:
                shared = min(args.shared, ctx) // page_size * page_size
                steps = _steps(b, 1, ctx, page_size, rng, cfg.vocab_size, shared=shared)
                if b == 1 and ctx == contexts[0]:
                    results["aten_ops_per_decode_step_b1"][dtype] = {
                        m: _aten_ops_per_step(partial(r.forward, ForwardMode.DECODE, steps))
                        for m, r in runners.items()}
                record({"dtype": dtype, "phase": "decode", "batch": b, "context": ctx,
                        "shared": shared}, steps, ForwardMode.DECODE)
        for n in prefills:
            record({"dtype": dtype, "phase": "prefill", "tokens": n},
                   _steps(1, n, 0, page_size, rng, cfg.vocab_size), ForwardMode.EXTEND)
        del runners
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--compare", choices=tuple(COMPARISONS), default="layer-ops")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--contexts", default="256,1300")
    p.add_argument("--shared", type=int, default=0,
                   help="context tokens whose pages all decode sequences share")
    p.add_argument("--prefill", default="512")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
