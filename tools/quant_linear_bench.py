"""One decoder layer's projections per GEMM form, at a model width and row counts: the
int8-activation block kernels (`q4-a8`), the exact float32 block kernels (`q4-f32`), and dense
float32 or bfloat16 oneDNN GEMMs (the forms `--quantization` picks between per step,
backends/torch/quant_linear.py). Prints JSON.

    python tools/quant_linear_bench.py --width 3 --rows 1,8,16,64,512 --output FILE.json

Shapes are the default model's layer (hidden 576, 9 heads of 64 with 3 KV heads, FFN 1,536)
times `--width`, the FFN times `--ffn-factor` (4 for the 1.4B-class model of
tools/widen_gguf.py: hidden 1,728, FFN 6,912); weights are random Q4_1-style blocks. Timing is
one thread's CPU clock (`time.thread_time`), best of `--repeats`, over `--copies` copies of
each matrix taken in turn so the weights stream from memory: on a shared machine other jobs
then inflate it less than wall time. A two-thread server step splits the output features over
both cores; the ratios between forms are what this measures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sgl_tpu.backends.torch.kernels import quant_gemm_cpu
from sgl_tpu.backends.torch.quant_linear import Q4A8Kernel, bf16_dense, bf16_dense_linear
from sgl_tpu.quantization.blocks import quantize_int4

FORMS = ("q4-a8", "q4-f32", "dense-f32", "dense-bf16")


def layer_shapes(width: int, ffn_factor: float) -> dict[str, tuple[int, int]]:
    """Projection -> (N out, K in) of one layer."""
    hidden, kv = 576 * width, 192 * width
    ffn = int(round(hidden * ffn_factor / 32)) * 32
    return {"qkv": (hidden + 2 * kv, hidden), "o": (hidden, hidden),
            "gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}


def forms_of(w: np.ndarray, copies: int, forms: list[str]) -> dict[str, list]:
    """Each form's callables x f32[M, K] -> f32[M, N], one per copy of the weight (the bf16
    copy only where `forms` has it: oneDNN refuses it under ONEDNN_MAX_CPU_ISA=AVX2)."""
    g = quantize_int4(w)
    blocks = [quant_gemm_cpu.pack_q4(g.q, g.scale, g.zero) for _ in range(copies)]
    a8 = [Q4A8Kernel(g) for _ in range(copies)]  # 16-feature tiles where the build takes them
    dense = [torch.from_numpy(g.dequantize()) for _ in range(copies)]
    packed = [bf16_dense(d) for d in dense] if "dense-bf16" in forms else []
    return {
        "q4-a8": a8,
        "q4-f32": [lambda x, b=b: quant_gemm_cpu.q4_gemm(x, b) for b in blocks],
        "dense-f32": [lambda x, d=d: torch.nn.functional.linear(x, d) for d in dense],
        "dense-bf16": [lambda x, p=p: bf16_dense_linear(x, p, None) for p in packed],
    }


def best_ms(calls: list, x: torch.Tensor, repeats: int) -> float:
    for call in calls:
        call(x)
    best = float("inf")
    for _ in range(repeats):
        for call in calls:
            start = time.thread_time()
            call(x)
            best = min(best, time.thread_time() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--ffn-factor", type=float, default=1536 / 576)
    ap.add_argument("--rows", default="1,8,16,64,512")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--output")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [int(m) for m in args.rows.split(",")]
    forms = args.forms.split(",")
    rng = np.random.default_rng(0)
    per_matrix: list[dict] = []
    for name, (n, k) in layer_shapes(args.width, args.ffn_factor).items():
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        calls = forms_of(w, args.copies, forms)
        for m in rows:
            x = torch.randn(m, k)
            repeats = args.repeats if m < 64 else max(1, args.repeats // 2)
            for form in forms:
                per_matrix.append({"matrix": name, "n": n, "k": k, "rows": m, "form": form,
                                   "ms": round(best_ms(calls[form], x, repeats), 4)})
    layer = {f"{m}": {f: round(sum(r["ms"] for r in per_matrix
                                     if r["rows"] == m and r["form"] == f), 3) for f in forms}
             for m in rows}
    out = {"width": args.width, "ffn_factor": args.ffn_factor, "clock": "thread", "threads": 1,
           "simd": quant_gemm_cpu.simd(), "vnni": quant_gemm_cpu.vnni(),
           "tile_dot": quant_gemm_cpu.tile_dot(),
           "layer_ms_by_rows": layer, "per_matrix": per_matrix}
    text = json.dumps(out, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
