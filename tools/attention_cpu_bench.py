"""Fused CPU attention micro-benchmark: the compiled kernel of `torch-cpu-fused` (and its
bfloat16 products) alone, on the agent loop's shapes, optionally against another version of
its source compiled beside it (`--baseline-source`), the two timed in one alternation.

    python tools/attention_cpu_bench.py --baseline-source old.cpp [--products bf16,f32]

Cases (the default model's heads: 9 query heads over 3 KV heads of 64, a bfloat16 pool of
scattered slots larger than the caches):

    extend:S:N:P   S sequences of N new tokens over P cached keys (one EXTEND call)
    decode:B:R:S:O B requests of R speculative verify rows each over a shared prefix of S keys
                   and O own keys per request (one DECODE call; R = 1: plain rows)

One JSON row per case and products: ms (the minimum over the repeats), GFLOP/s (4 x query rows
x keys seen x query heads x head dim), and with a baseline its ms, new / baseline and the
largest difference of the outputs. A layer's call, not a step: a step runs one per layer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from sgl_tpu.backends.torch.device import set_cpu_threads
from sgl_tpu.backends.torch.kernels import cpu_extension
from sgl_tpu.bench.timing import interleaved

DEFAULT_CASES = ("extend:3:100:1600,extend:1:300:1600,decode:8:4:1200:4,decode:8:5:1200:4,"
                 "decode:8:4:0:500,decode:8:5:0:500,decode:8:4:1200:500,decode:1:1:0:1500")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
POOL_SLOTS = 60000  # 46 MB of K and V: past the last-level cache of a small host


def case_call(module: Any, case: str, pool: tuple[torch.Tensor, torch.Tensor], dots: bool,
              g: torch.Generator) -> tuple[Any, float]:
    """(a call of `case` on `module`, its GFLOP)."""
    k, v = pool
    kind, *dims = case.split(":")
    nums = [int(x) for x in dims]
    scale = HEAD_DIM ** -0.5
    per_key = 4 * HEADS * HEAD_DIM / 1e9
    perm = torch.randperm(POOL_SLOTS, generator=g)
    if kind == "extend":
        seqs, new, prefix = nums
        ctx = prefix + new
        slots = [perm[i * ctx:(i + 1) * ctx].contiguous() for i in range(seqs)]
        q = torch.randn(seqs * new, HEADS, HEAD_DIM, generator=g)
        args = (q, k, v, slots, [i * new for i in range(seqs)], [new] * seqs, [prefix] * seqs,
                scale, 0, 0.0, dots)
        return (lambda: module.extend(*args)), seqs * new * (prefix + new / 2) * per_key
    if kind == "decode":
        b, r, shared_len, own_len = nums
        shared = perm[:shared_len].contiguous()
        own = perm[shared_len:shared_len + b * own_len].view(b, own_len)
        own = own.repeat_interleave(r, 0).contiguous()
        hi = torch.tensor([own_len - r + 1 + j for _ in range(b) for j in range(r)])
        lo = torch.zeros(b * r, dtype=torch.int64)
        q = torch.randn(b * r, HEADS, HEAD_DIM, generator=g)
        args = (q, k, v, shared, own, lo, hi, scale, 0, 0.0, dots)
        keys = float((shared_len + hi).sum())
        return (lambda: module.decode(*args)), keys * per_key
    raise ValueError(f"case {case!r}: extend:S:N:P or decode:B:R:S:O")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list (module doc)")
    p.add_argument("--products", default="bf16", help="bf16, f32 or both (comma list)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: the CPUs this process may run on)")
    p.add_argument("--baseline-source", default=None,
                   help="another paged_attention_cpu.cpp, compiled and timed beside the built one")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    module = cpu_extension.load()
    if module is None:
        raise SystemExit(f"the fused attention kernel: {cpu_extension.why_unavailable()}")
    set_cpu_threads(args.threads)
    modules = {"new": module}
    if args.baseline_source:
        build_dir = tempfile.mkdtemp(prefix="sgl_tpu_attn_baseline_")
        modules["baseline"] = cpu_extension.build_copy(Path(args.baseline_source),
                                                       "sgl_tpu_attn_baseline", build_dir)
    g = torch.Generator().manual_seed(0)
    pool = tuple(torch.randn(POOL_SLOTS, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
                 for _ in range(2))
    rows = []
    for products in args.products.split(","):
        if products not in ("bf16", "f32"):
            raise SystemExit(f"--products: bf16 or f32, got {products!r}")
        for case in args.cases.split(","):
            calls = {}
            for label, mod in modules.items():
                g.manual_seed(1)  # the same slots and queries for every module
                calls[label], gflop = case_call(mod, case, pool, products == "bf16", g)
            row: dict[str, Any] = {"case": case, "products": products}
            if "baseline" in calls:
                diff = (calls["new"]() - calls["baseline"]()).abs().max().item()
                row["max_abs_diff"] = diff
            times = {label: min(ts) for label, ts in interleaved(calls, args.repeats).items()}
            row.update(ms=round(1e3 * times["new"], 4),
                       gflop_per_s=round(gflop / times["new"], 1))
            if "baseline" in times:
                row["baseline_ms"] = round(1e3 * times["baseline"], 4)
                row["over_baseline"] = round(times["new"] / times["baseline"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"args": vars(args), "threads": torch.get_num_threads(),
              "bf16_dots": bool(getattr(module, "bf16_dots", False)), "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
