"""Gemma 2 and Gemma 3 on both executor backends against transformers, float32.

Tiny random checkpoints (tests/gemma_checkpoints.py) with a sliding window of 6 tokens over
pages of 4, so local layers' windows cross page boundaries, start inside cached prefixes and
slide during decode, next to global layers that see everything. Each case:

  * prefill of a 21-token prompt in two EXTEND steps (the second reads the first's K/V from
    the pool, as a radix-cache hit does), batched with a second, unrelated prompt (ragged);
  * 8 paged DECODE steps of both sequences in one batch: each greedy token equals the
    reference's argmax (where the top two differ by more than 10x the tolerance) and its
    log-probability the reference's;

and every logit equals the reference run of each sequence alone. Tolerance: max abs logit
(and log-prob) difference 2e-3, logits of order 1.
"""

from __future__ import annotations

import numpy as np
import pytest
from gemma_checkpoints import WINDOW, make_tiny_gemma
from model_helpers import hf_logits

from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

ATOL = 2e-3
PAGE = 4
DECODE_STEPS = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_gemma(tmp_path_factory.mktemp(request.param), request.param)


def _runner(model_dir, backend: str):
    loaded = load_model(model_dir)
    args = ServerArgs(backend=backend, dtype="float32", torch_compile="off", skip_warmup=True,
                      page_size=PAGE, max_total_tokens=1024, kv_tile=8, block_q=8,
                      min_token_bucket=16, chunked_prefill_size=64, max_running_requests=4)
    return loaded, create_model_runner(loaded.config, loaded.params,
                                       runner_config(args, loaded.config.context_len))


def _step(tokens, prefix_len, pages, num_output_tokens=0) -> SeqStep:
    return SeqStep(token_ids=tokens, prefix_len=prefix_len, pages=pages, sampling=GREEDY,
                   seed=0, num_output_tokens=num_output_tokens)


def _extend_logits(runner, seqs) -> list[np.ndarray]:
    result = runner.forward(ForwardMode.EXTEND, [_step(*s) for s in seqs])
    rows = np.arange(sum(len(t) for t, _, _ in seqs), dtype=np.int32)
    logits = runner.row_logits(result.hidden, rows)
    return np.split(logits, np.cumsum([len(t) for t, _, _ in seqs])[:-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_gemma_prefill_and_paged_decode_match_transformers(checkpoint, backend):
    arch, model_dir = checkpoint
    loaded, runner = _runner(model_dir, backend)
    cfg = loaded.config
    assert cfg.arch == arch and cfg.gemma.sliding_window == WINDOW
    assert cfg.gemma.sliding_layers == (True, False, True)
    rng = np.random.default_rng(1)
    a = rng.integers(3, cfg.vocab_size, 21).tolist()
    b = rng.integers(3, cfg.vocab_size, 9).tolist()
    pages_a, pages_b = np.arange(1, 9), np.arange(9, 14)  # room for the decoded tokens

    (first,) = _extend_logits(runner, [(a[:10], 0, pages_a)])
    rest_a, all_b = _extend_logits(runner, [(a[10:], 10, pages_a), (b, 0, pages_b)])
    ref_a, ref_b = hf_logits(model_dir, a), hf_logits(model_dir, b)
    np.testing.assert_allclose(np.concatenate([first, rest_a]), ref_a, atol=ATOL)
    np.testing.assert_allclose(all_b, ref_b, atol=ATOL)

    # greedy decode of both sequences in one batch, then each checked against the reference
    # run of that sequence alone (causal: row t of one run over everything = a run up to t)
    seqs = [(list(a) + [int(ref_a[-1].argmax())], pages_a),
            (list(b) + [int(ref_b[-1].argmax())], pages_b)]
    logprobs: list[list[float]] = [[], []]
    for n in range(DECODE_STEPS):
        steps = [_step([toks[-1]], len(toks) - 1, pages, n + 1) for toks, pages in seqs]
        result = runner.forward(ForwardMode.DECODE, steps)
        for i, (toks, _) in enumerate(seqs):
            toks.append(int(result.token_ids[i]))
            logprobs[i].append(float(result.logprobs[i]))
    for (toks, _), lps in zip(seqs, logprobs, strict=True):
        ref = hf_logits(model_dir, toks)[-DECODE_STEPS - 1 : -1]  # rows that predicted them
        got = np.array(toks[-DECODE_STEPS:])
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 10 * ATOL
        np.testing.assert_array_equal(got[clear], ref.argmax(-1)[clear])
        ref_lp = np.take_along_axis(_log_softmax(ref), got[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(lps, ref_lp, atol=ATOL)
