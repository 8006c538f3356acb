"""Torch attention on CPU: `torch-sdpa` (paged_attention_torch) vs `torch-cpu-fused`
(paged_attention_cpu), one layer's call, interleaved in one run.

    python -m sgl_tpu.bench.attention_cpu [--dtypes float32,bfloat16,float32/bfloat16]
        [--decode-batches 1,8,32]
        [--shared 1312] [--own 300,700] [--repeats 7] [--layers 30] [--clocks thread,wall]
        [--model-steps [--model-kv-cache-dtype bfloat16]] [--baseline-source OLD.cpp]
        [--output FILE]

A `--dtypes` entry `float32/bfloat16` runs float32 queries over bfloat16 pools (a float32
model's `--kv-cache-dtype bfloat16`); the floor counts the pool's bytes.

Shapes are SmolLM2-135M's (3 KV heads x 3 query heads, head_dim 64, page size 16) over a pool
whose pages are handed out in a scattered order, as a radix cache leaves them:

    decode b1        one sequence of shared + the midpoint of --own tokens
    decode b8 / b32  agents: every sequence forks the same `--shared`-token prefix (read once
                     per step by both kernels) and adds its own 300..700 tokens
    extend fresh     512 new tokens, no prefix
    extend turn      200 new tokens on a 1,300-token cached prefix (an agent's next turn)

Each case times the kernels alternately (ABAB..., the machine is shared), each call after an
untimed pass over 64 MB that evicts the caches (as the other layers do in a model step), and
reports the best and median per call, their ratio, and for decode the memory floor: the K/V
bytes a step must read (each distinct key once per KV head) over the read bandwidth measured
in the same run and clock (`sum` of a 256 MB tensor). `step_ms` multiplies a call by
--layers. Two clocks:

    thread  one intra-op thread, CPU time of that thread (`time.thread_time`): what the work
            costs, robust to a loaded machine descheduling the process
    wall    all intra-op threads, wall time: what a step waits for on this machine now (on an
            oversubscribed machine the OpenMP barriers of many small ops inflate it)

`--model-steps` adds the whole DECODE step of the default model (float32 runners, one per
backend, eager), the decode batches above with the same agent contexts, and one EXTEND step
(256 new tokens on a 1,024-token cached prefix), on the thread clock (the K/V contents do not
change the time, so no prefill runs first). `--model-kv-cache-dtype bfloat16` gives those
runners bfloat16 pools, as `--dtype auto` serves on a CPU without AMX.

`--baseline-source` compiles another version of csrc/paged_attention_cpu.cpp (e.g.
`git show HEAD~1:kernels/csrc/paged_attention_cpu.cpp > /tmp/old.cpp`) into a temporary
directory and times it as a third backend, `torch-cpu-fused-baseline`, interleaved with the
others (`speedup_vs_baseline`: the built kernel's gain over that source).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import interleaved

KVH, GROUP, HEAD_DIM, PAGE = 3, 3, 64, 16
BASELINE = "torch-cpu-fused-baseline"


def _baseline_backend(source: Path, build_dir: str) -> SimpleNamespace:
    """paged_attention_cpu's interface over a compiled copy of another kernel source."""
    from sgl_tpu.kernels import cpu_extension
    from sgl_tpu.kernels import paged_attention_cpu as fused

    kernel = cpu_extension.build_copy(source, "sgl_tpu_attn_cpu_baseline", build_dir)

    def extend_attention(q, k_pool, v_pool, seqs, scale, sliding_window=None, logit_cap=None):
        return kernel.extend(q, k_pool, v_pool, [s.slots for s in seqs],
                             [s.start for s in seqs], [s.num_new for s in seqs],
                             [s.prefix_len for s in seqs], float(scale),
                             int(sliding_window or 0), float(logit_cap or 0.0))

    def decode_attention(q, k_pool, v_pool, batch, scale, sliding_window=None, logit_cap=None):
        return kernel.decode(q, k_pool, v_pool, batch.shared_slots, batch.slots, batch.own_lo,
                             batch.own_hi, float(scale), int(sliding_window or 0),
                             float(logit_cap or 0.0))

    return SimpleNamespace(DecodeBatch=fused.DecodeBatch, ExtendSeq=fused.ExtendSeq,
                           context_slots=fused.context_slots, write_kv=fused.write_kv,
                           extend_attention=extend_attention, decode_attention=decode_attention)


