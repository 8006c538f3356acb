"""What a speculative verify costs: a DECODE step whose B sequences each take k + 1 rows (the
last token and k draft tokens, `scheduler/speculative.py`) against the plain step of B rows.

    python -m sgl_tpu.bench.speculative [--backend torch] [--batches 1,4,8] [--drafts 1,2,4,8]
        [--shared 1200] [--own 100] [--repeats 9] [--output FILE]

The sequences share a `--shared`-token prompt (an agent's system prompt, radix-cached) and own
`--own` tokens each, as in the agent-loop workloads. Each round runs every variant once, in
turn, so a busy host slows them alike; the report gives each variant's median over the plain
step (`over_plain`) and the cost of one extra row per sequence (`row_cost` =
(over_plain - 1) / k), the number the draft-length rule weighs against the expected kept
tokens: a draft of k tokens pays when 1 + accepted > over_plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from sgl_tpu.bench.report import emit


def _rows(b: int, k: int, shared: int, own: int, page_size: int, vocab: int, rng):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0)
    shared_pages = np.arange(1, 1 + shared // page_size)
    per_seq = -(-(own + k + 1) // page_size)
    first = 1 + len(shared_pages)
    steps = []
    for i in range(b):
        own_pages = np.arange(first + i * per_seq, first + (i + 1) * per_seq)
        pages = np.concatenate([shared_pages, own_pages])
        for j in range(k + 1):
            steps.append(SeqStep(token_ids=[int(rng.integers(0, vocab))],
                                 prefix_len=shared + own + j, pages=pages, sampling=params,
                                 seed=i, num_output_tokens=j, sample_valid=False,
                                 return_logprob=False))
    return steps


def run(args: argparse.Namespace) -> dict:
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    batches = [int(x) for x in args.batches.split(",")]
    drafts = [int(x) for x in args.drafts.split(",")]
    max_rows = max(b * (k + 1) for b in batches for k in drafts)
    sargs = ServerArgs(model_path=args.model_path, backend=args.backend, skip_warmup=True,
                       max_running_requests=max(64, max_rows),
                       max_total_tokens=args.shared + max(batches) * (args.own + 80) + 256)
    rcfg = runner_config(sargs, cfg.context_len)
    runner = create_model_runner(cfg, loaded.params, rcfg)
    rng = np.random.default_rng(0)
    model = loaded.model_path
    if os.path.abspath(model).startswith(os.getcwd() + os.sep):
        model = os.path.relpath(model)  # results are committed: no machine-specific paths
    out: dict = {"model": model, "backend": rcfg.backend, "dtype": rcfg.dtype,
                 "cpu_count": os.cpu_count(), "shared_tokens": args.shared,
                 "own_tokens": args.own, "repeats": args.repeats, "runs": []}
    for b in batches:
        variants = {k: _rows(b, k, args.shared, args.own, sargs.page_size, cfg.vocab_size, rng)
                    for k in [0, *drafts]}
        for steps in variants.values():
            runner.forward(ForwardMode.DECODE, steps)  # warm
        times: dict[int, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for k, steps in variants.items():
                t0 = time.perf_counter()
                runner.forward(ForwardMode.DECODE, steps)
                times[k].append(time.perf_counter() - t0)
        plain = statistics.median(times[0])
        for k, ts in times.items():
            med = statistics.median(ts)
            row = {"batch": b, "draft_tokens": k, "rows": b * (k + 1),
                   "median_ms": round(1e3 * med, 2), "over_plain": round(med / plain, 3)}
            if k:
                row["row_cost"] = round((med / plain - 1) / k, 3)
            out["runs"].append(row)
            print(row, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--drafts", default="1,2,4,8")
    p.add_argument("--shared", type=int, default=1200)
    p.add_argument("--own", type=int, default=100)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
