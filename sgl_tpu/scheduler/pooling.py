"""Embedding requests: a prompt's hidden states (after the model's final norm, before the LM
head) pooled into one vector, by `--pooling`. The registry of methods:

    last  the last prompt token's row: in a decoder the only one that attends to the whole
          prompt (the default; what decoder embedding models such as e5-mistral and
          gte-Qwen2 are trained on)
    mean  the mean of every prompt token's row
    cls   the first prompt token's row (encoder models' [CLS])

An embedding request is a prefill-only request (max_new_tokens 0) in the ordinary EXTEND
batches. Its prompt may run over several steps (chunked prefill), so each step adds the rows it
computed to the request's running sum (`collect_pooled`), and the answer is read when the
prompt is complete (`pooled`):

    positions  0  1  2 ... k-1 | k ... 2k-1 | ... | P-1      (P prompt tokens, chunks of k)
    last                                             ^
    mean       +  +  +  ... +  | +  ...  +  | ... | +      -> sum / P
    cls        ^

`last` reads only the final row, which always runs (`Req.max_prefix_len` leaves at least one
token to compute), so its requests reuse cached prefixes like any other. `mean` and `cls` read
rows that a prefix hit would skip, and the cache holds K/V, not hidden states: their requests
match no prefix (`Req.needs_prefix_rows`), and their KV still enters the radix cache when they
finish, for later requests to reuse. The vector is float32 and not normalized; the HTTP side
normalizes it (or not: the request's `normalize`) and truncates it (`dimensions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sgl_tpu.executor.step import ModelRunner, StepResult
from sgl_tpu.scheduler.req import Req


@dataclass(frozen=True)
class PoolingMethod:
    # (first position of the step, tokens it runs, prompt length) -> the positions it reads
    positions: Callable[[int, int, int], range]
    needs_prefix_rows: bool  # reads rows a cached prefix would skip: match no prefix
    mean: bool = False  # the sum is divided by the prompt length


POOLING_METHODS: dict[str, PoolingMethod] = {
    "last": PoolingMethod(lambda start, n, prompt_len: range(prompt_len - 1, prompt_len)
                          if start + n == prompt_len else range(0), needs_prefix_rows=False),
    "mean": PoolingMethod(lambda start, n, prompt_len: range(start, start + n),
                          needs_prefix_rows=True, mean=True),
    "cls": PoolingMethod(lambda start, n, prompt_len: range(0, 1) if start == 0 else range(0),
                         needs_prefix_rows=True),
}


def collect_pooled(batch: list[tuple[Req, int]], result: StepResult,
                   runner: ModelRunner) -> None:
    """Add to each embedding request's running sum the rows of this step its method reads
    (`batch`: (request, tokens it ran) in packed order; kv_len not yet advanced). A request
    whose prompt starts in this step starts a new sum (it may have been computed before and
    retracted)."""
    rows: list[int] = []
    spans: list[tuple[Req, int, int]] = []  # (request, its first entry in rows, how many)
    t = 0
    for req, n in batch:
        if req.pooling is not None:
            method = POOLING_METHODS[req.pooling]
            positions = method.positions(req.kv_len, n, req.prompt_len)
            spans.append((req, len(rows), len(positions)))
            rows += [t + p - req.kv_len for p in positions]
        t += n
    hidden = runner.hidden_rows(result.hidden, np.asarray(rows, np.int64)) if rows else None
    for req, first, count in spans:
        if req.kv_len == 0:
            req.pooled_sum = None
        if count:
            part = hidden[first : first + count].sum(axis=0, dtype=np.float64)  # [D]
            req.pooled_sum = part if req.pooled_sum is None else req.pooled_sum + part


def pooled(req: Req) -> list[float]:
    """The finished embedding request's vector (float32 values)."""
    total = req.pooled_sum
    if total is None:
        raise RuntimeError(f"embedding request {req.rid}: no hidden state was pooled")
    if POOLING_METHODS[req.pooling].mean:
        total = total / req.prompt_len
    return total.astype(np.float32).tolist()
