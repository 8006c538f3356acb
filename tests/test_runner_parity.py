"""Both executor backends through the step contract (`runner.forward` + `row_logits`) against
Hugging Face transformers, float32, on every architecture case: a prompt prefilled in two
EXTEND steps (the second reads the first's K/V from the paged pool, as a radix-cache hit does)
and two sequences of a ragged batch. Tolerance: max abs logit diff < 2e-3 (logits of order 1).
`hidden_rows` (what embeddings pool) against the reference's last hidden states likewise.
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


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_hidden_rows_match_transformers(tmp_path, backend):
    """`runner.hidden_rows` (what embeddings pool) is the hidden state after the final norm,
    float32, of the rows asked for: a prompt's second EXTEND step over its cached first part,
    beside a whole prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    loaded, runner = _runner(model_dir, backend)
    rng = np.random.default_rng(1)
    a = rng.integers(3, loaded.config.vocab_size, 13).tolist()
    b = rng.integers(3, loaded.config.vocab_size, 6).tolist()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref_a, ref_b = (hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()
                        for ids in (a, b))
    pages_a, pages_b = np.arange(1, 5), np.arange(5, 7)
    _extend(runner, [(a[:5], 0, pages_a)])
    steps = [SeqStep(token_ids=t, prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                     num_output_tokens=0) for t, p, pg in [(a[5:], 5, pages_a), (b, 0, pages_b)]]
    result = runner.forward(ForwardMode.EXTEND, steps)
    rows = np.array([7, 0, 8, 13], np.int64)  # a's last row, a's first of the step, b's 0, 5
    hidden = runner.hidden_rows(result.hidden, rows)
    assert hidden.dtype == np.float32 and hidden.shape == (4, loaded.config.hidden_size)
    expected = np.stack([ref_a[12], ref_a[5], ref_b[0], ref_b[5]])
    np.testing.assert_allclose(hidden, expected, atol=ATOL * np.abs(expected).max())


def test_both_runners_convert_one_host_batch(tmp_path, monkeypatch):
    """A step's host arrays are built once, by the step contract (`build_host_batch`), and each
    runner only converts them: the arrays each runner hands its device are its HostBatch's, and
    the two runners' HostBatches of the same steps agree on every real row (they differ only
    in padding: the JAX runner pads to its buckets, the eager torch runner does not)."""
    from sgl_tpu.backends.jax import forward_batch as jax_fb
    from sgl_tpu.backends.jax import runner as jax_runner
    from sgl_tpu.backends.torch.runner import TorchModelRunner
    from sgl_tpu.executor import step as step_contract

    built = []
    build = step_contract.build_host_batch

    def build_spy(*args, **kw):
        built.append(build(*args, **kw))
        return built[-1]

    monkeypatch.setattr(step_contract, "build_host_batch", build_spy)
    monkeypatch.setattr(jax_fb, "build_host_batch", build_spy)
    seen = {"jax": [], "torch": []}
    to_forward_batch, torch_batch = jax_runner.to_forward_batch, TorchModelRunner._torch_batch

    def jax_spy(host, shape, page_size):
        seen["jax"].append((host, to_forward_batch(host, shape, page_size)))
        return seen["jax"][-1][1]

    def torch_spy(self, host):
        seen["torch"].append((host, torch_batch(self, host)))
        return seen["torch"][-1][1]

    monkeypatch.setattr(jax_runner, "to_forward_batch", jax_spy)
    monkeypatch.setattr(TorchModelRunner, "_torch_batch", torch_spy)

    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    rng = np.random.default_rng(1)
    loaded, _ = _runner(model_dir, "torch")
    a, b = (rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (10, 6))
    pages_a, pages_b = [5, 2, 9], [4, 7]
    sampling = SamplingParams(temperature=0.8, top_k=5, frequency_penalty=0.5)
    extend = [SeqStep(token_ids=a, prefix_len=0, pages=pages_a, sampling=sampling, seed=3,
                      num_output_tokens=0, counts_row=1, counts_reset=True),
              SeqStep(token_ids=b, prefix_len=0, pages=pages_b, sampling=GREEDY, seed=4,
                      num_output_tokens=0, counts_row=2, counts_reset=True)]
    decode = [SeqStep(token_ids=[a[0]], prefix_len=10, pages=pages_a, sampling=sampling,
                      seed=3, num_output_tokens=1, counts_row=1),
              SeqStep(token_ids=[b[0]], prefix_len=6, pages=pages_b, sampling=GREEDY, seed=4,
                      num_output_tokens=1, counts_row=2)]
    for backend in ("jax", "torch"):
        _, runner = _runner(model_dir, backend)
        for mode, steps in ((ForwardMode.EXTEND, extend), (ForwardMode.DECODE, decode)):
            runner.forward(mode, steps)
    assert len(built) == 4  # one per step and runner
    converted = [host for host, _ in seen["jax"] + seen["torch"]]
    assert len(converted) == 4 and all(c is b for c, b in zip(converted, built, strict=True))

    for (jh, fb), (th, tb) in zip(seen["jax"], seen["torch"], strict=True):
        # each runner's device inputs are its HostBatch's arrays, converted
        for name in ("input_ids", "positions", "out_slots", "seq_lens", "page_table"):
            np.testing.assert_array_equal(np.asarray(getattr(fb, name)), getattr(jh, name))
        np.testing.assert_array_equal(fb.sample_idx, jh.sample_rows)
        assert fb.sampling.temperature is jh.sampling.temperature
        for name in ("input_ids", "positions", "out_slots"):
            np.testing.assert_array_equal(getattr(tb, name).numpy(), getattr(th, name))
        np.testing.assert_array_equal(tb.sample_rows.numpy(), th.sample_rows)
        # the same steps: the same real rows on both
        assert jh.mode == th.mode and jh.num_seqs == th.num_seqs == 2
        t, n, p = jh.num_tokens, jh.num_seqs, th.page_table.shape[1]
        assert t == th.num_tokens == (16 if jh.mode == ForwardMode.EXTEND else 2)
        for name in ("input_ids", "positions", "out_slots"):
            np.testing.assert_array_equal(getattr(jh, name)[:t], getattr(th, name)[:t])
        for name in ("starts", "extend_lens", "prefix_lens", "seq_lens", "sample_rows"):
            np.testing.assert_array_equal(getattr(jh, name)[:n], getattr(th, name)[:n])
        np.testing.assert_array_equal(jh.page_table[:n, :p], th.page_table)
        assert not jh.page_table[:, p:].any() and not jh.page_table[n:].any()
        for name in ("temperature", "top_k", "frequency_penalty", "seed", "step",
                     "counts_rows", "counts_reset", "sample_valid"):
            np.testing.assert_array_equal(getattr(jh.sampling, name)[:n],
                                          getattr(th.sampling, name))
