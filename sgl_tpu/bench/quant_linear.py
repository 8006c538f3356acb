"""Crossover of the weight-only quantized kernels against the bf16 prepacked GEMM, by batch rows.

    python -m sgl_tpu.bench.quant_linear [--rows 1,2,4,6,8,12,16,32,64,512] [--repeats 7]
        [--threads 2] [--calls 40] [--cold-bytes 268435456] [--dtype bfloat16|float32]

For each projection shape of the default model (SmolLM2-135M: fused qkv, o, fused gate/up,
down, the tied vocabulary head) and each row count M, times `--calls` calls of each method
(bf16 oneDNN-prepacked `F.linear` equivalent, int4 group-32, int8 per-channel, and a Q8_0
matrix as two int4 nibble planes), cycling through copies of the weight that together span
`--cold-bytes` (a decoder step streams every weight from memory once; a matrix reused call
after call sits in cache and favours the bf16 GEMM). Methods are interleaved within each
repetition (the machine is shared). Prints one JSON object: the fastest repetition's
microseconds per call (the uncontended cost; medians beside it), the ratio to bf16, and per-M
totals over one decoder step (layers x (qkv + o + gate_up + down) + head). The runner's own
crossover (`MAX_KERNEL_ROWS` in `sgl_tpu/executor/torch/quant_linear.py`) is measured on the
real step with `python -m sgl_tpu.bench.quant_executor --kernel-max-rows 64`; this bench shows
it per matrix.

`--dtype float32` (CPUs without AMX) compares the dense float32 `F.linear` ("f32", the
baseline of the ratios) with the compiled block kernels of kernels/quant_gemm_cpu.py: "q4f32"
(int4 groups, the GGUF's Q4_x projections) and "q8f32" (Q8_0 blocks, the vocabulary head), and
their int8-activation forms "q4a8" / "q8a8" (`--quantization gguf-a8`); the step totals are then
q4f32 layers + q8f32 head (and q4a8 + q8a8) against f32. With `--baseline-source OLD.cpp`
(another version of csrc/quant_gemm_cpu.cpp, e.g. `git show REV:kernels/csrc/quant_gemm_cpu.cpp`)
that source is compiled into a temporary directory and timed beside them as "q4f32_base" /
"q8f32_base" on the same blocks, interleaved (`q4f32_vs_base`: the built kernel's time over
the baseline's). `--baseline-no-openmp` builds the baseline without OpenMP (pass the current
source to see what the kernels' threads gain).

    python -m sgl_tpu.bench.quant_linear --dtype float32 --rows 1,4,8,16 --baseline-source OLD.cpp
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.executor.torch import quant_linear

# SmolLM2-135M: hidden 576, 9 heads x 64, 3 kv heads, intermediate 1536, vocab 49152, 30 layers
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
NUM_LAYERS = 30


class Int4PairKernel:
    """A GGUF Q8_0 matrix as two int4 nibble planes summed: the exact int kernel form of Q8_0
    (measured here against bf16; the runner keeps Q8_0 dense, see quant_linear.py)."""

    def __init__(self, m, dtype) -> None:
        hi, lo = m.split_nibbles()
        self.hi, self.lo = quant_linear.Int4Kernel(hi, dtype), quant_linear.Int4Kernel(lo, dtype)

    def __call__(self, x):
        return self.hi(x).add_(self.lo(x))


def _methods(n: int, k: int, rng: np.random.Generator, copies: int) -> dict[str, list]:
    """Each method over `copies` distinct weight matrices (same values, separate memory)."""
    import torch

    from sgl_tpu.executor.torch.quant_linear import Int4Kernel, Int8Kernel
    from sgl_tpu.quantization.blocks import GROUP, Int8Groups, quantize_int4, quantize_int8

    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    q4, q8c = quantize_int4(w), quantize_int8(w)
    q8 = Int8Groups(rng.integers(-127, 128, (n, k)).astype(np.int8),
                    np.full((n, k // GROUP), 1e-3, np.float32))
    w16 = torch.from_numpy(w).bfloat16()

    def bf16():
        dense = torch.ops.mkldnn._reorder_linear_weight(w16.clone(), None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], "")

    return {
        "bf16": [bf16() for _ in range(copies)],
        "int4": [Int4Kernel(q4, torch.bfloat16) for _ in range(copies)],
        "int8": [Int8Kernel(q8c, torch.bfloat16) for _ in range(copies)],
        "int4x2": [Int4PairKernel(q8, torch.bfloat16) for _ in range(copies)],
    }


def _f32_methods(n: int, k: int, rng: np.random.Generator, copies: int,
                 baseline=None) -> dict[str, list]:
    """Dense float32 and the compiled float32 block kernels, `copies` of each; with `baseline`
    (a compiled copy of another kernel source) its q4 / q8 GEMMs on the same blocks."""
    import torch

    from sgl_tpu.executor.torch.quant_linear import (
        Q4A8Kernel,
        Q4F32Kernel,
        Q8A8Kernel,
        Q8F32Kernel,
    )
    from sgl_tpu.quantization.blocks import GROUP, Int8Groups, quantize_int4

    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    q4 = quantize_int4(w)
    q8 = Int8Groups(rng.integers(-127, 128, (n, k)).astype(np.int8),
                    np.full((n, k // GROUP), 1e-3, np.float32))
    w32 = torch.from_numpy(w)

    def f32():
        dense = w32.clone()
        return lambda x: torch.nn.functional.linear(x, dense)

    methods = {"f32": [f32() for _ in range(copies)],
               "q4f32": [Q4F32Kernel(q4) for _ in range(copies)],
               "q8f32": [Q8F32Kernel(q8) for _ in range(copies)],
               "q4a8": [Q4A8Kernel(q4) for _ in range(copies)],
               "q8a8": [Q8A8Kernel(q8) for _ in range(copies)]}
    if baseline is not None:
        methods["q4f32_base"] = [
            lambda x, b=k4.blocks: baseline.q4_gemm(x, b.qs, b.scale, b.zero)
            for k4 in methods["q4f32"]]
        methods["q8f32_base"] = [lambda x, b=k8.blocks: baseline.q8_gemm(x, b.qs, b.scale)
                                 for k8 in methods["q8f32"]]
    return methods


def build_baseline(source: str | Path | None, dtype: str, openmp: bool = True
                   ) -> tuple[ModuleType | None, tempfile.TemporaryDirectory | None]:
    """`--baseline-source`: another csrc/quant_gemm_cpu.cpp compiled into a temporary directory
    (keep it while the module runs), or (None, None) without a source. Float32 only: the
    compiled kernels take float32 activations."""
    if source is None:
        return None, None
    if dtype != "float32":
        raise SystemExit("--baseline-source compares the float32 kernels: add --dtype float32")
    from sgl_tpu.kernels import cpu_extension

    build_dir = tempfile.TemporaryDirectory(prefix="sgl_tpu_qgemm_baseline_")
    return cpu_extension.build_copy(Path(source), "sgl_tpu_qgemm_baseline", build_dir.name,
                                    openmp=openmp), build_dir


def run(args: argparse.Namespace) -> dict:
    import torch

    f32 = args.dtype == "float32"
    base = "f32" if f32 else "bf16"
    x_dtype = torch.float32 if f32 else torch.bfloat16
    weight_bytes = 4 if f32 else 2

    torch.set_num_threads(args.threads)
    baseline, _build_dir = build_baseline(args.baseline_source, args.dtype,
                                          openmp=not args.baseline_no_openmp)
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"dtype": args.dtype, "threads": args.threads, "calls": args.calls,
                     "baseline_source": str(args.baseline_source or ""),
                     "baseline_openmp": not args.baseline_no_openmp if baseline else None,
                     "repeats": args.repeats,
                     "cold_bytes": args.cold_bytes,
                     "unit": "us per call (min over repeats)", "shapes": {}}
    for name, (n, k) in SHAPES.items():
        # enough distinct copies that consecutive calls never find their weights in cache
        copies = max(2, -(-args.cold_bytes // (weight_bytes * n * k)))
        methods = (_f32_methods(n, k, rng, copies, baseline) if f32
                   else _methods(n, k, rng, copies))
        per_m = {}
        for m in rows:
            x = torch.randn(m, k).to(x_dtype)
            times: dict[str, list[float]] = {key: [] for key in methods}
            with torch.inference_mode():
                for fns in methods.values():
                    fns[0](x)  # warm
                order = list(methods.items())
                for rep in range(args.repeats):
                    # interleaved, every other repetition in reverse order: a method's time
                    # depends on what ran before it (measured up to 1.18x for identical code)
                    for key, fns in (order[::-1] if rep % 2 else order):
                        t0 = time.perf_counter()
                        for i in range(args.calls):
                            fns[i % copies](x)
                        times[key].append((time.perf_counter() - t0) / args.calls * 1e6)
            best = {key: min(v) for key, v in times.items()}
            per_m[m] = {key: round(v, 1) for key, v in best.items()}
            per_m[m].update({f"{key}_vs_{base}": round(v / best[base], 3)
                             for key, v in best.items() if key != base})
            per_m[m].update({f"{key}_median": round(statistics.median(v), 1)
                             for key, v in times.items()})
            if baseline is not None:
                per_m[m].update({f"{key}_vs_base": round(best[key] / best[f"{key}_base"], 3)
                                 for key in ("q4f32", "q8f32")})
        results["shapes"][name] = {"n": n, "k": k, "by_rows": per_m}
        print(name, per_m, flush=True)
    step = {}
    layer_keys = ("qkv", "o", "gate_up", "down")
    for m in rows:
        def total(method: str, head: str, m: int = m) -> float:
            layers = sum(results["shapes"][s]["by_rows"][m][method] for s in layer_keys)
            return NUM_LAYERS * layers + results["shapes"]["head"]["by_rows"][m][head]

        if f32:
            dense = total("f32", "f32")
            step[m] = {"f32_us": round(dense),
                       **({"q4f32_layers_q8f32_head_vs_base": round(
                           total("q4f32", "q8f32") / total("q4f32_base", "q8f32_base"), 3)}
                          if baseline is not None else {}),
                       "q4f32_layers_q8f32_head_vs_f32": round(total("q4f32", "q8f32") / dense, 3),
                       "q4a8_layers_q8a8_head_vs_f32": round(total("q4a8", "q8a8") / dense, 3),
                       "q4f32_layers_f32_head_vs_f32": round(total("q4f32", "f32") / dense, 3)}
            continue
        bf16 = total("bf16", "bf16")
        step[m] = {"bf16_us": round(bf16),
                   "int4_layers_int4x2_head_vs_bf16": round(total("int4", "int4x2") / bf16, 3),
                   "int4_layers_bf16_head_vs_bf16": round(total("int4", "bf16") / bf16, 3),
                   "int8_vs_bf16": round(total("int8", "int8") / bf16, 3)}
    results["decoder_step_gemms"] = step
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,6,8,12,16,32,64,512")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="activations: bf16 (torch's int kernels) or float32 (compiled blocks)")
    p.add_argument("--cold-bytes", type=int, default=256 * 2**20,
                   help="dense bytes the weight copies cycled through span (beyond the caches)")
    p.add_argument("--baseline-source", type=Path, default=None,
                   help="another csrc/quant_gemm_cpu.cpp, timed beside the built one (float32)")
    p.add_argument("--baseline-no-openmp", action="store_true",
                   help="build the baseline without -fopenmp (its loops on one thread)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
