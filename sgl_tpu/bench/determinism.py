"""The cost of `--enable-deterministic-inference`: prefill and decode step times with the flag on
over off, per executor backend, bfloat16.

    python -m sgl_tpu.bench.determinism [--backends torch,jax] [--prefill 512]
        [--decode-batches 1,8,32] [--context 256] [--repeats 5] [--threads 2] [--output FILE]

Two runners of the same model (the default one, or `--model-path`) are built from the same
settings but the flag; each timed step runs once on each, alternating (ABAB...), so a busy
machine slows both alike. Reports medians and the on/off ratio as one JSON object.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import numpy as np

from sgl_tpu.bench.executor import _steps
from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import interleaved_median


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefill = int(args.prefill)
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    pool_tokens = max(prefill, max(batches) * (args.context + 16)) + 64
    results: dict = {"model": args.model_path or "default", "cpu_count": os.cpu_count(),
                     "threads": args.threads, "dtype": "bfloat16", "prefill_tokens": prefill,
                     "decode_context": args.context, "runs": []}
    for backend in args.backends.split(","):
        runners = {}
        for flag in (False, True):
            sargs = ServerArgs(model_path=args.model_path, dtype="bfloat16", skip_warmup=True,
                               max_total_tokens=pool_tokens, chunked_prefill_size=prefill,
                               max_running_requests=max(batches), max_extend_seqs=1,
                               backend=backend, torch_threads=args.threads,
                               enable_deterministic_inference=flag)
            rcfg = runner_config(sargs, cfg.context_len)
            runners["on" if flag else "off"] = create_model_runner(cfg, loaded.params, rcfg)
            results.setdefault("settings", {})[f"{backend}-{'on' if flag else 'off'}"] = {
                "attention_backend": rcfg.attention_backend,
                "quantization": rcfg.quantization, "compile": rcfg.compile}
        rng = np.random.default_rng(0)
        ps = 16
        cases = [("prefill", ForwardMode.EXTEND, _steps(1, prefill, 0, ps, rng, cfg.vocab_size),
                  {"tokens": prefill})]
        for b in batches:
            cases.append((f"decode_b{b}", ForwardMode.DECODE,
                          _steps(b, 1, args.context, ps, rng, cfg.vocab_size), {"batch": b}))
        for name, mode, steps, info in cases:
            med = interleaved_median(
                {k: partial(r.forward, mode, steps) for k, r in runners.items()}, args.repeats)
            row = {"backend": backend, "phase": name, **info,
                   "off_ms": round(1e3 * med["off"], 2), "on_ms": round(1e3 * med["on"], 2),
                   "on_over_off": round(med["on"] / med["off"], 3)}
            results["runs"].append(row)
            print(row, flush=True)
        del runners
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--prefill", default="512")
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
