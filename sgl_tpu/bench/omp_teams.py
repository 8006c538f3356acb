"""One OpenMP team or two: a torch CPU op's time on the first thread that runs parallel regions,
then on it and on a second thread once both have run them, per spin count, in one invocation.

    python -m sgl_tpu.bench.omp_teams [--spin-counts 0,1000] [--shape 1,576,1536]
        [--repeats 2000] [--output omp_teams.json]

libgomp gives every thread that starts a parallel region a team of pool threads of its own.
With two such threads (the scheduler's and an overlap worker's) the teams together can hold
more threads than the machine has CPUs (two teams of two on two cores), and libgomp then spins
only its throttled count between regions. Each spin count runs in a fresh Python (libgomp reads
`GOMP_SPINCOUNT` once, when torch loads; `--child`): a bf16 linear of `--shape` (rows, in,
out) timed on the main thread alone (`first`), on a worker thread (`second`), and on the main
thread again (`first_again`); the median of 5 batches of `--repeats` calls each, in us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from sgl_tpu.bench.report import emit


def child(args: argparse.Namespace) -> dict:
    """This process (GOMP_SPINCOUNT already in its environment): the three timings."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from sgl_tpu.executor.torch.device import set_cpu_threads

    threads = set_cpu_threads(0)
    rows, d_in, d_out = (int(x) for x in args.shape.split(","))
    x = torch.randn(rows, d_in, dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, dtype=torch.bfloat16)

    def time_us() -> float:
        for _ in range(50):
            torch.nn.functional.linear(x, w)
        batches = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                torch.nn.functional.linear(x, w)
            batches.append((time.perf_counter() - t0) / args.repeats * 1e6)
        return round(statistics.median(batches), 1)

    first = time_us()
    with ThreadPoolExecutor(1) as worker:
        second = worker.submit(time_us).result()
        first_again = time_us()
    return {"spin_count": os.environ.get("GOMP_SPINCOUNT"), "threads": threads,
            "first_us": first, "second_us": second, "first_again_us": first_again}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spin-counts", default="0,1000")
    p.add_argument("--shape", default="1,576,1536", help="rows,in,out of the bf16 linear")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = []
    for spin in args.spin_counts.split(","):
        env = {**os.environ, "GOMP_SPINCOUNT": spin.strip()}
        env.pop("OMP_WAIT_POLICY", None)
        out = subprocess.run([sys.executable, "-m", "sgl_tpu.bench.omp_teams", "--child",
                              "--shape", args.shape, "--repeats", str(args.repeats)],
                             env=env, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    emit({"shape": args.shape, "cpu_count": os.cpu_count(), "runs": runs}, args.output)


if __name__ == "__main__":
    main()
