"""Torch tensor parallelism on the CPU: decode cost per token of `--tp-size N` against one
device, and how much of a TP step is spent in collectives.

    python -m sgl_tpu.bench.tp_torch [--tp 3] [--batches 1,8] [--context 256] [--steps 16]
        [--rounds 3] [--dtype float32] [--torch-threads 0] [--output FILE]

One process holds both runners: a single-device `TorchModelRunner` and rank 0 of a local
group of N ranks (`start_torch_tp`: N-1 follower processes over gloo). Their decode steps
alternate in rounds (single, TP, single, TP, ...) so that load on the shared machine hits both
alike; each round sets that side's thread count first (`--torch-threads`, 0 = every CPU, for
the single device; every rank gets CPUs // N) and runs one untimed step after the switch.

A last pass splits rank 0's TP decode step into time inside collectives (wall-clock timers
around each all-reduce / all-gather: enqueue plus the wait for the slowest rank) and the rest,
and runs the same steps under the torch profiler. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np

from sgl_tpu.bench.report import emit


def _decode_steps(batch: int, context: int, page_size: int, vocab: int, seed: int):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    per_seq = -(-(context + 1) // page_size)
    greedy = SamplingParams(temperature=0.0)
    return [SeqStep(token_ids=[int(rng.integers(vocab))], prefix_len=context,
                    pages=np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq), sampling=greedy,
                    seed=i, num_output_tokens=0, return_logprob=False) for i in range(batch)]


def _time_steps(runner, steps, n: int, threads: int) -> float:
    """Median seconds of one DECODE step over `n` steps, after one untimed step."""
    import torch

    from sgl_tpu.executor.step import ForwardMode

    torch.set_num_threads(threads)
    runner.forward(ForwardMode.DECODE, steps)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        runner.forward(ForwardMode.DECODE, steps)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective_share(runner, steps, n: int, threads: int) -> dict:
    """`n` TP decode steps on rank 0, split into time inside collectives and the rest, two
    ways: wall-clock timers around every all-reduce / all-gather call (enqueue and wait for the
    other ranks), and the torch profiler's c10d op times (gloo's wait may fall outside them)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.parallel import torch_tp

    spent = {"all_reduce": 0.0, "all_gather": 0.0}
    calls = {"all_reduce": 0, "all_gather": 0}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return out
        return call

    torch.set_num_threads(threads)
    runner.forward(ForwardMode.DECODE, steps)
    reduce, gather = torch_tp._all_reduce, dist.all_gather
    torch_tp._all_reduce, dist.all_gather = timed("all_reduce", reduce), timed("all_gather",
                                                                              gather)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            runner.forward(ForwardMode.DECODE, steps)
        wall = time.perf_counter() - t0
    finally:
        torch_tp._all_reduce, dist.all_gather = reduce, gather
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t1 = time.perf_counter()
        for _ in range(n):
            runner.forward(ForwardMode.DECODE, steps)
        wall_profiled = time.perf_counter() - t1
    op_us = {ev.key: ev.cpu_time_total for ev in prof.key_averages()
             if ev.key.lower().startswith("c10d::")
             and ("allreduce" in ev.key.lower() or "allgather" in ev.key.lower())}
    step_ms = 1e3 * wall / n
    comm_ms = 1e3 * sum(spent.values()) / n
    prof_ms = sum(op_us.values()) / 1e3 / n
    return {"steps": n, "step_ms": round(step_ms, 2),
            "collective_calls_per_step": {k: v // n for k, v in calls.items()},
            "collective_ms_per_step": round(comm_ms, 2),
            "collective_fraction": round(comm_ms / step_ms, 3),
            "rest_ms_per_step": round(step_ms - comm_ms, 2),
            "profiler": {"step_ms": round(1e3 * wall_profiled / n, 2),
                         "c10d_op_ms_per_step": round(prof_ms, 2),
                         "ops": {k: round(v / 1e3 / n, 3) for k, v in sorted(op_us.items())}}}


def run(args: argparse.Namespace) -> dict:
    import torch

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.loader import load_model
    from sgl_tpu.parallel.torch_launch import start_torch_tp

    loaded = load_model(args.model_path)
    cfg = loaded.config
    batches = [int(b) for b in args.batches.split(",") if b]
    sargs = ServerArgs(model_path=args.model_path, backend="torch", dtype=args.dtype,
                       torch_compile="off", skip_warmup=True, tp_size=args.tp,
                       max_running_requests=max(batches),
                       max_total_tokens=max(batches) * (args.context + 32) + 64,
                       torch_threads=args.torch_threads, log_level="warning")
    rcfg = runner_config(sargs, cfg.context_len)
    # Both dense (TP slices dense weights; `auto` would give the single device GGUF kernels).
    single = create_model_runner(cfg, loaded.params,
                                 dataclasses.replace(rcfg, tp_size=1, quantization="none"))
    single_threads = torch.get_num_threads()
    tp = start_torch_tp(sargs, cfg, loaded.params, loaded.model_path, rcfg)
    rank_threads = tp.config.cpu_threads
    results: dict = {"model": os.path.relpath(loaded.model_path), "dtype": args.dtype,
                     "cpu_count": len(os.sched_getaffinity(0)), "context": args.context,
                     "tp": args.tp, "threads_single": single_threads,
                     "threads_per_rank": rank_threads,
                     "load_average_1m_start": round(os.getloadavg()[0], 1), "runs": []}
    try:
        for b in batches:
            steps = _decode_steps(b, args.context, sargs.page_size, cfg.vocab_size, b)
            t_single, t_tp = [], []
            for _ in range(args.rounds):
                t_single.append(_time_steps(single, steps, args.steps, single_threads))
                t_tp.append(_time_steps(tp, steps, args.steps, rank_threads))
            one, many = statistics.median(t_single), statistics.median(t_tp)
            row = {"batch": b, "tp1_step_ms": round(1e3 * one, 2),
                   f"tp{args.tp}_step_ms": round(1e3 * many, 2),
                   "tp1_ms_per_token": round(1e3 * one / b, 3),
                   f"tp{args.tp}_ms_per_token": round(1e3 * many / b, 3),
                   f"tp{args.tp}_over_tp1": round(many / one, 3),
                   "profile": _collective_share(tp, steps, args.steps, rank_threads)}
            results["runs"].append(row)
            print(row, flush=True)
    finally:
        tp.close()
    results["load_average_1m_end"] = round(os.getloadavg()[0], 1)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--torch-threads", type=int, default=0,
                   help="threads of the single-device runner (0 = every CPU)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
