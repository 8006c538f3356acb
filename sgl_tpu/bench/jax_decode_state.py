"""JAX decode steps with and without the device-resident batch state
(`RunnerConfig.jax_decode_state`, executor/jax/decode_state.py), in one run:

    python -m sgl_tpu.bench.jax_decode_state [--model-path PATH] [--batches 1,8,32]
        [--context 256] [--steps 40] [--sampling greedy|sampled] [--output FILE]

Two runners of the same model (packing path, state path) each decode their own batch of `b`
sequences as a server would (each step's input = the token the last one sampled, one position
further; a new page whenever a sequence crosses one), alternating step by step (ABAB...) so a
load change hits both alike. Reports per batch the median step time of each path (a `forward`:
host packing or row diff, dispatch, device step, tokens back) and the batch-input bytes each
copied host -> device per step. The first two steps of each path (compilation) are not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np

from sgl_tpu.bench.report import emit, model_label

SAMPLING = {"greedy": dict(temperature=0.0),
            "sampled": dict(temperature=0.7, top_p=0.9, frequency_penalty=0.2)}


class _Batch:
    """b sequences decoding from `context` cached tokens, advanced by each step's tokens."""

    def __init__(self, b: int, context: int, steps: int, page_size: int, vocab: int,
                 sampling: dict, rng) -> None:
        from sgl_tpu.executor.step import SeqStep
        from sgl_tpu.sampling_params import SamplingParams

        params = SamplingParams(**sampling)
        per_seq = -(-(context + steps + 2) // page_size)
        self.page_size = page_size
        self.pages = [np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq) for i in range(b)]
        self.steps = [SeqStep(token_ids=[int(t)], prefix_len=context, pages=self.pages[i],
                              sampling=params, seed=i, num_output_tokens=0, counts_row=i + 1,
                              return_logprob=False)
                      for i, t in enumerate(rng.integers(0, vocab, b))]

    def current(self) -> list:
        ps = self.page_size
        for st, pages in zip(self.steps, self.pages, strict=True):
            st.pages = pages[: -(-(st.prefix_len + 1) // ps)]  # pages covering its context
        return self.steps

    def advance(self, token_ids: np.ndarray) -> None:
        self.steps = [dataclasses.replace(st, token_ids=[int(t)], prefix_len=st.prefix_len + 1,
                                          num_output_tokens=st.num_output_tokens + 1)
                      for st, t in zip(self.steps, token_ids, strict=True)]


def run(args: argparse.Namespace) -> dict:
    import jax

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.jax.runner import JaxModelRunner
    from sgl_tpu.executor.registry import runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    batches = [int(x) for x in args.batches.split(",") if x]
    sargs = ServerArgs(model_path=args.model_path, backend="jax", dtype=args.dtype,
                       skip_warmup=True,
                       max_total_tokens=max(batches) * (args.context + args.steps + 64),
                       max_running_requests=max(batches), max_extend_seqs=1)
    rcfg = runner_config(sargs, cfg.context_len)
    runners = {path: JaxModelRunner(cfg, loaded.params,
                                    dataclasses.replace(rcfg, jax_decode_state=path == "state"))
               for path in ("packing", "state")}
    results: dict = {"model": model_label(loaded.model_path), "jax_platform": jax.default_backend(),
                     "dtype": rcfg.dtype, "context": args.context, "sampling": args.sampling,
                     "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "runs": []}
    for b in batches:
        batch = {p: _Batch(b, args.context, args.steps, rcfg.page_size, cfg.vocab_size,
                           SAMPLING[args.sampling], np.random.default_rng(b))
                 for p in runners}
        times: dict[str, list[float]] = {p: [] for p in runners}
        copied: dict[str, list[int]] = {p: [] for p in runners}
        for i in range(args.steps + 2):
            for path, runner in runners.items():
                steps = batch[path].current()
                before = runner.h2d_bytes
                t0 = time.perf_counter()
                res = runner.forward(ForwardMode.DECODE, steps)
                if i >= 2:
                    times[path].append(time.perf_counter() - t0)
                    copied[path].append(runner.h2d_bytes - before)
                batch[path].advance(res.token_ids)
        same = [st.token_ids for st in batch["packing"].steps] == [
            st.token_ids for st in batch["state"].steps]
        med = {p: statistics.median(t) for p, t in times.items()}
        row = {"batch": b, "steps": args.steps, "same_tokens": same,
               **{f"{p}_median_ms": round(1e3 * m, 2) for p, m in med.items()},
               "state_over_packing": round(med["state"] / med["packing"], 3),
               **{f"{p}_h2d_bytes_per_step": round(statistics.mean(c), 1)
                  for p, c in copied.items()},
               "state_steps_copying_nothing": sum(c == 0 for c in copied["state"])}
        results["runs"].append(row)
        print(row, flush=True)
    results["load_avg_after"] = os.getloadavg()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sampling", default="greedy", choices=tuple(SAMPLING))
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
