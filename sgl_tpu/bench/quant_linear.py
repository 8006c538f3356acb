"""Crossover of the weight-only quantized kernels against the bf16 prepacked GEMM, by batch rows.

    python -m sgl_tpu.bench.quant_linear [--rows 1,2,4,6,8,12,16,32,64,512] [--repeats 7]
        [--threads 2] [--calls 20]

For each projection shape of the default model (SmolLM2-135M: fused qkv, o, fused gate/up,
down, the tied vocabulary head) and each row count M, times `--calls` calls of each method
(bf16 oneDNN-prepacked `F.linear` equivalent, int4 group-32, the Q8_0 head as two int4 nibble
planes, int8 per-channel), methods interleaved within each repetition (the machine is shared),
and prints one JSON object: the fastest repetition's microseconds per call (on a shared machine
the minimum is the uncontended cost; medians are reported beside it) and the ratio to bf16, plus
per-M totals over one decoder step (layers x (qkv + o + gate_up + down) + head). The largest M where
a kernel's step total still beats bf16 is its `MAX_KERNEL_ROWS` entry in
`sgl_tpu/executor/torch/quant_linear.py` (the head stays dense in the runner; its columns show
why).
"""

from __future__ import annotations

import argparse
import statistics
import time

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
        self.out_features = m.q.shape[0]

    def __call__(self, x):
        return self.hi(x).add_(self.lo(x))


def _methods(n: int, k: int, rng: np.random.Generator) -> dict:
    import torch

    from sgl_tpu.executor.torch.quant_linear import Int4Kernel, Int8Kernel
    from sgl_tpu.quantization.blocks import GROUP, Int8Groups, quantize_int4, quantize_int8

    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    dense = torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(w).bfloat16(), None)
    out = {
        "bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""),
        "int4": Int4Kernel(quantize_int4(w), torch.bfloat16),
        "int8": Int8Kernel(quantize_int8(w), torch.bfloat16),
    }
    q8 = Int8Groups(rng.integers(-127, 128, (n, k)).astype(np.int8),
                    np.full((n, k // GROUP), 1e-3, np.float32))
    out["int4x2"] = Int4PairKernel(q8, torch.bfloat16)
    return out


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"threads": args.threads, "calls": args.calls, "repeats": args.repeats,
                     "unit": "us per call (min over repeats)", "shapes": {}}
    for name, (n, k) in SHAPES.items():
        methods = _methods(n, k, rng)
        per_m = {}
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            times: dict[str, list[float]] = {key: [] for key in methods}
            with torch.inference_mode():
                for fn in methods.values():
                    fn(x)  # warm
                for _ in range(args.repeats):
                    for key, fn in methods.items():  # interleaved
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            fn(x)
                        times[key].append((time.perf_counter() - t0) / args.calls * 1e6)
            best = {key: min(v) for key, v in times.items()}
            per_m[m] = {key: round(v, 1) for key, v in best.items()}
            per_m[m].update({f"{key}_vs_bf16": round(v / best["bf16"], 3)
                             for key, v in best.items() if key != "bf16"})
            per_m[m].update({f"{key}_median": round(statistics.median(v), 1)
                             for key, v in times.items()})
        results["shapes"][name] = {"n": n, "k": k, "by_rows": per_m}
        print(name, per_m, flush=True)
    step = {}
    layer_keys = ("qkv", "o", "gate_up", "down")
    for m in rows:
        def total(method: str, head: str, m: int = m) -> float:
            layers = sum(results["shapes"][s]["by_rows"][m][method] for s in layer_keys)
            return NUM_LAYERS * layers + results["shapes"]["head"]["by_rows"][m][head]

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
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
