"""Executor steps per `--quantization`, A/B: the same prefill and decode steps on one runner per
mode (torch backend), the runners interleaved A B A B ... in each round.

    python -m sgl_tpu.bench.quant_executor [--quantizations none,gguf] [--dtype bfloat16]
        [--prefill 512] [--decode-batches 1,4,8,32] [--context 256] [--repeats 15]
        [--kernel-max-rows N] [--baseline-source OLD.cpp] [--shared 0]

Prints one JSON object: per workload and mode the min and median step time and `min_vs_first`
/ `median_vs_first` (ratios to the first mode). `--kernel-max-rows` overrides the kernels' row
limit (`MAX_KERNEL_ROWS` in executor/torch/quant_linear.py): with a large value the kernel runs
at every batch size, which is how the crossover is measured. With `--dtype float32` (CPUs
without AMX) `gguf` runs the compiled float32 block kernels (kernels/quant_gemm_cpu.py),
head included, and `gguf-a8` their int8-activation forms. `--baseline-source OLD.cpp` (float32)
compiles another kernels/csrc/quant_gemm_cpu.cpp and adds a "<mode>-baseline" entry per mode:
the same runner's steps with that build's kernels. `--shared N`: the decode sequences fork
one N-token prefix (the first N of their `--context` tokens, the same KV pages), as agents do.
The machine is shared: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from sgl_tpu.bench.executor import _steps
from sgl_tpu.bench.quant_linear import build_baseline
from sgl_tpu.bench.report import emit, model_label
from sgl_tpu.bench.timing import interleaved, ratio_rows


def _with_kernels(ext, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with kernels/quant_gemm_cpu.py's compiled module replaced by `ext`."""
    from sgl_tpu.kernels import quant_gemm_cpu

    def run() -> object:
        saved = quant_gemm_cpu._kernel
        quant_gemm_cpu._kernel = lambda: ext
        try:
            return fn()
        finally:
            quant_gemm_cpu._kernel = saved

    return run


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    if args.kernel_max_rows is not None:
        from sgl_tpu.executor.torch import quant_linear

        for kind in quant_linear.MAX_KERNEL_ROWS:
            quant_linear.MAX_KERNEL_ROWS[kind] = args.kernel_max_rows
        quant_linear.AVX512_F32_MAX_ROWS = args.kernel_max_rows
    baseline, _build_dir = build_baseline(args.baseline_source, args.dtype)
    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    max_tokens = max(prefills + [1])
    pool_tokens = max(max_tokens, max(batches + [1]) * (args.context + 16)) + 64
    runners = {}
    for quant in args.quantizations.split(","):
        sargs = ServerArgs(model_path=args.model_path, dtype=args.dtype, skip_warmup=True,
                           max_total_tokens=pool_tokens, chunked_prefill_size=max_tokens,
                           max_running_requests=max(batches + [1]), max_extend_seqs=1,
                           backend="torch", quantization=quant)
        runner = create_model_runner(cfg, loaded.params, runner_config(sargs, cfg.context_len))
        report = runner.quantization  # what "auto" became
        runners[report.method if report else "none"] = runner
    results: dict = {"model": model_label(loaded.model_path), "dtype": args.dtype,
                     "cpu_count": os.cpu_count(),
                     "context_for_decode": args.context, "shared_prefix": args.shared,
                     "repeats": args.repeats,
                     "kernel_max_rows": args.kernel_max_rows,
                     "baseline_source": Path(args.baseline_source).name if baseline else None,
                     "runs": []}
    rng = np.random.default_rng(0)
    page_size = ServerArgs.page_size

    def record(phase: dict, fns: dict, per_step: int) -> None:
        times = interleaved(fns, args.repeats)
        for mode, stats in ratio_rows(times, next(iter(times)), "first").items():
            row = {"quantization": mode, **phase, **stats,
                   "tok_per_s": round(per_step / min(times[mode]), 1)}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)

    def step_fns(mode: ForwardMode, steps: list) -> dict:
        fns = {m: partial(r.forward, mode, steps) for m, r in runners.items()}
        if baseline is not None:
            fns.update({f"{m}-baseline": _with_kernels(baseline, fn)
                        for m, fn in list(fns.items()) if m != "none"})
        return fns

    for n in prefills:
        steps = _steps(1, n, 0, page_size, rng, cfg.vocab_size)
        record({"phase": "prefill", "tokens": n}, step_fns(ForwardMode.EXTEND, steps), n)
    for b in batches:
        steps = _steps(b, 1, args.context, page_size, rng, cfg.vocab_size,
                       shared=args.shared)
        record({"phase": "decode", "batch": b, "context": args.context, "shared": args.shared},
               step_fns(ForwardMode.DECODE, steps), b)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--quantizations", default="none,gguf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefill", default="512")
    p.add_argument("--decode-batches", default="1,4,8,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--shared", type=int, default=0,
                   help="decode: tokens of --context every sequence shares (whole pages)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kernel-max-rows", type=int, default=None,
                   help="override the quantized kernels' row limit (crossover experiments)")
    p.add_argument("--baseline-source", default=None,
                   help="another csrc/quant_gemm_cpu.cpp, its kernels timed in the same steps "
                        "(float32)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
