"""Torch attention on CPU: `torch-sdpa` (paged_attention_torch) vs `torch-cpu-fused`
(paged_attention_cpu), one layer's call, interleaved in one run.

    python -m sgl_tpu.bench.attention_cpu [--dtypes float32,bfloat16] [--decode-batches 1,8,32]
        [--shared 1312] [--own 300,700] [--repeats 7] [--layers 30] [--clocks thread,wall]
        [--model-steps] [--output FILE]

Shapes are SmolLM2-135M's (3 KV heads x 3 query heads, head_dim 64, page size 16) over a pool
whose pages are handed out in a scattered order, as a radix cache leaves them:

    decode b1        one sequence of shared + the midpoint of --own tokens
    decode b8 / b32  agents: every sequence forks the same `--shared`-token prefix (read once
                     per step by both kernels) and adds its own 300..700 tokens
    extend fresh     512 new tokens, no prefix
    extend turn      200 new tokens on a 1,300-token cached prefix (an agent's next turn)

Each case times both kernels alternately (ABAB..., the machine is shared) and reports the best
and median per call, their ratio, and for decode the memory floor: the K/V bytes a step must
read (each distinct key once per KV head) over the read bandwidth measured in the same run and
clock (`sum` of a 256 MB tensor). `step_ms` multiplies a call by --layers. Two clocks:

    thread  one intra-op thread, CPU time of that thread (`time.thread_time`): what the work
            costs, robust to a loaded machine descheduling the process
    wall    all intra-op threads, wall time: what a step waits for on this machine now (on an
            oversubscribed machine the OpenMP barriers of many small ops inflate it)

`--model-steps` adds the whole DECODE step of the default model (float32 runners, one per
backend, eager), the decode batches above with the same agent contexts, on the thread clock
(the K/V contents do not change the time, so no prefill runs first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from types import SimpleNamespace

import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import interleaved

KVH, GROUP, HEAD_DIM, PAGE = 3, 3, 64, 16


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


def _decode_case(torch, dtype, impls, batch: int, shared: int, own: tuple[int, int], rng):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.executor.torch.runner import TorchModelRunner
    from sgl_tpu.sampling_params import SamplingParams

    own_lens = ([(own[0] + own[1]) // 2] if batch == 1
                else np.linspace(own[0], own[1], batch).astype(int).tolist())
    pool = _Pool(torch, dtype, shared + sum(own_lens) + batch * PAGE, rng)
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


def _extend_case(torch, dtype, impls, new: int, prefix: int, rng):
    from sgl_tpu.kernels import paged_attention_torch as sdpa

    pool = _Pool(torch, dtype, prefix + new, rng)
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


def _model_steps(args, torch, own: tuple[int, int]) -> list[dict]:
    """The real runner's DECODE step per attention backend, alternating, thread clock."""
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.loader import load_model
    from sgl_tpu.sampling_params import SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(None)
    batches = [int(b) for b in args.decode_batches.split(",")]
    runners = {}
    for name in ("torch-sdpa", "torch-cpu-fused"):
        sargs = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off",
                           dtype="float32", attention_backend=name, page_size=PAGE,
                           max_total_tokens=args.shared + max(batches) * (own[1] + PAGE),
                           max_running_requests=max(batches))
        cfg = runner_config(sargs, loaded.config.context_len)
        runners[name] = create_model_runner(loaded.config, loaded.params, cfg)
    rows = []
    for b in batches:
        lens = ([(own[0] + own[1]) // 2] if b == 1
                else np.linspace(own[0], own[1], b).astype(int).tolist())
        first = 1 + args.shared // PAGE
        prefix, steps = np.arange(1, first), []
        for n in lens:
            pages = np.arange(first, first + -(-n // PAGE))
            first += len(pages)
            steps.append(SeqStep(token_ids=[5], prefix_len=args.shared + n - 1,
                                 pages=np.concatenate([prefix, pages]),
                                 sampling=SamplingParams(temperature=0.0), seed=0,
                                 num_output_tokens=1))
        fns = {name: partial(r.forward, ForwardMode.DECODE, steps)
               for name, r in runners.items()}
        times = interleaved(fns, args.repeats, clock=time.thread_time)
        row = {"phase": "model_decode_step", "batch": b, "dtype": "float32"}
        for name, ts in times.items():
            row[name] = {"best_ms": round(1e3 * min(ts), 2),
                         "median_ms": round(1e3 * statistics.median(ts), 2)}
        row["speedup"] = round(min(times["torch-sdpa"]) / min(times["torch-cpu-fused"]), 2)
        rows.append(row)
        print({k: row[k] for k in ("phase", "batch", "speedup")}, flush=True)
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
    p.add_argument("--output", default=None)
    args = p.parse_args()

    import torch

    from sgl_tpu.kernels import backends

    impls = {"torch-sdpa": backends.get_attention_backend("torch-sdpa"),
             "torch-cpu-fused": backends.get_attention_backend("torch-cpu-fused")}
    own = tuple(int(x) for x in args.own.split(","))
    threads = torch.get_num_threads()
    results: dict = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                     "layers": args.layers, "clocks": {}}
    for clock_name in args.clocks.split(","):
        clock = {"thread": time.thread_time, "wall": time.perf_counter}[clock_name]
        torch.set_num_threads(1 if clock_name == "thread" else threads)
        rng = np.random.default_rng(0)
        bw = _read_bandwidth(torch, clock)
        out = results["clocks"][clock_name] = {
            "torch_threads": torch.get_num_threads(), "read_gb_per_s": round(bw / 1e9, 2),
            "cases": []}
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            cases = [("decode", *_decode_case(torch, dtype, impls, int(b), args.shared, own,
                                              rng)) for b in args.decode_batches.split(",")]
            cases += [("extend", *_extend_case(torch, dtype, impls, 512, 0, rng)),
                      ("extend", *_extend_case(torch, dtype, impls, 200, 1300, rng))]
            for phase, fns, outs, ctx in cases:
                with torch.inference_mode():
                    times = interleaved(fns, args.repeats, clock=clock)
                row = _row(phase, dtype_name, ctx, outs, times, bw, args.layers)
                out["cases"].append(row)
                print({"clock": clock_name, **{k: row.get(k) for k in
                       ("phase", "dtype", "batch", "new_tokens", "speedup",
                        "fused_over_floor")}}, flush=True)
    if args.model_steps:
        results["model_steps"] = _model_steps(args, torch, own)
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
    if phase == "decode":
        floor = ctx["kv_bytes"] / bw
        row["floor_ms"] = round(1e3 * floor, 3)
        row["fused_over_floor"] = round(best["torch-cpu-fused"] / floor, 2)
        row["sdpa_over_floor"] = round(best["torch-sdpa"] / floor, 2)
    else:
        for name in times:
            row[name]["gflop_per_s"] = round(ctx["flops"] / best[name] / 1e9, 1)
    return row


if __name__ == "__main__":
    main()
