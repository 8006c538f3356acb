"""The cost of `--enable-deterministic-inference`: prefill and decode step times with the flag on
over off, per executor backend and dtype; run by `python -m sgl_tpu.bench.executor
--deterministic` (its flags: --backends, --dtypes, --prefill, --decode-batches, --context,
--repeats, --torch-threads, --model-path).

Two runners of the same model are built from the same settings but the flag; each timed step
runs once on each, alternating (ABAB...), so a busy machine slows both alike. Reports medians
and the on/off ratio as one JSON object.

With torch on a CPU it also times the flag's GEMM alone ("gemm" rows): the model's fused
projections on the fixed-order kernel (backends/torch/kernels/invariant_gemm_cpu.py) over
oneDNN's prepacked bf16 linear (what runs without the flag), at 2 rows (a decode step's least),
8 and each `--prefill` size. Run it with ONEDNN_MAX_CPU_ISA set to compare against oneDNN at a
lower ISA (AMX off: AVX512_CORE_BF16).
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import numpy as np

from sgl_tpu.bench.report import model_label
from sgl_tpu.bench.step_inputs import make_steps
from sgl_tpu.bench.timing import interleaved_median


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    prefills = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    max_tokens = max(prefills + [1])
    pool_tokens = max(max_tokens, max(batches + [1]) * (args.context + 16)) + 64
    results: dict = {"model": model_label(loaded.model_path), "cpu_count": os.cpu_count(),
                     "threads": args.torch_threads, "prefill_tokens": prefills,
                     "decode_context": args.context, "runs": [], "settings": {}}
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            runners = {}
            for flag in (False, True):
                sargs = ServerArgs(model_path=args.model_path, dtype=dtype, skip_warmup=True,
                                   max_total_tokens=pool_tokens, chunked_prefill_size=max_tokens,
                                   max_running_requests=max(batches + [1]), max_extend_seqs=1,
                                   backend=backend, torch_threads=args.torch_threads,
                                   enable_deterministic_inference=flag)
                rcfg = runner_config(sargs, cfg.context_len)
                name = "on" if flag else "off"
                runners[name] = create_model_runner(cfg, loaded.params, rcfg)
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
    if "torch" in args.backends.split(","):
        from sgl_tpu.backends.torch.device import cpu_info

        results["cpu"] = cpu_info()  # the ISA behind every figure
        results["gemm"] = gemm_rows(cfg, [2, 8, *prefills], args.repeats, args.torch_threads)
    return results


def gemm_rows(cfg, row_counts: list[int], repeats: int, threads: int) -> list[dict]:
    """The fixed-order kernel over oneDNN's prepacked bf16 linear on the model's projection
    shapes (random bf16 weights), median of `repeats` alternating calls each."""
    import torch

    from sgl_tpu.backends.torch.device import cpu_prepacks_bf16, onednn_info
    from sgl_tpu.backends.torch.kernels import invariant_gemm_cpu

    if not (invariant_gemm_cpu.available() and cpu_prepacks_bf16()):
        return []
    if threads:
        torch.set_num_threads(threads)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, cfg.hidden_size), "gate_up": (2 * cfg.intermediate_size,
                                                         cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.intermediate_size)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).to(torch.bfloat16)
        fixed = invariant_gemm_cpu.pack(w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in row_counts:
            x = torch.randn(m, k).to(torch.bfloat16)
            med = interleaved_median({
                "fixed": partial(invariant_gemm_cpu.linear, x, fixed),
                "onednn": partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none",
                                  [], "")}, max(repeats, 20))
            row = {"projection": name, "n": n, "k": k, "rows": m,
                   "fixed_ms": round(1e3 * med["fixed"], 4),
                   "onednn_ms": round(1e3 * med["onednn"], 4),
                   "fixed_over_onednn": round(med["fixed"] / med["onednn"], 3),
                   "onednn_impl": onednn_info()["bf16_linear"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows
