"""Executor micro-benchmark: prefill and decode throughput of the model runners, per backend
and dtype.

    python -m sgl_tpu.bench.executor [--backends torch,jax] [--dtypes float32,bfloat16]
        [--prefill 128,512,2048] [--decode-batches 1,8,32,64] [--context 256] [--repeats 3]
        [--shared-prefix 0] [--kv-cache-dtype auto]
        [--torch-compile auto|on|off] [--torch-threads N] [--sampling greedy,sampled]
        [--torch-decode-paths packing,static,python-layers] [--count-calls]
        [--quantization auto]
        [--attention-backend auto|ref|gathered|torch-sdpa|torch-cpu-fused|...]
        [--onednn-isas default,AVX512_CORE_BF16] [--deterministic] [--output FILE]

Runs the real step (paged KV, bucketed shapes, sampler) of each backend on the default model (or
`--model-path`), compiles each shape once before timing, reports the best of `--repeats` runs,
and prints one JSON object. Decode rows have `--context` tokens of context each, of which the
first `--shared-prefix` are the same pages in every sequence (an agent batch), and report the KV
bytes a step must read at least (`kv_mb_per_step`: the shared pages once, a sliding-window layer
its window only) over the median step time (`kv_gb_per_s_over_step`: against the host's memory
bandwidth, how near the step is to attention's floor). Compare backends/dtypes/sizes as ratios
within one run: the machine is shared. `--sampling` lists the decode modes: `greedy`
(temperature 0), `sampled` (temperature 0.7, top-p 0.9, a seed per sequence; no log-probs
asked), `top-k` (the same with top-k 40) and `temperature` (1.0, no truncation); with several,
their decode steps alternate (ABAB...) and each row reports its median step time over the first
mode's.
Static-step rows name the tail their steps took (`static_tail`: greedy, sample or masked).
`python-layers` in `--torch-decode-paths` times the packing path's steps once more with their
layer loop in Python where it runs compiled (layer_ops_cpu.DecodeLayers; rows `decode_path`
`python-layers`, with their median over the compiled loop's as `median_over_packing`).
`--torch-decode-paths packing,static` (torch) times the
decode steps of the packing path and of the static-shape step over device-resident state
(backends/torch/static_decode.py; CUDA graphs on CUDA) in the same alternation, each row with
`decode_path` and the static rows with their median over the packing path's; `--count-calls`
adds each path's Python function calls per decode step (cProfile of one step).
`tools/torch_profile.py` runs this bench with a `torch.profiler` summary in each decode row.

`--onednn-isas default,AVX512_CORE_BF16` runs the bench once per oneDNN ISA cap (in a
subprocess with ONEDNN_MAX_CPU_ISA set; `default`: none) and per `--quantization` in its
comma list, tags every row with both, and adds `by_isa` rows: each prefill / decode row's
tok/s under the first cap over the others. On a CPU with AMX, the first against
AVX512_CORE_BF16 is AMX on over off:

    python -m sgl_tpu.bench.executor --backends torch --dtypes bfloat16 --prefill 512,2048 \
        --decode-batches 1,8 --onednn-isas default,AVX512_CORE_BF16 \
        --quantization none,auto,gguf,int8,int4

`--deterministic` instead times the cost of `--enable-deterministic-inference`: two runners per
backend and dtype, built alike but for the flag, each step alternating between them, rows with
the on/off ratio of the median step times (`determinism.py`):

    python -m sgl_tpu.bench.executor --deterministic --backends torch --dtypes bfloat16 \
        --prefill 512 --decode-batches 1,8,32 --torch-threads 2 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from sgl_tpu import kv_dtypes
from sgl_tpu.bench import determinism
from sgl_tpu.bench.report import emit, model_label
from sgl_tpu.bench.step_inputs import SAMPLING, make_steps, step_sizes
from sgl_tpu.bench.timing import best, interleaved

# A measurement taken on each decode row's step: fn (one step) -> the row's value under its name.
StepProbe = Callable[[Callable[[], Any]], Any]


def run(args: argparse.Namespace, step_probes: dict[str, StepProbe] | None = None) -> dict:
    """Prefill and decode rows of every backend and dtype; each decode row also gets
    `row[name] = probe(step)` for every one of `step_probes`."""
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills, batches, sizes = step_sizes(args)
    rng = np.random.default_rng(0)
    results: dict = {"model": model_label(loaded.model_path), "context_for_decode": args.context,
                     "cpu_count": os.cpu_count(), "runs": [], "compute": {}}
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            sargs = ServerArgs(model_path=args.model_path, dtype=dtype, **sizes,
                               backend=backend, torch_compile=args.torch_compile,
                               torch_threads=args.torch_threads,
                               quantization=args.quantization,
                               attention_backend=args.attention_backend,
                               kv_cache_dtype=args.kv_cache_dtype)
            rcfg = runner_config(sargs, cfg.context_len)
            paths = {"": create_model_runner(cfg, loaded.params, _decode_path(rcfg, "packing"))}
            # (mixture-of-experts layers have no static step: they route on the host)
            if (rcfg.backend == "torch" and "static" in args.torch_decode_paths.split(",")
                    and not cfg.num_experts):
                paths["static-"] = create_model_runner(cfg, loaded.params,
                                                       _decode_path(rcfg, "static"))
            runner = paths[""]
            # the same runner with its decode layers in Python (layer_ops_cpu.DecodeLayers off)
            python_layers = ("python-layers" in args.torch_decode_paths.split(",")
                             and getattr(runner, "decode_layers", False))
            # device, ISA and kernels behind the rows (/server_info's "compute")
            results["compute"][f"{backend}-{dtype}"] = runner.compute_info()
            tag = {"backend": rcfg.backend, "dtype": dtype, "attention": rcfg.attention_backend}
            if rcfg.backend == "torch":
                tag["compile"] = rcfg.compile
            ps = sargs.page_size
            for n in prefills:
                steps = make_steps(1, n, 0, ps, rng, cfg.vocab_size)
                t = best(partial(runner.forward, ForwardMode.EXTEND, steps), args.repeats)
                results["runs"].append({**tag, "phase": "prefill", "tokens": n,
                                        "seconds": round(t, 4), "tok_per_s": round(n / t, 1)})
                print(json.dumps(results["runs"][-1]), flush=True)
            modes = args.sampling.split(",")
            for b in batches:
                tokens = rng.integers(0, cfg.vocab_size, b)  # the same inputs in every mode
                fns = {}
                for mode in modes:
                    steps = make_steps(b, 1, args.context, ps, rng, cfg.vocab_size, mode,
                                       shared=args.shared_prefix)
                    for st, tok in zip(steps, tokens, strict=True):
                        st.token_ids = [int(tok)]
                    for path, path_runner in paths.items():
                        fns[path + mode] = partial(path_runner.forward, ForwardMode.DECODE,
                                                   steps)
                    if python_layers:
                        fns["python-layers-" + mode] = partial(_python_layers, runner,
                                                               fns[mode])
                times = interleaved(fns, args.repeats)
                for path in [*paths, *(["python-layers-"] if python_layers else [])]:
                    for mode in modes:
                        key = path + mode
                        t, med = min(times[key]), statistics.median(times[key])
                        kv = kv_bytes_read(cfg, rcfg.kv_dtype, b, args.context + 1,
                                           args.shared_prefix)
                        row = {**tag, "phase": "decode", "batch": b, "context": args.context,
                               "shared_prefix": args.shared_prefix,
                               "decode_path": path.rstrip("-") or "packing", "sampling": mode,
                               "step_ms": round(1e3 * t, 2), "median_ms": round(1e3 * med, 2),
                               "tok_per_s": round(b / t, 1),
                               "kv_mb_per_step": round(kv / 1e6, 2),
                               "kv_gb_per_s_over_step": round(kv / 1e9 / med, 2)}
                        if mode != modes[0]:
                            row[f"median_over_{modes[0]}"] = round(
                                med / statistics.median(times[path + modes[0]]), 3)
                        if path:
                            row["median_over_packing"] = round(
                                med / statistics.median(times[mode]), 3)
                        if path and path in paths:  # the static step's tail only
                            row["static_tail"] = _static_tail(paths[path], fns[key])
                        if args.count_calls:
                            row["python_calls_per_step"] = _count_calls(fns[key])
                        for name, probe in (step_probes or {}).items():
                            row[name] = probe(fns[key])
                        results["runs"].append(row)
                        print(json.dumps(row), flush=True)
    return results


def kv_bytes_read(cfg, kv_dtype: str, batch: int, context: int, shared: int) -> int:
    """The KV bytes a decode step must read at least: every layer's K and V of each
    sequence's `context` tokens, the `shared` prefix once for the whole batch; a sliding-window
    layer (Gemma's local layers, Mistral's every layer) only each sequence's last `window`
    (the runner splits no shared part off under a window)."""
    per_token = kv_dtypes.kv_dtype(kv_dtype).token_bytes(1, cfg.num_kv_heads, cfg.head_dim)
    if cfg.gemma is not None:
        windows = [cfg.gemma.sliding_window if local else None
                   for local in cfg.gemma.sliding_layers]
    else:
        windows = [cfg.sliding_window] * cfg.num_layers
    tokens = sum(shared + batch * (context - shared) if w is None else batch * min(context, w)
                 for w in windows)
    return per_token * tokens


def _decode_path(rcfg, path: str):
    """The runner config of one decode path: `static` forces the static step (graphs stay as
    resolved: on for CUDA), `packing` turns it off."""
    import dataclasses

    if path == "static":
        max_bs = rcfg.static_decode_max_bs or rcfg.max_running_requests
        return dataclasses.replace(rcfg, static_decode=True, static_decode_max_bs=max_bs)
    return dataclasses.replace(rcfg, static_decode=False, cuda_graph=False)


def _python_layers(runner, step: Callable[[], Any]) -> Any:
    """One decode step of `runner` with its layer loop in Python (the compiled DecodeLayers
    off for this step only)."""
    runner.decode_layers = False
    try:
        return step()
    finally:
        runner.decode_layers = True


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--attention-backend", default="auto",
                   help="--attention-backend of the runners (executor/attention_registry.py)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--torch-compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads, as the server's flag (0: the server's default)")
    p.add_argument("--prefill", default="128,512,2048")
    p.add_argument("--decode-batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="decode rows: tokens of the context every sequence shares (whole "
                        "pages; agents forking one prompt)")
    p.add_argument("--kv-cache-dtype", default="auto", help="as the server's flag")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampling", default="greedy",
                   help="decode modes, comma list of " + "/".join(SAMPLING))
    p.add_argument("--quantization", default="auto", help="weights, as the server's flag")
    p.add_argument("--torch-decode-paths", default="packing",
                   help="torch decode paths timed in one alternation: packing, static, "
                        "python-layers (comma list; static = the CUDA-graph step, run eagerly "
                        "off CUDA; python-layers = packing with the layer loop in Python)")
    p.add_argument("--count-calls", action="store_true",
                   help="report Python function calls per decode step (cProfile)")
    p.add_argument("--onednn-isas", default=None,
                   help="comma list of ONEDNN_MAX_CPU_ISA caps (default: none), one subprocess "
                        "per cap and --quantization (then a comma list)")
    p.add_argument("--deterministic", action="store_true",
                   help="time --enable-deterministic-inference on over off (see above)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.deterministic:
        results = determinism.run(args)
    elif args.onednn_isas or "," in args.quantization:
        results = run_variants(args, argv if argv is not None else sys.argv[1:])
    else:
        results = run(args)
    emit(results, args.output)


_VARIANT_FLAGS = ("--onednn-isas", "--quantization", "--output")
# What a row measured, as opposed to what it measured it from: twins under two ISA caps agree
# on these keys. Every other key is a timing or derived from one (`kv_gb_per_s_over_step`
# divides by the step time), so it differs between the caps.
_ROW_IDENTITY = ("quantization", "backend", "dtype", "attention", "compile", "phase", "tokens",
                 "batch", "context", "shared_prefix", "decode_path", "sampling")


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
            onednn = next((c["cpu"]["onednn"] for c in child.get("compute", {}).values()
                           if "cpu" in c), None)
            results["variants"].append({**tag, "onednn": onednn})
            results["runs"] += [{**tag, **row} for row in child["runs"]]
            print(json.dumps(results["variants"][-1]), flush=True)
    results["by_isa"] = pair_by_isa(results["runs"], isas[0])
    return results


def pair_by_isa(runs: list[dict], first_isa: str) -> list[dict]:
    """Each row under `first_isa`: its tok/s over that of its twin under every other cap."""
    out = []
    for row in runs:
        if row["onednn_isa"] != first_isa:
            continue
        for other in runs:
            same = all(other.get(k) == row.get(k) for k in _ROW_IDENTITY)
            if other["onednn_isa"] != first_isa and same:
                out.append({
                    **{k: row[k] for k in ("quantization", "backend", "dtype", "phase")},
                    **{k: row[k] for k in ("tokens", "batch") if k in row},
                    "isa": first_isa, "other_isa": other["onednn_isa"],
                    "tok_per_s_ratio": round(row["tok_per_s"] / other["tok_per_s"], 3)})
    return out


if __name__ == "__main__":
    main()
