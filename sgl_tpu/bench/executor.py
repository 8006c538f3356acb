"""Executor micro-benchmark: prefill and decode throughput of the model runners, per backend
and dtype.

    python -m sgl_tpu.bench.executor [--backends torch,jax] [--dtypes float32,bfloat16]
        [--prefill 128,512,2048] [--decode-batches 1,8,32,64] [--context 256] [--repeats 3]
        [--torch-compile auto|on|off] [--sampling greedy,sampled] [--baseline-sampler FILE]
        [--torch-decode-paths packing,static] [--count-calls] [--torch-profile]
        [--attention-backend auto|ref|gathered|torch-sdpa|torch-cpu-fused|...]

Runs the real step (paged KV, bucketed shapes, sampler) of each backend on the default model
(or `--model-path`), compiles each shape once before timing, reports the best of `--repeats`
runs, and prints one JSON object. Compare backends/dtypes/sizes as ratios within one run: the
machine is shared. `--sampling` lists the decode modes: `greedy` (temperature 0), `sampled`
(temperature 0.7, top-p 0.9, a seed per sequence; no log-probs asked), `top-k` (the same
with top-k 40) and `temperature` (1.0, no truncation); with several, their decode steps
alternate (ABAB...) and each row reports its median step time over the first mode's.
Static-step rows name the tail their steps took (`static_tail`: greedy, sample or masked).
`--baseline-sampler FILE` (torch) times the same steps with another sampler module in the same
alternation, for before/after ratios. `--torch-decode-paths packing,static` (torch) times the
decode steps of the packing path and of the static-shape step over device-resident state
(executor/torch/static_decode.py; CUDA graphs on CUDA) in the same alternation, each row with
`decode_path` and the static rows with their median over the packing path's; `--count-calls`
adds each path's Python function calls per decode step (cProfile of one step), and
`--torch-profile` a `torch.profiler` summary of each torch decode row (host and device ms per
step, kernel launches, graph replays, top operators; bench/torch_profile.py).

`--onednn-isas default,AVX512_CORE_BF16` runs the bench once per oneDNN ISA cap (in a
subprocess with ONEDNN_MAX_CPU_ISA set; `default`: none) and per `--quantization` in its
comma list, tags every row with both, and adds `by_isa` rows: each prefill / decode row's
tok/s under the first cap over the others. On a CPU with AMX, the first against
AVX512_CORE_BF16 is AMX on over off:

    python -m sgl_tpu.bench.executor --backends torch --dtypes bfloat16 --prefill 512,2048 \
        --decode-batches 1,8 --onednn-isas default,AVX512_CORE_BF16 \
        --quantization none,auto,gguf,int8,int4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial

import numpy as np

from sgl_tpu.bench.report import emit, model_label
from sgl_tpu.bench.timing import best, interleaved

# `top-k`: a kept set always inside the sampler's candidates; `temperature` (OpenAI's default,
# no truncation): drawn over the whole vocabulary; both in the static step's sample tail,
# whatever the logits. `sampled` keeps a nucleus, which is wide on a near-flat random model.
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9),
            "top-k": dict(temperature=0.7, top_k=40, top_p=0.9),
            "temperature": dict(temperature=1.0)}


def _steps(n_seqs: int, n_new: int, prefix: int, page_size: int, rng, vocab: int,
           sampling: str = "greedy", shared: int = 0):
    """`n_seqs` steps of `n_new` tokens after `prefix` cached ones, each on its own pages but
    for the first `shared` prefix tokens (whole pages): the same pages in every sequence
    (agents forking one prompt; attention reads them once for all)."""
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    params = SamplingParams(**SAMPLING[sampling])
    if shared % page_size or shared > prefix:
        raise ValueError(f"shared {shared}: whole pages ({page_size}) of the prefix {prefix}")
    common = np.arange(1, 1 + shared // page_size, dtype=np.int32)
    pages_per_seq = -(-(prefix + n_new) // page_size) - len(common)
    first = 1 + len(common)
    steps = []
    for i in range(n_seqs):
        own = np.arange(first + i * pages_per_seq, first + (i + 1) * pages_per_seq,
                        dtype=np.int32)
        pages = np.concatenate([common, own])
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
    results: dict = {"model": model_label(loaded.model_path), "jax_platform": jax.default_backend(),
                     "context_for_decode": args.context, "cpu_count": os.cpu_count(),
                     "runs": []}
    if "torch" in args.backends.split(","):
        from sgl_tpu.executor.torch.device import onednn_info

        results["onednn"] = onednn_info()
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            sargs = ServerArgs(model_path=args.model_path, dtype=dtype, skip_warmup=True,
                               max_total_tokens=pool_tokens, chunked_prefill_size=max_tokens,
                               max_running_requests=max(batches + [1]), max_extend_seqs=1,
                               backend=backend, torch_compile=args.torch_compile,
                               quantization=args.quantization,
                               attention_backend=args.attention_backend)
            rcfg = runner_config(sargs, cfg.context_len)
            paths = {"": create_model_runner(cfg, loaded.params, _decode_path(rcfg, "packing"))}
            if rcfg.backend == "torch" and "static" in args.torch_decode_paths.split(","):
                paths["static-"] = create_model_runner(cfg, loaded.params,
                                                       _decode_path(rcfg, "static"))
            runner = paths[""]
            tag = {"backend": rcfg.backend, "dtype": dtype, "attention": rcfg.attention_backend}
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
                    for path, path_runner in paths.items():
                        for name, use in samplers.items():
                            fns[path + name + mode] = partial(use, path_runner.forward,
                                                              ForwardMode.DECODE, steps)
                times = interleaved(fns, args.repeats)
                for path in paths:
                    for name in samplers:
                        for mode in modes:
                            key, first = path + name + mode, path + name + modes[0]
                            t, med = min(times[key]), statistics.median(times[key])
                            row = {**tag, "phase": "decode", "batch": b,
                                   "context": args.context,
                                   "decode_path": path.rstrip("-") or "packing",
                                   "sampler": name.rstrip("-") or "current", "sampling": mode,
                                   "step_ms": round(1e3 * t, 2),
                                   "median_ms": round(1e3 * med, 2),
                                   "tok_per_s": round(b / t, 1)}
                            if mode != modes[0]:
                                row[f"median_over_{modes[0]}"] = round(
                                    med / statistics.median(times[first]), 3)
                            if name:
                                row["median_over_current"] = round(
                                    med / statistics.median(times[path + mode]), 3)
                            if path:
                                row["median_over_packing"] = round(
                                    med / statistics.median(times[name + mode]), 3)
                                row["static_tail"] = _static_tail(paths[path], fns[key])
                            if args.count_calls:
                                row["python_calls_per_step"] = _count_calls(fns[key])
                            if args.torch_profile and rcfg.backend == "torch":
                                from sgl_tpu.bench.torch_profile import profile_step

                                row["profile"] = profile_step(fns[key], args.repeats)
                            results["runs"].append(row)
                            print(json.dumps(row), flush=True)
    return results


def _decode_path(rcfg, path: str):
    """The runner config of one decode path: `static` forces the static step (graphs stay as
    resolved: on for CUDA), `packing` turns it off."""
    import dataclasses

    if path == "static":
        max_bs = rcfg.static_decode_max_bs or rcfg.max_running_requests
        return dataclasses.replace(rcfg, static_decode=True, static_decode_max_bs=max_bs)
    return dataclasses.replace(rcfg, static_decode=False, cuda_graph=False)


def _static_tail(runner, fn) -> str:
    """Which tail of the static step (greedy, sample or masked; static_decode.py) one more
    call of fn takes ("none": the runner kept the packing path, as for MoE models)."""
    if runner.static_decode is None:
        return "none"
    before = dict(runner.static_decode.tails)
    fn()
    taken = [k for k, v in runner.static_decode.tails.items() if v > before.get(k, 0)]
    return ",".join(taken)


def _count_calls(fn) -> int:
    """Python function calls (cProfile's count, primitive and recursive) of one fn()."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    return pstats.Stats(prof).total_calls


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
    p.add_argument("--attention-backend", default="auto",
                   help="--attention-backend of the runners (kernels/backends.py)")
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
    p.add_argument("--quantization", default="auto", help="weights, as the server's flag")
    p.add_argument("--torch-decode-paths", default="packing",
                   help="torch decode paths timed in one alternation: packing, static "
                        "(comma list; static = the CUDA-graph step, run eagerly off CUDA)")
    p.add_argument("--count-calls", action="store_true",
                   help="report Python function calls per decode step (cProfile)")
    p.add_argument("--torch-profile", action="store_true",
                   help="torch: a torch.profiler summary of --repeats calls of each decode "
                        "step (bench/torch_profile.py)")
    p.add_argument("--onednn-isas", default=None,
                   help="comma list of ONEDNN_MAX_CPU_ISA caps (default: none), one subprocess "
                        "per cap and --quantization (then a comma list)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.onednn_isas or "," in args.quantization:
        results = run_variants(args, argv if argv is not None else sys.argv[1:])
    else:
        results = run(args)
    emit(results, args.output)


_VARIANT_FLAGS = ("--onednn-isas", "--quantization", "--output")


def run_variants(args: argparse.Namespace, argv: list[str]) -> dict:
    """This bench once per (oneDNN ISA cap, quantization), each in a subprocess with
    ONEDNN_MAX_CPU_ISA set (oneDNN reads it once per process), rows tagged; `by_isa`: each
    row's tok/s under the first cap over the same row under each other cap."""
    import subprocess
    import tempfile

    rest, skip = [], False
    for a in argv:  # argv without the flags set per variant
        if skip:
            skip = False
        elif a in _VARIANT_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in _VARIANT_FLAGS)):
            rest.append(a)
    isas = (args.onednn_isas or "default").split(",")
    results: dict = {"variants": [], "runs": [], "by_isa": []}
    for quantization in args.quantization.split(","):
        for isa in isas:
            env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
            if isa != "default":
                env["ONEDNN_MAX_CPU_ISA"] = isa
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, "-m", "sgl_tpu.bench.executor", *rest,
                       "--quantization", quantization, "--output", out.name]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                child = json.load(open(out.name))
            tag = {"onednn_isa": isa, "quantization": quantization}
            results["variants"].append({**tag, "onednn": child.get("onednn")})
            results["runs"] += [{**tag, **row} for row in child["runs"]]
            print(json.dumps(results["variants"][-1]), flush=True)
    for row in results["runs"]:
        if row["onednn_isa"] != isas[0]:
            continue
        for other in results["runs"]:
            same = all(other.get(k) == row.get(k) for k in row
                       if k not in ("onednn_isa", "seconds", "tok_per_s", "step_ms",
                                    "median_ms") and not k.startswith("median_over"))
            if other["onednn_isa"] != isas[0] and same:
                results["by_isa"].append({
                    **{k: row[k] for k in ("quantization", "backend", "dtype", "phase")},
                    **{k: row[k] for k in ("tokens", "batch") if k in row},
                    "isa": isas[0], "other_isa": other["onednn_isa"],
                    "tok_per_s_ratio": round(row["tok_per_s"] / other["tok_per_s"], 3)})
    return results


if __name__ == "__main__":
    main()
