"""Sampler micro-benchmark: the torch sampler alone, greedy against sampled, on real logits.

    python -m sgl_tpu.bench.sampler [--batches 8,32] [--repeats 15] [--threads 2]
        [--baseline FILE] [--logprob-rows none,all] [--masks none,ban,grammar]
        [--model-path PATH]

Logits: `peaked` are the default model's next-token logits at every position of a fixed English
paragraph (real, mostly confident predictions); `flat` are standard-normal logits of the same
vocabulary (a nucleus of tens of thousands of tokens). Rows are picked from them per batch.
Modes: `greedy` (temperature 0) and `sampled` (temperature 0.7, top-p 0.9, seeded). Masks
(every row's vocabulary bitmask): `none`; `ban`, all tokens but BANNED_IDS (as min_new_tokens
bans EOS and stop ids before a length-forced answer's end); `grammar`, one token in 7 (a dense
mask, as a grammar's). `--baseline`
names another sampler module file with the same `sample` function (e.g. an older version) to time
in the same run; every configuration alternates the implementations (ABAB...; each timed call
follows an untimed one of the same call, as in decoding, so no call pays for the buffers the
previous one freed) and reports median milliseconds, sampled/greedy ratios per implementation
and baseline/current ratios. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import time
from types import ModuleType

import numpy as np

from sgl_tpu.bench.report import emit

TEXT = (
    "The scheduler keeps a queue of waiting requests and a batch of running ones. At every step "
    "it first admits new requests whose prompts fit in the token budget, reusing any prefix "
    "that is already in the radix cache, and then decodes one token for each running request. "
    "When memory runs out, the most recent request is sent back to the queue and its pages are "
    "freed. Agents send many short turns that share a long history, so most of their prompt is "
    "found in the cache and only the new tool output has to be computed before decoding starts."
)
MODES = {"greedy": dict(temperature=0.0, top_p=1.0), "sampled": dict(temperature=0.7, top_p=0.9)}
MASKS = ("none", "ban", "grammar")
BANNED_IDS = (0, 2)  # the default model's <|endoftext|> and <|im_end|>


def real_logits(model_path: str | None) -> np.ndarray:
    """f32[N, V]: the default model's logits at each position of TEXT (torch backend)."""
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.loader import load_model
    from sgl_tpu.sampling_params import SamplingParams

    loaded = load_model(model_path)
    ids = loaded.tokenizer.encode(TEXT)
    sargs = ServerArgs(model_path=model_path, dtype="float32", skip_warmup=True,
                       max_total_tokens=len(ids) + 64, chunked_prefill_size=len(ids),
                       max_running_requests=1, max_extend_seqs=1, backend="torch",
                       torch_compile="off")
    runner = create_model_runner(loaded.config, loaded.params,
                                 runner_config(sargs, loaded.config.context_len))
    pages = np.arange(1, 1 + -(-len(ids) // sargs.page_size))
    step = SeqStep(token_ids=ids, prefix_len=0, pages=pages, sampling=SamplingParams(),
                   seed=0, num_output_tokens=0, sample_valid=False)
    result = runner.forward(ForwardMode.EXTEND, [step])
    return runner.row_logits(result.hidden, np.arange(len(ids))).astype(np.float32)


def load_sampler(path: str | None) -> ModuleType:
    if path is None:
        from sgl_tpu.executor.torch import sampler
        return sampler
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mask_bitmask(mask: str, batch: int, vocab: int):
    """i32[batch, ceil(vocab / 32)] for a MASKS name (None for `none`)."""
    import torch

    if mask == "none":
        return None
    allowed = np.zeros(-(-vocab // 32) * 32, bool)
    if mask == "ban":
        allowed[:vocab] = True
        allowed[list(BANNED_IDS)] = False
    else:
        allowed[:vocab:7] = True
    words = np.packbits(allowed, bitorder="little").view("<i4")
    return torch.from_numpy(np.ascontiguousarray(np.broadcast_to(words, (batch, len(words)))))


def make_call(module: ModuleType, logits, mode: str, logprob_rows: str, num_top: int,
              mask: str = "none"):
    """A no-argument closure running one `module.sample` on `logits` [B, V]."""
    import torch

    batch = logits.shape[0]
    knobs = MODES[mode]
    kwargs = dict(
        temperature=torch.full((batch,), knobs["temperature"]),
        top_p=torch.full((batch,), knobs["top_p"]),
        top_k=torch.full((batch,), -1, dtype=torch.long),
        min_p=torch.zeros(batch),
        uniforms=torch.from_numpy(module.row_uniforms(np.arange(batch, dtype=np.uint32),
                                                      np.zeros(batch, np.int32))),
        penalties=None, num_top_logprobs=num_top,
        bitmask=mask_bitmask(mask, batch, logits.shape[1]))
    if "logprob_rows" in inspect.signature(module.sample).parameters:
        kwargs["logprob_rows"] = torch.full((batch,), logprob_rows == "all")
    return lambda: module.sample(logits, **kwargs)


def run(args: argparse.Namespace) -> dict:
    import torch

    peaked = real_logits(args.model_path)
    torch.set_num_threads(args.threads)  # after the runner, which sets its own count
    vocab = peaked.shape[1]
    flat = np.random.default_rng(0).standard_normal((max(args.batches_list), vocab),
                                                    dtype=np.float32)
    impls = {"current": load_sampler(None)}
    if args.baseline:
        impls["baseline"] = load_sampler(args.baseline)
    rng = np.random.default_rng(1)
    results: dict = {"vocab": vocab, "peaked_positions": len(peaked), "threads": args.threads,
                     "cpu_count": os.cpu_count(), "repeats": args.repeats, "runs": []}
    for kind, source in (("peaked", peaked), ("flat", flat)):
        for batch in args.batches_list:
            rows = rng.choice(len(source), batch, replace=len(source) < batch)
            logits = torch.from_numpy(np.ascontiguousarray(source[rows]))
            for lp_rows, mask in [(lp, mk) for lp in args.logprob_rows.split(",")
                                  for mk in args.masks.split(",")]:
                if mask not in MASKS:
                    raise SystemExit(f"--masks: each of {MASKS}, got {mask!r}")
                calls = {(name, mode): make_call(m, logits, mode, lp_rows, args.num_top, mask)
                         for name, m in impls.items() for mode in MODES}
                times: dict = {key: [] for key in calls}
                for fn in calls.values():
                    fn()  # warm
                for _ in range(args.repeats):  # interleaved: A B A B ...
                    for key, fn in calls.items():
                        fn()  # untimed: the allocator in the state of repeated calls of fn
                        t0 = time.perf_counter()
                        fn()
                        times[key].append(time.perf_counter() - t0)
                ms = {f"{name}_{mode}": round(1e3 * statistics.median(t), 3)
                      for (name, mode), t in times.items()}
                row = {"logits": kind, "batch": batch, "logprob_rows": lp_rows, "mask": mask,
                       "median_ms": ms}
                for name in impls:
                    row[f"{name}_sampled_over_greedy"] = round(
                        ms[f"{name}_sampled"] / ms[f"{name}_greedy"], 2)
                if "baseline" in impls:
                    for mode in MODES:
                        row[f"baseline_over_current_{mode}"] = round(
                            ms[f"baseline_{mode}"] / ms[f"current_{mode}"], 2)
                results["runs"].append(row)
                print(row, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-top", type=int, default=20, help="top log-probs per row")
    p.add_argument("--logprob-rows", default="none",
                   help="comma list of none/all: which rows ask for log-probs")
    p.add_argument("--masks", default="none",
                   help="comma list of none/ban/grammar: no vocabulary mask, a few ids "
                   "banned, or a dense mask")
    p.add_argument("--baseline", default=None, help="another sampler module file to compare")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.batches_list = [int(x) for x in args.batches.split(",") if x]
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
