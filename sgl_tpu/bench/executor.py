"""Executor micro-benchmark: prefill and decode throughput of the model runners, per backend
and dtype.

    python -m sgl_tpu.bench.executor [--backends torch,jax] [--dtypes float32,bfloat16]
        [--prefill 128,512,2048] [--decode-batches 1,8,32,64] [--context 256] [--repeats 3]
        [--torch-compile auto|on|off] [--sampling greedy,sampled] [--baseline-sampler FILE]

Runs the real step (paged KV, bucketed shapes, sampler) of each backend on the default model
(or `--model-path`), compiles each shape once before timing, reports the best of `--repeats`
runs, and prints one JSON object. Compare backends/dtypes/sizes as ratios within one run: the
machine is shared. `--sampling` lists the decode modes: `greedy` (temperature 0) and `sampled`
(temperature 0.7, top-p 0.9, a seed per sequence; no log-probs asked); with both, their decode
steps alternate (ABAB...) and each sampled row reports its median step time over the greedy one.
`--baseline-sampler FILE` (torch) times the same steps with another sampler module in the same
alternation, for before/after ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial

import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import best, interleaved

SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9)}


def _steps(n_seqs: int, n_new: int, prefix: int, page_size: int, rng, vocab: int,
           sampling: str = "greedy"):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    params = SamplingParams(**SAMPLING[sampling])
    pages_per_seq = -(-(prefix + n_new) // page_size)
    steps = []
    for i in range(n_seqs):
        pages = np.arange(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq, dtype=np.int32)
        steps.append(SeqStep(token_ids=rng.integers(0, vocab, n_new), prefix_len=prefix,
                             pages=pages, sampling=params, seed=i, num_output_tokens=0,
                             return_logprob=False))
    return steps


def run(args: argparse.Namespace) -> dict:
    import jax

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    max_tokens = max(prefills + [1])
    pool_tokens = max(max_tokens, max(batches + [1]) * (args.context + 16)) + 64
    rng = np.random.default_rng(0)
    results: dict = {"model": loaded.model_path, "jax_platform": jax.default_backend(),
                     "context_for_decode": args.context, "cpu_count": os.cpu_count(),
                     "runs": []}
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            sargs = ServerArgs(model_path=args.model_path, dtype=dtype, skip_warmup=True,
                               max_total_tokens=pool_tokens, chunked_prefill_size=max_tokens,
                               max_running_requests=max(batches + [1]), max_extend_seqs=1,
                               backend=backend, torch_compile=args.torch_compile)
            rcfg = runner_config(sargs, cfg.context_len)
            runner = create_model_runner(cfg, loaded.params, rcfg)
            tag = {"backend": rcfg.backend, "dtype": dtype}
            if rcfg.backend == "torch":
                tag["compile"] = rcfg.compile
            ps = sargs.page_size
            for n in prefills:
                steps = _steps(1, n, 0, ps, rng, cfg.vocab_size)
                t = best(partial(runner.forward, ForwardMode.EXTEND, steps), args.repeats)
                results["runs"].append({**tag, "phase": "prefill", "tokens": n,
                                        "seconds": round(t, 4), "tok_per_s": round(n / t, 1)})
                print(json.dumps(results["runs"][-1]), flush=True)
            modes = args.sampling.split(",")
            samplers = _samplers(args.baseline_sampler if rcfg.backend == "torch" else None)
            for b in batches:
                tokens = rng.integers(0, cfg.vocab_size, b)  # the same inputs in every mode
                fns = {}
                for mode in modes:
                    steps = _steps(b, 1, args.context, ps, rng, cfg.vocab_size, mode)
                    for st, tok in zip(steps, tokens, strict=True):
                        st.token_ids = [int(tok)]
                    for name, use in samplers.items():
                        fns[name + mode] = partial(use, runner.forward, ForwardMode.DECODE, steps)
                times = interleaved(fns, args.repeats)
                for name in samplers:
                    for mode in modes:
                        key, first = name + mode, name + modes[0]
                        t, med = min(times[key]), statistics.median(times[key])
                        row = {**tag, "phase": "decode", "batch": b, "context": args.context,
                               "sampler": name.rstrip("-") or "current", "sampling": mode,
                               "step_ms": round(1e3 * t, 2), "median_ms": round(1e3 * med, 2),
                               "tok_per_s": round(b / t, 1)}
                        if mode != modes[0]:
                            row[f"median_over_{modes[0]}"] = round(
                                med / statistics.median(times[first]), 3)
                        if name:
                            row["median_over_current"] = round(
                                med / statistics.median(times[mode]), 3)
                        results["runs"].append(row)
                        print(json.dumps(row), flush=True)
    return results


def _samplers(baseline: str | None) -> dict:
    """{name prefix: call(fn, *args)}: the current torch sampler, and with `baseline` (a
    sampler module file with the same `sample`) one that runs `fn` with that module swapped
    into the torch runner."""
    out = {"": lambda fn, *a: fn(*a)}
    if baseline is None:
        return out
    import inspect
    import types

    from sgl_tpu.bench.sampler import load_sampler
    from sgl_tpu.executor.torch import runner as torch_runner

    current, module = torch_runner.sampler, load_sampler(baseline)
    accepted = inspect.signature(module.sample).parameters

    def sample(*a, **kw):
        return module.sample(*a, **{k: v for k, v in kw.items() if k in accepted})

    shim = types.SimpleNamespace(row_uniforms=module.row_uniforms, sample=sample)

    def with_baseline(fn, *a):
        torch_runner.sampler = shim
        try:
            return fn(*a)
        finally:
            torch_runner.sampler = current

    out["baseline-"] = with_baseline
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--torch-compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--prefill", default="128,512,2048")
    p.add_argument("--decode-batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampling", default="greedy",
                   help="decode modes, comma list of " + "/".join(SAMPLING))
    p.add_argument("--baseline-sampler", default=None,
                   help="torch: another sampler module file (e.g. an older version) whose "
                        "decode steps are timed in the same run (rows with sampler=baseline)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    results = run(args)
    emit(results, args.output)


if __name__ == "__main__":
    main()