def _read_bandwidth(torch, clock) -> float:
    """Bytes/s of a read (best of 5 sums over a 256 MB float32 tensor)."""
    x = torch.ones(64 << 20)
    x.sum()
    best = min(_timed(x.sum, clock) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


class _Pool:
    def __init__(self, torch, dtype, num_tokens: int, rng):
        num_pages = num_tokens // PAGE + 64
        self.k = torch.randn(num_pages * PAGE, KVH, HEAD_DIM).to(dtype)
        self.v = torch.randn(num_pages * PAGE, KVH, HEAD_DIM).to(dtype)
        self.free = list(1 + rng.permutation(num_pages - 1))

    def pages(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // PAGE)
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out, np.int64)


def _dtypes(torch, name: str):
    """`--dtypes` entry -> (query dtype, pool dtype): "bfloat16", or "float32/bfloat16"."""
    q_name, _, pool_name = name.partition("/")
    return getattr(torch, q_name), getattr(torch, pool_name or q_name)


def _decode_case(torch, dtype, impls, batch: int, shared: int, own: tuple[int, int], rng,
                 pool_dtype=None):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.executor.torch.runner import TorchModelRunner
    from sgl_tpu.sampling_params import SamplingParams

    own_lens = ([(own[0] + own[1]) // 2] if batch == 1
                else np.linspace(own[0], own[1], batch).astype(int).tolist())
    pool = _Pool(torch, pool_dtype or dtype, shared + sum(own_lens) + batch * PAGE, rng)
    prefix = pool.pages(shared)
    steps = [SeqStep(token_ids=[0], prefix_len=shared + n - 1,
                     pages=np.concatenate([prefix, pool.pages(n)]),
                     sampling=SamplingParams(temperature=0.0), seed=0, num_output_tokens=1)
             for n in own_lens]
    q = torch.randn(batch, KVH * GROUP, HEAD_DIM).to(dtype)
    fns, outs = {}, {}
    for name, mod in impls.items():
        fake = SimpleNamespace(config=SimpleNamespace(page_size=PAGE),
                               model_config=SimpleNamespace(sliding_window=None), attn=mod,
                               device=torch.device("cpu"), dtype=dtype)
        batch_desc = TorchModelRunner._decode_batch(fake, steps, batch)
        fns[name] = (lambda m, b: lambda: m.decode_attention(q, pool.k, pool.v, b, 0.125))(
            mod, batch_desc)
        outs[name] = fns[name]()
    keys = shared + sum(own_lens) if batch > 1 else shared + own_lens[0]
    kv_bytes = 2 * keys * KVH * HEAD_DIM * pool.k.element_size()
    ctx = {"batch": batch, "context_tokens": [shared + n for n in own_lens][:3],
           "distinct_keys": keys, "kv_bytes": kv_bytes}
    return fns, outs, ctx


def _extend_case(torch, dtype, impls, new: int, prefix: int, rng, pool_dtype=None):
    from sgl_tpu.kernels import paged_attention_torch as sdpa

    pool = _Pool(torch, pool_dtype or dtype, prefix + new, rng)
    seq = sdpa.ExtendSeq(start=0, num_new=new, prefix_len=prefix,
                         slots=sdpa.context_slots(pool.pages(prefix + new), PAGE, prefix + new))
    q = torch.randn(new, KVH * GROUP, HEAD_DIM).to(dtype)
    fns = {name: (lambda m: lambda: m.extend_attention(q, pool.k, pool.v, [seq], 0.125))(mod)
           for name, mod in impls.items()}
    outs = {name: fn() for name, fn in fns.items()}
    # QK^T and PV, 2 FLOPs per MAC, over the keys each query attends (causal)
    attended = sum(prefix + i + 1 for i in range(new))
    return fns, outs, {"new_tokens": new, "prefix": prefix,
                       "flops": 4 * KVH * GROUP * HEAD_DIM * attended}


def _model_steps(args, torch, own: tuple[int, int], baseline) -> list[dict]:
    """The real runner's DECODE steps and one EXTEND step per attention backend, alternating,
    thread clock. The baseline kernel runs in the fused backend's runner, swapped in for its
    own calls (the runner reads `attn` per step)."""
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.loader import load_model
    from sgl_tpu.sampling_params import SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(None)
    batches = [int(b) for b in args.decode_batches.split(",")]
    extend_new, extend_prefix = 256, 1024
    runners = {}
    for name in ("torch-sdpa", "torch-cpu-fused"):
        sargs = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off",
                           dtype="float32", kv_cache_dtype=args.model_kv_cache_dtype,
                           attention_backend=name, page_size=PAGE,
                           max_total_tokens=max(args.shared + max(batches) * (own[1] + PAGE),
                                                extend_prefix + extend_new + PAGE),
                           max_running_requests=max(batches))
        cfg = runner_config(sargs, loaded.config.context_len)
        runners[name] = create_model_runner(loaded.config, loaded.params, cfg)

    def step_fns(mode, steps) -> dict:
        fns = {name: partial(r.forward, mode, steps) for name, r in runners.items()}
        if baseline is not None:
            runner = runners["torch-cpu-fused"]

            def with_baseline():
                own_attn, runner.attn = runner.attn, baseline
                try:
                    return runner.forward(mode, steps)
                finally:
                    runner.attn = own_attn

            fns[BASELINE] = with_baseline
        return fns

    greedy = SamplingParams(temperature=0.0)
    cases = []
    for b in batches:
        lens = ([(own[0] + own[1]) // 2] if b == 1
                else np.linspace(own[0], own[1], b).astype(int).tolist())
        first = 1 + args.shared // PAGE
        prefix, steps = np.arange(1, first), []
        for n in lens:
            pages = np.arange(first, first + -(-n // PAGE))
            first += len(pages)
            steps.append(SeqStep(token_ids=[5], prefix_len=args.shared + n - 1,
                                 pages=np.concatenate([prefix, pages]), sampling=greedy,
                                 seed=0, num_output_tokens=1))
        cases.append(({"phase": "model_decode_step", "batch": b},
                      step_fns(ForwardMode.DECODE, steps)))
    pages = np.arange(1, 1 + -(-(extend_prefix + extend_new) // PAGE))
    step = SeqStep(token_ids=[5] * extend_new, prefix_len=extend_prefix, pages=pages,
                   sampling=greedy, seed=0, num_output_tokens=0)
    cases.append(({"phase": "model_extend_step", "new_tokens": extend_new,
                   "prefix": extend_prefix}, step_fns(ForwardMode.EXTEND, [step])))
    rows = []
    for head, fns in cases:
        times = interleaved(fns, args.repeats, clock=time.thread_time)
        row = {**head, "dtype": "float32", "kv_cache_dtype": args.model_kv_cache_dtype}
        for name, ts in times.items():
            row[name] = {"best_ms": round(1e3 * min(ts), 2),
                         "median_ms": round(1e3 * statistics.median(ts), 2)}
        row["speedup"] = round(min(times["torch-sdpa"]) / min(times["torch-cpu-fused"]), 2)
        if BASELINE in times:
            row["speedup_vs_baseline"] = round(min(times[BASELINE])
                                               / min(times["torch-cpu-fused"]), 2)
        rows.append(row)
        print({k: row.get(k) for k in ("phase", "batch", "speedup", "speedup_vs_baseline")},
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--shared", type=int, default=1312, help="shared prefix tokens (decode)")
    p.add_argument("--own", default="300,700", help="own tokens per sequence, min,max")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--clocks", default="thread,wall")
    p.add_argument("--model-steps", action="store_true",
                   help="also time the default model's whole DECODE step per backend")
    p.add_argument("--model-kv-cache-dtype", default="float32",
                   choices=("float32", "bfloat16", "fp8_e5m2"),
                   help="the --model-steps runners' KV pools")
    p.add_argument("--baseline-source", type=Path, default=None,
                   help="another paged_attention_cpu.cpp to time against (compiled here)")
    p.add_argument("--output", default=None)
    args = p.parse_args()

    import torch

    from sgl_tpu.kernels import backends

    impls = {"torch-sdpa": backends.get_attention_backend("torch-sdpa"),
             "torch-cpu-fused": backends.get_attention_backend("torch-cpu-fused")}
    build_dir = tempfile.TemporaryDirectory(prefix="sgl_tpu_attn_baseline_")
    baseline = None
    if args.baseline_source is not None:
        baseline = impls[BASELINE] = _baseline_backend(args.baseline_source, build_dir.name)
    own = tuple(int(x) for x in args.own.split(","))
    threads = torch.get_num_threads()
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                     "layers": args.layers, "clocks": {},
                     "baseline_source": args.baseline_source.name if args.baseline_source else ""}
    # every call starts with cold caches, as in a model step (other layers' weights and K/V
    # come between two calls of one layer): else the kernel timed second finds a small
    # context's K/V (decode b1: 1.4-2.8 MB) still in L2/L3 from the first
    scratch = torch.zeros(64 << 20, dtype=torch.uint8)

    def scrub() -> None:
        scratch.add_(1)

    for clock_name in args.clocks.split(","):
        clock = {"thread": time.thread_time, "wall": time.perf_counter}[clock_name]
        torch.set_num_threads(1 if clock_name == "thread" else threads)
        rng = np.random.default_rng(0)
        bw = _read_bandwidth(torch, clock)
        out = results["clocks"][clock_name] = {
            "torch_threads": torch.get_num_threads(), "read_gb_per_s": round(bw / 1e9, 2),
            "cases": []}
        for dtype_name in args.dtypes.split(","):
            dtype, pool_dtype = _dtypes(torch, dtype_name)
            cases = [("decode", *_decode_case(torch, dtype, impls, int(b), args.shared, own,
                                              rng, pool_dtype))
                     for b in args.decode_batches.split(",")]
            cases += [("extend", *_extend_case(torch, dtype, impls, 512, 0, rng, pool_dtype)),
                      ("extend", *_extend_case(torch, dtype, impls, 200, 1300, rng,
                                               pool_dtype))]
            for phase, fns, outs, ctx in cases:
                with torch.inference_mode():
                    times = interleaved(fns, args.repeats, clock=clock, before=scrub)
                row = _row(phase, dtype_name, ctx, outs, times, bw, args.layers)
                out["cases"].append(row)
                print({"clock": clock_name, **{k: row.get(k) for k in
                       ("phase", "dtype", "batch", "new_tokens", "speedup",
                        "speedup_vs_baseline", "fused_over_floor")}}, flush=True)
    if args.model_steps:
        results["model_steps"] = _model_steps(args, torch, own, baseline)
    results["load_avg_1m_end"] = os.getloadavg()[0]
    emit(results, args.output)


def _row(phase: str, dtype_name: str, ctx: dict, outs: dict, times: dict, bw: float,
         layers: int) -> dict:
    diff = (outs["torch-sdpa"].float() - outs["torch-cpu-fused"].float()).abs().max()
    row = {"phase": phase, "dtype": dtype_name, **ctx, "max_abs_diff": float(diff)}
    for name, ts in times.items():
        row[name] = {"best_ms": round(1e3 * min(ts), 3),
                     "median_ms": round(1e3 * statistics.median(ts), 3),
                     "step_ms": round(1e3 * min(ts) * layers, 2)}
    best = {name: min(ts) for name, ts in times.items()}
    row["speedup"] = round(best["torch-sdpa"] / best["torch-cpu-fused"], 2)
    if BASELINE in best:
        row["speedup_vs_baseline"] = round(best[BASELINE] / best["torch-cpu-fused"], 2)
    if phase == "decode":
        floor = ctx["kv_bytes"] / bw
        row["floor_ms"] = round(1e3 * floor, 3)
        for name in best:
            key = {"torch-sdpa": "sdpa", "torch-cpu-fused": "fused"}.get(name, "baseline")
            row[f"{key}_over_floor"] = round(best[name] / floor, 2)
    else:
        for name in times:
            row[name]["gflop_per_s"] = round(ctx["flops"] / best[name] / 1e9, 1)
    return row


if __name__ == "__main__":
    main()
