"""Both executor backends through the step contract (`runner.forward` + `row_logits`) against
Hugging Face transformers, float32, on every architecture case: a prompt prefilled in two
EXTEND steps (the second reads the first's K/V from the paged pool, as a radix-cache hit does)
and two sequences of a ragged batch. Tolerance: max abs logit diff < 2e-3 (logits of order 1).
"""

from __future__ import annotations

import checkpoints as ck
import numpy as np
import pytest
from model_helpers import hf_logits

from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

ATOL = 2e-3
PAGE = 4
GREEDY = SamplingParams(temperature=0.0)


def _runner(model_dir, backend: str):
    loaded = load_model(model_dir)
    args = ServerArgs(backend=backend, dtype="float32", torch_compile="off", skip_warmup=True,
                      page_size=PAGE, max_total_tokens=1024, kv_tile=16, block_q=8,
                      min_token_bucket=16, chunked_prefill_size=64, max_running_requests=4)
    return loaded, create_model_runner(loaded.config, loaded.params,
                                       runner_config(args, loaded.config.context_len))


def _extend(runner, seqs: list[tuple[list[int], int, np.ndarray]]) -> list[np.ndarray]:
    """EXTEND of (new tokens, prefix_len, pages) per sequence -> each one's logits rows."""
    steps = [SeqStep(token_ids=t, prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                     num_output_tokens=0) for t, p, pg in seqs]
    result = runner.forward(ForwardMode.EXTEND, steps)
    rows = np.arange(sum(len(t) for t, _, _ in seqs), dtype=np.int32)
    logits = runner.row_logits(result.hidden, rows)
    out, start = [], 0
    for t, _, _ in seqs:
        out.append(logits[start : start + len(t)])
        start += len(t)
    return out


# The newer families run the JAX runner's compile-heavy step only in test_model.py (prefill,
# paged decode, ragged batch over a cached prefix through the same model code), to keep CI time.
@pytest.mark.parametrize("arch,kw,backend", [
    pytest.param(arch, kw, backend, id=f"{arch}-kw{i}-{backend}")
    for i, (arch, kw) in enumerate(ck.ARCH_CASES)
    for backend in (["torch"] if (arch, kw) in ck.NEW_ARCH_CASES else ["jax", "torch"])])
def test_runner_logits_match_transformers(tmp_path, backend, arch, kw):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", arch, **kw)
    loaded, runner = _runner(model_dir, backend)
    assert runner.backend == backend
    rng = np.random.default_rng(0)
    a = rng.integers(3, loaded.config.vocab_size, 21).tolist()
    b = rng.integers(3, loaded.config.vocab_size, 9).tolist()
    ref_a, ref_b = hf_logits(model_dir, a), hf_logits(model_dir, b)
    pages_a, pages_b = np.arange(1, 7), np.arange(7, 10)  # 6 and 3 pages of 4 tokens

    # a's first 10 tokens (ending mid-page), then the rest of a next to all of b
    (first,) = _extend(runner, [(a[:10], 0, pages_a)])
    rest_a, all_b = _extend(runner, [(a[10:], 10, pages_a), (b, 0, pages_b)])
    np.testing.assert_allclose(first, ref_a[:10], atol=ATOL)
    np.testing.assert_allclose(rest_a, ref_a[10:], atol=ATOL)
    np.testing.assert_allclose(all_b, ref_b, atol=ATOL)

    # a DECODE step re-running a's last token over its cached context (it rewrites the same
    # K/V): the sampled token is the reference's argmax whenever that is clear
    steps = [SeqStep(token_ids=[a[-1]], prefix_len=len(a) - 1, pages=pages_a, sampling=GREEDY,
                     seed=0, num_output_tokens=1)]
    result = runner.forward(ForwardMode.DECODE, steps)
    top2 = np.sort(ref_a[-1])[-2:]
    if top2[1] - top2[0] > 10 * ATOL:
        assert result.token_ids[0] == int(ref_a[-1].argmax())
