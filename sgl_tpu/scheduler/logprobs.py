"""Prompt (input) log-probs of an EXTEND step: row t of the step predicts the token after packed
token t, so each request's rows score its next prompt tokens. Entries follow SGLang: the first
one (position `logprob_start_len`) has a null log-prob."""

from __future__ import annotations

import numpy as np

from sgl_tpu.executor.step import ModelRunner, StepResult
from sgl_tpu.scheduler.req import Req


def collect_input_logprobs(batch: list[tuple[Req, int]], result: StepResult,
                           runner: ModelRunner) -> None:
    """Append to each asking request's input log-probs the ones this step computed (`batch`:
    (request, tokens it ran) in packed order; kv_len not yet advanced)."""
    targets = np.zeros(sum(n for _, n in batch), np.int32)
    t = 0
    for req, n in batch:
        nxt = req.fill_ids[req.kv_len + 1 : req.kv_len + n + 1]
        targets[t : t + len(nxt)] = nxt
        t += n
    lp, top_ids, top_lp = runner.token_logprobs(result.hidden, targets)
    t = 0
    for req, n in batch:
        if req.wants_input_logprobs:
            start = req.logprob_start_len
            if req.kv_len == 0 and start == 0:
                req.input_token_logprobs.append([None, req.origin_input_ids[0]])
                req.input_top_logprobs.append(None)
            k = req.top_logprobs_num
            for j in range(n):
                pos = req.kv_len + j + 1  # the prompt position predicted by row j
                if start <= pos < req.prompt_len:
                    value = None if pos == start else float(lp[t + j])
                    req.input_token_logprobs.append([value, req.origin_input_ids[pos]])
                    req.input_top_logprobs.append(
                        [[float(top_lp[t + j, c]), int(top_ids[t + j, c])]
                         for c in range(k)] if k else None)
        t += n
