"""Quantized GEMM micro-benchmark: the int8-activation tile kernels of `quant_gemm_cpu`
(`q4-a8-t16`, `q8-a8-t16`; builds with AVX2 and F16C: `tile_dot` says which dot product) on a
model's projection shapes at several row counts, optionally against another version of the
kernel source compiled beside it (`--baseline-source`) or against the exact float32 block
kernels of the same weights (`--f32-blocks`: q4_gemm / q8_gemm, what `--quantization gguf`
runs), timed in one alternation.

    python tools/quant_gemm_bench.py --rows 1,8,32,200,800 --baseline-source old.cpp
    python tools/quant_gemm_bench.py --rows 1,8 --f32-blocks --copies 4

With `--copies N` each form cycles through N copies of every matrix, so that weights larger
together than the caches stream from memory as in a decode step. `steps` sums each row count's
times as one decode step's GEMMs: `--layers` times every shape but `head`, plus `head`.

One JSON row per shape and row count: ms (the minimum over the repeats: the kernels' time does
not depend on the values, so the minimum is the least disturbed call), GOP/s (2 M N K per
call), and with a baseline its ms and new / baseline. The default shapes are the default
model's (SmolLM2-135M: the fused QKV, O, fused gate/up and down projections in Q4 blocks, the
vocab head in Q8 blocks, as its GGUF stores them); the codes are random and the scales float16,
as a GGUF's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgl_tpu.backends.torch.device import set_cpu_threads
from sgl_tpu.backends.torch.kernels import cpu_extension, quant_gemm_cpu
from sgl_tpu.bench.timing import interleaved

DEFAULT_SHAPES = "qkv=960x576:q4,o=576x576:q4,gate_up=3072x576:q4,down=576x1536:q4," \
                 "head=49152x576:q8"


def parse_shapes(text: str) -> list[tuple[str, int, int, str]]:
    """"name=NxK:kind,..." -> [(name, N, K, kind)], kind q4 or q8."""
    shapes = []
    for item in text.split(","):
        name, rest = item.split("=")
        dims, kind = rest.split(":")
        n, k = (int(v) for v in dims.split("x"))
        if kind not in ("q4", "q8"):
            raise ValueError(f"shape {name}: kind must be q4 or q8, got {kind!r}")
        shapes.append((name, n, k, kind))
    return shapes


def random_codes(n: int, k: int, kind: str, rng: np.random.Generator) -> tuple:
    """(q, scale[, zero]) of random Q4 or Q8 blocks, float16 scales as a GGUF's."""
    scale = rng.random((n, k // 32)).astype(np.float16).astype(np.float32)
    if kind == "q4":
        zero = rng.random((n, k // 32)).astype(np.float16).astype(np.float32)
        return rng.integers(0, 16, (n, k)), scale, zero
    return rng.integers(-128, 128, (n, k)), scale


def random_tiles(n: int, k: int, kind: str, rng: np.random.Generator) -> Any:
    pack = quant_gemm_cpu.pack_q4_tiles if kind == "q4" else quant_gemm_cpu.pack_q8_tiles
    return pack(*random_codes(n, k, kind, rng))


def tile_call(module: Any, x: torch.Tensor, w: Any) -> Any:
    if isinstance(w, quant_gemm_cpu.Q4Tiles):
        return lambda: module.q4_gemm_a8_tiles(x, w.qt, w.st, w.mt)
    return lambda: module.q8_gemm_a8_tiles(x, w.qt, w.st)


def cycling(calls: list) -> Any:
    """One callable that runs the next of `calls` each time (the copies of a matrix)."""
    state = {"i": -1}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()
    return call


def f32_call(x: torch.Tensor, codes: tuple) -> Any:
    """The float32 block kernel (exact, `--quantization gguf`) of the same weights."""
    if len(codes) == 3:
        w = quant_gemm_cpu.pack_q4(*codes)
        return lambda: quant_gemm_cpu.q4_gemm(x, w)
    w = quant_gemm_cpu.pack_q8(*codes)
    return lambda: quant_gemm_cpu.q8_gemm(x, w)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="name=NxK:q4|q8, comma list")
    p.add_argument("--rows", default="1,8,32,200,800", help="activation row counts M")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: the CPUs this process may run on)")
    p.add_argument("--baseline-source", default=None,
                   help="another quant_gemm_cpu.cpp, compiled and timed beside the built one")
    p.add_argument("--baseline-math-differs", action="store_true",
                   help="time a baseline whose results differ by design (no result check)")
    p.add_argument("--f32-blocks", action="store_true",
                   help="also time the float32 block kernels of the same weights")
    p.add_argument("--copies", type=int, default=1,
                   help="copies of each matrix, taken in turn (weights stream from memory)")
    p.add_argument("--layers", type=int, default=30,
                   help="decoder layers of the model, for `steps` (every shape but head)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if not quant_gemm_cpu.tile_dot():
        raise SystemExit("this build of quant_gemm_cpu has no tile kernels (AVX2 + F16C)")
    set_cpu_threads(args.threads)
    modules = {"new": quant_gemm_cpu.kernel_module()}
    if args.baseline_source:
        build_dir = tempfile.mkdtemp(prefix="sgl_tpu_qgemm_baseline_")
        modules["baseline"] = cpu_extension.build_copy(Path(args.baseline_source),
                                                       "sgl_tpu_qgemm_baseline", build_dir)
    rng = np.random.default_rng(0)
    rows = []
    for name, n, k, kind in parse_shapes(args.shapes):
        codes = [random_codes(n, k, kind, rng) for _ in range(args.copies)]
        pack = quant_gemm_cpu.pack_q4_tiles if kind == "q4" else quant_gemm_cpu.pack_q8_tiles
        tiles = [pack(*c) for c in codes]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            fns = {label: cycling([tile_call(mod, x, w) for w in tiles])
                   for label, mod in modules.items()}
            if args.f32_blocks:
                fns["f32"] = cycling([f32_call(x, c) for c in codes])
            check = "baseline" in fns and not args.baseline_math_differs
            if check and not torch.allclose(fns["new"](), fns["baseline"](), rtol=1e-4, atol=1e-3):
                raise SystemExit(f"{name} at {m} rows: the baseline's results differ")
            times = {label: min(ts) for label, ts in interleaved(fns, args.repeats).items()}
            row = {"shape": name, "n": n, "k": k, "kind": kind, "rows": m,
                   "ms": round(1e3 * times["new"], 4),
                   "gop_per_s": round(2 * m * n * k / times["new"] / 1e9, 1)}
            for label in ("baseline", "f32"):
                if label in times:
                    row[f"{label}_ms"] = round(1e3 * times[label], 4)
                    row[f"over_{label}"] = round(times["new"] / times[label], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    steps = {}
    for m in sorted({r["rows"] for r in rows}):
        weight = {r["shape"]: 1 if r["shape"] == "head" else args.layers for r in rows}
        step = {key: round(sum(weight[r["shape"]] * r[key] for r in rows if r["rows"] == m), 3)
                for key in ("ms", "baseline_ms", "f32_ms") if key in rows[0]}
        for label in ("baseline", "f32"):
            if f"{label}_ms" in step:
                step[f"over_{label}"] = round(step["ms"] / step[f"{label}_ms"], 3)
        steps[str(m)] = step
    module = quant_gemm_cpu.kernel_module()
    result = {"args": vars(args), "threads": torch.get_num_threads(), "simd": module.simd,
              "tile_dot": module.tile_dot, "flavour": quant_gemm_cpu.flavour(), "rows": rows,
              "steps": steps}
    print(json.dumps({"steps": steps}), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
