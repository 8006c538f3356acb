"""The compiled layer ops (kernels/layer_ops_cpu.py) one by one, against another build of their
source: `--baseline-source OLD.cpp` is compiled with the native flags and each op of both
builds is timed on the same inputs, interleaved (timing.interleaved), on the default model's
widths (D = 576, SwiGLU F = 1,536).

    python -m sgl_tpu.bench.layer_ops_kernels --baseline-source OLD.cpp [--rows 8,1000]
        [--threads 2] [--calls 50] [--repeats 10] [--output FILE]

    rows 8      a decode step of 8 agents;  rows 1000   an EXTEND step of 8 agents' turns

Prints one JSON object: per op and row count the microseconds per call (min and median over
the repeats of `--calls` calls) of `new` (the installed build of this checkout) and `baseline`, and
`min_vs_baseline` / `median_vs_baseline`. Compare ratios of one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import interleaved

D, F = 576, 1536


def _op_calls(module, torch, rows: int) -> dict:
    """op name -> a no-argument call of that op of `module` on fixed inputs of `rows` rows."""
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * F, generator=g)  # [rows, 2F]
    h = torch.randn(rows, D, generator=g)  # [rows, D]
    delta = torch.randn(rows, D, generator=g) * 0.01
    w = torch.rand(D, generator=g) + 0.5
    return {"silu_mul": lambda: module.silu_mul(gate_up),
            "rms_norm": lambda: module.rms_norm(h, w, 1e-5),
            # adds delta into h in place on every call: h drifts, the op's work does not change
            "add_rms_norm": lambda: module.add_rms_norm(h, delta, w, 1e-5)}


def _repeat(fn, n: int) -> None:
    """`n` calls, each result dropped before the next (kept, 1,000-row outputs made every call
    fault in fresh pages, which took longer than the SiLU itself)."""
    for _ in range(n):
        fn()


def run(args: argparse.Namespace) -> dict:
    import torch

    from sgl_tpu.kernels import cpu_extension, layer_ops_cpu

    torch.set_num_threads(args.threads)
    new = layer_ops_cpu.load()
    if new is None:
        raise SystemExit(f"fused layer ops: {layer_ops_cpu.why_unavailable()}")
    build_dir = tempfile.TemporaryDirectory(prefix="sgl_tpu_layer_ops_baseline_")
    baseline = cpu_extension.build_copy(Path(args.baseline_source), "sgl_tpu_layer_ops_baseline",
                                        build_dir.name)
    results: dict = {"command": "python -m sgl_tpu.bench.layer_ops_kernels "
                                + " ".join(sys.argv[1:]),
                     "baseline_source": Path(args.baseline_source).name,
                     "cpu_count": os.cpu_count(), "threads": args.threads, "calls": args.calls,
                     "repeats": args.repeats, "unit": "us per call", "runs": []}
    for rows in (int(x) for x in args.rows.split(",") if x):
        ops = {"new": _op_calls(new, torch, rows), "baseline": _op_calls(baseline, torch, rows)}
        for op in ops["new"]:
            fns = {name: partial(_repeat, calls[op], args.calls) for name, calls in ops.items()}
            us = {name: [t / args.calls * 1e6 for t in ts]  # per call
                  for name, ts in interleaved(fns, args.repeats).items()}
            ref_min, ref_med = min(us["baseline"]), statistics.median(us["baseline"])
            for name, ts in us.items():
                best, med = min(ts), statistics.median(ts)
                results["runs"].append({"op": op, "rows": rows, "build": name,
                                        "us_min": round(best, 2), "us_median": round(med, 2),
                                        "min_vs_baseline": round(best / ref_min, 3),
                                        "median_vs_baseline": round(med / ref_med, 3)})
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-source", required=True,
                   help="another kernels/csrc/layer_ops_cpu.cpp to time against")
    p.add_argument("--rows", default="8,1000")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
