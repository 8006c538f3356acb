"""The fixed-reduction-order GEMM of deterministic inference against oneDNN's prepacked bf16
linear (what runs without the flag), on the default model's projection shapes with random bf16
weights, at 2 rows (a deterministic decode step's least), 8 and 512 rows; median of alternating
calls, one JSON object (with the CPU's flags and oneDNN's kernels).

    python tools/invariant_gemm_bench.py [--rows 2,8,512] [--repeats 20] [--threads 2]
        [--output FILE]

Set ONEDNN_MAX_CPU_ISA to compare against oneDNN at a lower ISA (AMX off: AVX512_CORE_BF16).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from sgl_tpu.backends.torch.device import cpu_info, cpu_prepacks_bf16
from sgl_tpu.backends.torch.kernels import invariant_gemm_cpu
from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import interleaved_median

# the default model's fused projections (SmolLM2-135M): [N, K]
SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def run(rows: list[int], repeats: int) -> dict:
    if not invariant_gemm_cpu.available():
        raise SystemExit(f"not built: {invariant_gemm_cpu.why_unavailable()}")
    if not cpu_prepacks_bf16():
        raise SystemExit("oneDNN does not take bf16 on this CPU: nothing to compare against")
    out: dict = {"cpu": cpu_info(), "threads": torch.get_num_threads(), "rows": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).to(torch.bfloat16)
        fixed = invariant_gemm_cpu.pack(w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            med = interleaved_median({
                "fixed": partial(invariant_gemm_cpu.linear, x, fixed),
                "onednn": partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none",
                                  [], "")}, repeats)
            row = {"projection": name, "n": n, "k": k, "rows": m,
                   "fixed_ms": round(1e3 * med["fixed"], 4),
                   "onednn_ms": round(1e3 * med["onednn"], 4),
                   "fixed_over_onednn": round(med["fixed"] / med["onednn"], 3),
                   "fixed_gflops": round(2 * m * n * k / med["fixed"] / 1e9, 1),
                   "onednn_gflops": round(2 * m * n * k / med["onednn"] / 1e9, 1)}
            out["rows"].append(row)
            print(row, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2,8,512")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    emit(run([int(r) for r in args.rows.split(",")], args.repeats), args.output)


if __name__ == "__main__":
    main()
