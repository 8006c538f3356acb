"""The cost of `--enable-deterministic-inference`: prefill and decode step times with the flag on
over off, per executor backend and dtype; run by `python -m sgl_tpu.bench.executor
--deterministic` (its flags: --backends, --dtypes, --prefill, --decode-batches, --context,
--repeats, --torch-threads, --model-path).

Two runners of the same model are built from the same settings but the flag; each timed step
runs once on each, alternating (ABAB...), so a busy machine slows both alike. Reports medians
and the on/off ratio as one JSON object, with each runner's `compute_info()` (the CPU's ISA and
the kernels behind the figures). The flag's GEMM alone against oneDNN's is
`tools/invariant_gemm_bench.py`.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import numpy as np

from sgl_tpu.bench.report import model_label
from sgl_tpu.bench.step_inputs import make_steps, step_sizes
from sgl_tpu.bench.timing import interleaved_median


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills, batches, sizes = step_sizes(args)
    results: dict = {"model": model_label(loaded.model_path), "cpu_count": os.cpu_count(),
                     "threads": args.torch_threads, "prefill_tokens": prefills,
                     "decode_context": args.context, "runs": [], "settings": {}}
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            runners = {}
            for flag in (False, True):
                sargs = ServerArgs(model_path=args.model_path, dtype=dtype, **sizes,
                                   backend=backend, torch_threads=args.torch_threads,
                                   enable_deterministic_inference=flag)
                rcfg = runner_config(sargs, cfg.context_len)
                name = "on" if flag else "off"
                runners[name] = create_model_runner(cfg, loaded.params, rcfg)
                # the ISA and kernels behind every figure (/server_info's "compute")
                results.setdefault("compute", {})[f"{backend}-{dtype}-{name}"] = \
                    runners[name].compute_info()
                results["settings"][f"{backend}-{dtype}-{name}"] = {
                    "attention_backend": rcfg.attention_backend,
                    "quantization": rcfg.quantization, "compile": rcfg.compile}
            rng = np.random.default_rng(0)
            ps = sargs.page_size
            cases = [("prefill", ForwardMode.EXTEND,
                      make_steps(1, n, 0, ps, rng, cfg.vocab_size), {"tokens": n})
                     for n in prefills]
            cases += [(f"decode_b{b}", ForwardMode.DECODE,
                       make_steps(b, 1, args.context, ps, rng, cfg.vocab_size), {"batch": b})
                      for b in batches]
            for phase, mode, steps, info in cases:
                med = interleaved_median(
                    {k: partial(r.forward, mode, steps) for k, r in runners.items()},
                    args.repeats)
                row = {"backend": backend, "dtype": dtype, "phase": phase, **info,
                       "off_ms": round(1e3 * med["off"], 2), "on_ms": round(1e3 * med["on"], 2),
                       "on_over_off": round(med["on"] / med["off"], 3)}
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
            del runners
    return results
