"""Executor micro-benchmark: prefill and decode throughput of the model runners, per backend
and dtype.

    python -m sgl_tpu.bench.executor [--backends torch,jax] [--dtypes float32,bfloat16]
        [--quantizations none,gguf] [--prefill 128,512,2048] [--decode-batches 1,8,32,64]
        [--context 256] [--repeats 3] [--torch-compile auto|on|off] [--kernel-max-rows N]

Runs the real step (paged KV, bucketed shapes, sampler) of each configuration (backend x dtype x
quantization) on the default model (or `--model-path`), compiles each shape once before timing,
runs the configurations interleaved for `--repeats` rounds per workload, and prints one JSON
object with the min and median per configuration and `min_vs_first` (the ratio to the first
configuration). Compare as ratios within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import numpy as np

from sgl_tpu.bench.report import emit


def _steps(n_seqs: int, n_new: int, prefix: int, page_size: int, rng, vocab: int):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    pages_per_seq = -(-(prefix + n_new) // page_size)
    steps = []
    for i in range(n_seqs):
        pages = np.arange(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq, dtype=np.int32)
        steps.append(SeqStep(token_ids=rng.integers(0, vocab, n_new), prefix_len=prefix,
                             pages=pages, sampling=greedy, seed=0, num_output_tokens=0))
    return steps


def _interleaved(fns: list, repeats: int) -> list[list[float]]:
    """Seconds of each fn over `repeats` rounds, run A B C A B C ... (the machine is shared, so
    configurations compared as ratios must see the same load)."""
    for fn in fns:
        fn()  # compile + warm
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> dict:
    import jax

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    if args.kernel_max_rows is not None:  # crossover experiments (quant_linear.py)
        from sgl_tpu.executor.torch import quant_linear

        for kind in quant_linear.MAX_KERNEL_ROWS:
            quant_linear.MAX_KERNEL_ROWS[kind] = args.kernel_max_rows
    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    max_tokens = max(prefills + [1])
    pool_tokens = max(max_tokens, max(batches + [1]) * (args.context + 16)) + 64
    rng = np.random.default_rng(0)
    results: dict = {"model": loaded.model_path, "jax_platform": jax.default_backend(),
                     "context_for_decode": args.context, "cpu_count": os.cpu_count(),
                     "repeats": args.repeats, "timing": "min and median over interleaved "
                     "repeats", "runs": []}
    runners, tags = [], []
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            for quant in args.quantizations.split(","):
                sargs = ServerArgs(model_path=args.model_path, dtype=dtype, skip_warmup=True,
                                   max_total_tokens=pool_tokens,
                                   chunked_prefill_size=max_tokens,
                                   max_running_requests=max(batches + [1]), max_extend_seqs=1,
                                   backend=backend, torch_compile=args.torch_compile,
                                   quantization=quant)
                rcfg = runner_config(sargs, cfg.context_len)
                runner = create_model_runner(cfg, loaded.params, rcfg)
                runners.append(runner)
                report = getattr(runner, "quantization", None)  # torch: what "auto" became
                tag = {"backend": rcfg.backend, "dtype": dtype,
                       "quantization": report.method if report else
                       rcfg.quantization.replace("auto", "none")}
                if rcfg.backend == "torch":
                    tag["compile"] = rcfg.compile
                tags.append(tag)
    ps = ServerArgs.page_size  # the default, which every runner above uses

    def record(phase: dict, times: list[list[float]], per_s: int) -> None:
        base = min(times[0])
        for tag, t in zip(tags, times, strict=True):
            best, med = min(t), float(np.median(t))
            run = {**tag, **phase, "ms_min": round(1e3 * best, 2),
                   "ms_median": round(1e3 * med, 2), "tok_per_s": round(per_s / best, 1),
                   "min_vs_first": round(best / base, 3)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)

    for n in prefills:
        steps = _steps(1, n, 0, ps, rng, cfg.vocab_size)
        fns = [partial(r.forward, ForwardMode.EXTEND, steps) for r in runners]
        record({"phase": "prefill", "tokens": n}, _interleaved(fns, args.repeats), n)
    for b in batches:
        steps = _steps(b, 1, args.context, ps, rng, cfg.vocab_size)
        fns = [partial(r.forward, ForwardMode.DECODE, steps) for r in runners]
        record({"phase": "decode", "batch": b, "context": args.context},
               _interleaved(fns, args.repeats), b)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--torch-compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--quantizations", default="auto",
                   help="comma-separated --quantization values to compare (e.g. none,gguf; "
                        "auto: what the server would use)")
    p.add_argument("--kernel-max-rows", type=int, default=None,
                   help="override the quantized kernels' row limit (crossover experiments)")
    p.add_argument("--prefill", default="128,512,2048")
    p.add_argument("--decode-batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    results = run(args)
    emit(results, args.output)


if __name__ == "__main__":
    main()
