"""OpenMP waiting (`--omp-spin-count`) against other load on the CPUs: the in-process decode ITL
of one batch per spin count, on an idle machine and next to busy processes, in one invocation.

    python -m sgl_tpu.bench.omp_wait [--spin-counts 0,1000] [--loads idle,bursty,busy1,busy2]
        [--batch 1] [--shared-tokens 1200] [--own-tokens 56] [--output-tokens 200]
        [--rounds 2] [--output omp_wait.json]

libgomp reads its spin count once, when torch loads, so every (load, spin count) runs in a
fresh Python (`--child`): an `Engine` with that `--omp-spin-count` decodes the batch greedily
(serve_gap's in-process path: one shared prefix cached first, then `--batch` requests of it
plus own tokens) and reports the ITL p50. Loads, started before the child and stopped after:
`idle` none; `bursty` one process busy 2 ms of every 6.5 (a detokenizer- or client-like
neighbour, ~30% of a core); `busyN` N processes spinning without pause. Rounds repeat the
whole grid (spin counts alternate in order); the JSON reports each run and, per load, the
median ITL per spin count and its ratio to the first spin count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from sgl_tpu.bench.report import emit

BURSTY = ("import time\nwhile True:\n    t = time.perf_counter()\n"
          "    while time.perf_counter() - t < 0.002: pass\n    time.sleep(0.0045)\n")
BUSY = "while True: pass\n"


def load_processes(load: str) -> list[subprocess.Popen]:
    """Start the neighbours of `load` ('idle', 'bursty' or 'busyN')."""
    if load == "idle":
        codes = []
    elif load == "bursty":
        codes = [BURSTY]
    elif load.startswith("busy") and load[4:].isdigit():
        codes = [BUSY] * int(load[4:])
    else:
        raise ValueError(f"unknown load {load!r}: idle, bursty or busyN")
    return [subprocess.Popen([sys.executable, "-c", code]) for code in codes]


def child(args: argparse.Namespace) -> dict:
    """One Engine at `args.spin`: the batch's in-process ITL (after one warm-up round)."""
    from sgl_tpu.bench.serve_gap import make_prompts, run_in_process
    from sgl_tpu.engine import Engine

    engine = Engine(args.model_path, omp_spin_count=args.spin, speculative_algorithm="none",
                    skip_warmup=True)
    try:
        vocab = engine.model_config.vocab_size
        run_in_process(engine, *make_prompts(args, vocab, seed=0), 16)  # warm-up
        return run_in_process(engine, *make_prompts(args, vocab, seed=1), args.output_tokens)
    finally:
        engine.shutdown()


def run_child(args: argparse.Namespace, spin: int) -> dict:
    cmd = [sys.executable, "-m", "sgl_tpu.bench.omp_wait", "--child", "--spin", str(spin),
           "--batch", str(args.batch), "--shared-tokens", str(args.shared_tokens),
           "--own-tokens", str(args.own_tokens), "--output-tokens", str(args.output_tokens)]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    spins = [int(x) for x in args.spin_counts.split(",")]
    loads = args.loads.split(",")
    runs = []
    for r in range(args.rounds):
        for load in loads:
            order = spins if r % 2 == 0 else spins[::-1]
            neighbours = load_processes(load)
            try:
                time.sleep(1.0)  # the neighbours running before the Engine starts
                for spin in order:
                    row = {"round": r, "load": load, "spin_count": spin,
                           **run_child(args, spin)}
                    runs.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                for p in neighbours:
                    p.kill()
                    p.wait()
    summary = {}
    for load in loads:
        med = {s: statistics.median(x["itl_p50_ms"] for x in runs
                                    if x["load"] == load and x["spin_count"] == s)
               for s in spins}
        summary[load] = {"itl_p50_ms": {str(s): round(v, 2) for s, v in med.items()},
                         "vs_first": {str(s): round(v / med[spins[0]], 3)
                                      for s, v in med.items()}}
    return {"args": vars(args), "runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--spin-counts", default="0,1000")
    p.add_argument("--loads", default="idle,bursty,busy1,busy2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--shared-tokens", type=int, default=1200)
    p.add_argument("--own-tokens", type=int, default=56)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spin", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
