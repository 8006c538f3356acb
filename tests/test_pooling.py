"""Embedding requests in the scheduler (scheduler/pooling.py), against a runner whose hidden
state of a packed token is `(token id, position)`, so every pooled vector can be worked out by
hand: chunked prefill, prefix-cache hits and batching beside generation requests are checked
exactly. The HTTP routes on the real model: test_embeddings_api.py."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from test_scheduler import PAGE, PlusOneRunner, V

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.executor.step import ForwardMode, SeqStep, StepResult
from sgl_tpu.messages import TokenizedGenerateReq


class PositionRunner(PlusOneRunner):
    """PlusOneRunner whose EXTEND hidden states are `[T, 2]`: (token id, position) per row."""

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        result = super().forward(mode, steps)
        if mode != ForwardMode.EXTEND:
            return result
        hidden = np.array([(int(t), s.prefix_len + j) for s in steps
                           for j, t in enumerate(s.token_ids)], np.float32)
        return StepResult(result.token_ids, result.logprobs, result.top_ids,
                          result.top_logprobs, hidden=hidden)

    def hidden_rows(self, hidden: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return hidden[rows]


def make_scheduler(pooling: str, chunk: int = 16):
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=8, max_extend_seqs=8,
                          chunked_prefill_size=chunk, context_len=512, pooling=pooling)
    runner = PositionRunner()
    return Scheduler(cfg, runner, num_pages=64, decode=lambda ids, skip: "",
                     eos_token_ids=(), vocab_size=V), runner


def embed_request(rid: str, prompt: list[int]) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling={"max_new_tokens": 0},
                                embed=True)


def run_all(sched) -> dict:
    finals = {}
    for _ in range(200):
        if not sched.has_work:
            break
        for out in sched.step():
            if out.finished:
                finals[out.rid] = out
        sched.check_integrity()
    assert not sched.has_work
    return finals


def expected(pooling: str, prompt: list[int]) -> list[float]:
    rows = np.array([(t, i) for i, t in enumerate(prompt)], np.float64)
    pooled = {"last": rows[-1], "cls": rows[0], "mean": rows.mean(axis=0)}[pooling]
    return pooled.astype(np.float32).tolist()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_prompt_pools_every_chunk(pooling):
    """A 50-token prompt runs in chunks of 16 beside a generation request; the pooled vector
    is the method's over the whole prompt, the generation request is unaffected."""
    sched, runner = make_scheduler(pooling, chunk=16)
    prompt = list(range(100, 150))
    assert sched.add_request(embed_request("e", prompt)) is None
    assert sched.add_request(TokenizedGenerateReq(
        rid="g", input_ids=[5, 6, 7], sampling={"max_new_tokens": 3, "temperature": 0})) is None
    finals = run_all(sched)
    e = finals["e"]
    assert e.embedding == expected(pooling, prompt)
    assert e.new_token_ids == [] and e.prompt_tokens == 50
    assert e.finish_reason == {"type": "length", "length": 0}
    extends = [seqs for mode, seqs in runner.calls if mode == ForwardMode.EXTEND]
    assert [seqs[0] for seqs in extends[:3]] == [(16, 0), (16, 16), (16, 32)]  # e, chunked
    assert extends[3] == [(2, 48), (3, 0)]  # e's last chunk and g in one batch
    assert finals["g"].embedding is None


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_prefix_cache_keeps_pooling_exact(pooling):
    """After a request cached the prompt's prefix, `last` reuses it (and still pools the last
    row), `mean` and `cls` recompute every row: all three give the cold vector."""
    sched, runner = make_scheduler(pooling, chunk=64)
    prompt = list(range(200, 230))
    sched.add_request(TokenizedGenerateReq(rid="warm", input_ids=prompt,
                                           sampling={"max_new_tokens": 2, "temperature": 0}))
    run_all(sched)
    runner.calls.clear()
    sched.add_request(embed_request("e", prompt))
    e = run_all(sched)["e"]
    assert e.embedding == expected(pooling, prompt)
    cached = 28 if pooling == "last" else 0  # whole pages of the 30-token prompt
    assert e.cached_tokens == cached
    assert runner.calls[0][1] == [(30 - cached, cached)]


def test_embedding_request_that_asks_for_tokens_is_refused():
    sched, _ = make_scheduler("last")
    msg = TokenizedGenerateReq(rid="x", input_ids=[1, 2], sampling={"max_new_tokens": 4},
                               embed=True)
    out = sched.add_request(msg)
    assert out is not None and out.finish_reason["status_code"] == 400
