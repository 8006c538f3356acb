"""Where a torch step's time goes: the executor bench's decode rows (`python -m
sgl_tpu.bench.executor`, the same flags; torch only) with a `torch.profiler` summary of
--repeats calls of each row's step under `profile`.

    python tools/torch_profile.py [--model-path PATH] [--dtypes bfloat16] [--prefill ""]
        [--decode-batches 1,64] [--context 1024] [--repeats 5]
        [--torch-decode-paths packing,static] [--count-calls] [--output FILE]

    fn() x steps under torch.profiler (CPU, plus CUDA where available)
        -> key_averages(): per operator, self CPU time, self device time, calls
        -> per step: host ms (self CPU time of all operators), device ms (self device time
           of all kernels; 0 without a device), operator calls, kernel launches, CUDA graph
           replays, and the top operators by the time that bounds the step (device time on
           a device, else CPU time)

On a CPU the operators' CPU time is the step (the kernels run inside them); on a GPU the host
time is what launches the kernels, and a replayed CUDA graph shows as one `cudaGraphLaunch`
with its kernels' device time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from sgl_tpu.bench import executor
from sgl_tpu.bench.report import emit


def _device_us(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(fn: Callable[[], Any], steps: int = 10, top: int = 12) -> dict[str, Any]:
    """Profile `steps` calls of fn (warm already); -> per-step summary (see the module doc)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if on_cuda:
            torch.cuda.synchronize()
    events = list(prof.key_averages())
    cpu_us = sum(e.self_cpu_time_total for e in events)
    device_us = sum(_device_us(e) for e in events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                         "cudaLaunchKernelExC"))
    replays = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    by_device = device_us > 0
    ranked = sorted(events, key=_device_us if by_device else (lambda e: e.self_cpu_time_total),
                    reverse=True)[:top]
    return {
        "steps": steps,
        "host_ms_per_step": round(cpu_us / 1e3 / steps, 3),
        "device_ms_per_step": round(device_us / 1e3 / steps, 3),
        "op_calls_per_step": round(sum(e.count for e in events) / steps, 1),
        "kernel_launches_per_step": round(launches / steps, 1),
        "graph_replays_per_step": round(replays / steps, 1),
        "ranked_by": "device" if by_device else "cpu",
        "top": [{"op": e.key, "calls_per_step": round(e.count / steps, 2),
                 "self_ms_per_step": round((_device_us(e) if by_device
                                            else e.self_cpu_time_total) / 1e3 / steps, 4)}
                for e in ranked],
    }


def main(argv: list[str] | None = None) -> None:
    args = executor.build_parser().parse_args(argv)
    if args.backends != "torch":
        args.backends = "torch"
        print("torch_profile: --backends torch", file=sys.stderr)
    results = executor.run(args, {"profile": lambda fn: profile_step(fn, args.repeats)})
    emit(results, args.output)


if __name__ == "__main__":
    main()
