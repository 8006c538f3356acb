"""The executor benches' inputs: `SeqStep`s of random tokens over made-up page tables, and the
named sampling settings of their decode rows.

    make_steps(n_seqs=3, n_new=1, prefix=20, page_size=8, shared=16)
        pages:  seq 0  [1 2 | 3 4]     1 2: the shared prefix pages (whole pages of `prefix`)
                seq 1  [1 2 | 5 6]     then each sequence's own pages, enough for
                seq 2  [1 2 | 7 8]     prefix + n_new tokens; page 0 stays the padding page
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from sgl_tpu.executor.step import SeqStep
from sgl_tpu.sampling_params import SamplingParams

# `top-k`: a kept set always inside the sampler's candidates; `temperature` (OpenAI's default,
# no truncation): drawn over the whole vocabulary; both in the static step's sample tail,
# whatever the logits. `sampled` keeps a nucleus, which is wide on a near-flat random model.
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.9),
            "top-k": dict(temperature=0.7, top_k=40, top_p=0.9),
            "temperature": dict(temperature=1.0)}


def step_sizes(args: argparse.Namespace) -> tuple[list[int], list[int], dict[str, Any]]:
    """--prefill and --decode-batches as ints, and the runner settings that fit them (a KV pool
    for the largest batch at --context tokens each, a chunk for the longest prefill)."""
    prefills = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    max_tokens = max(prefills + [1])
    pool_tokens = max(max_tokens, max(batches + [1]) * (args.context + 16)) + 64
    return prefills, batches, {
        "max_total_tokens": pool_tokens, "chunked_prefill_size": max_tokens,
        "max_running_requests": max(batches + [1]), "max_extend_seqs": 1, "skip_warmup": True}


def make_steps(n_seqs: int, n_new: int, prefix: int, page_size: int, rng: np.random.Generator,
               vocab: int, sampling: str = "greedy", shared: int = 0) -> list[SeqStep]:
    """`n_seqs` steps of `n_new` random tokens after `prefix` cached ones, each on its own pages
    but for the first `shared` prefix tokens (whole pages): the same pages in every sequence
    (agents forking one prompt; attention reads them once for all)."""
    params = SamplingParams(**SAMPLING[sampling])
    if shared % page_size or shared > prefix:
        raise ValueError(f"shared {shared}: whole pages ({page_size}) of the prefix {prefix}")
    common = np.arange(1, 1 + shared // page_size, dtype=np.int32)
    pages_per_seq = -(-(prefix + n_new) // page_size) - len(common)
    first = 1 + len(common)
    steps = []
    for i in range(n_seqs):
        own = np.arange(first + i * pages_per_seq, first + (i + 1) * pages_per_seq,
                        dtype=np.int32)
        steps.append(SeqStep(token_ids=rng.integers(0, vocab, n_new), prefix_len=prefix,
                             pages=np.concatenate([common, own]), sampling=params, seed=i,
                             num_output_tokens=0, return_logprob=False))
    return steps
