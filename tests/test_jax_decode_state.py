"""The JAX runner's device-resident decode batch state (backends/jax/decode_state.py): DECODE
steps read the state on the device, only changed rows are copied, and the device advances its
own rows. The same script of steps (requests joining and finishing, new pages, a jump-forward
row rewrite, overlap placeholders, greedy and sampled rows with penalties) runs on a runner
that packs every step and on one with the state (its debug check on: device == a host
recomputation after every step); tokens and log-probs must agree.
"""

from __future__ import annotations

import dataclasses

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu.backends.jax.runner import JaxModelRunner
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor import decode_rows as dr
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep, mask_words, placeholder_id
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

PAGE = 4
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, frequency_penalty=0.5,
                         repetition_penalty=1.2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def _runner(loaded, *, state: bool, **kw):
    kw = dict(dict(max_running_requests=4, max_extend_seqs=2, context_length=64, kv_tile=32),
              **kw)
    args = ServerArgs(skip_warmup=True, backend="jax", dtype="float32", page_size=PAGE,
                      max_total_tokens=1024, block_q=8, min_token_bucket=32,
                      chunked_prefill_size=32, **kw)
    cfg = runner_config(args, 4096)
    assert not cfg.jax_decode_state  # auto: off on CPU
    cfg = dataclasses.replace(cfg, jax_decode_state=state, check_decode_state=state)
    return JaxModelRunner(loaded.config, loaded.params, cfg)


class Driver:
    """Requests with page tables and penalty rows, driven step by step (the scheduler's view);
    the same script drives both runners."""

    def __init__(self, runner, prompts: list[list[int]], params: list[SamplingParams]):
        self.runner = runner
        self.reqs = []
        self.masked_compilations = 0  # set by _script: compiles its masked steps caused
        self.logprobs = []
        next_page = 1
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            n_pages = -(-(len(prompt) + 40) // PAGE)
            self.reqs.append(dict(ids=list(prompt), prompt_len=len(prompt), kv=0, sp=sp,
                                  pages=np.arange(next_page, next_page + n_pages), row=i + 1,
                                  seed=100 + i))
            next_page += n_pages

    def _step(self, r, token_ids, prefix_len, fresh=False) -> SeqStep:
        # pages: only those covering the context (a new page joins as the sequence grows)
        pages = r["pages"][: -(-(prefix_len + len(token_ids)) // PAGE)]
        return SeqStep(token_ids=token_ids, prefix_len=prefix_len, pages=pages,
                       sampling=r["sp"], seed=r["seed"],
                       num_output_tokens=len(r["ids"]) - r["prompt_len"], counts_row=r["row"],
                       counts_reset=fresh, return_logprob=r["row"] != 3,  # one row asks none
                       bitmask=r.get("mask"))

    def _take(self, which, res):
        for i, t in zip(which, res.token_ids, strict=True):
            self.reqs[i]["ids"].append(int(t))
            self.reqs[i]["kv"] = len(self.reqs[i]["ids"]) - 1
        self.logprobs.append(res.logprobs)

    def extend(self, which: list[int], forced: list[int] = ()):
        """Prefill (a new request), or a jump-forward: forced tokens appended and run."""
        steps = []
        for i in which:
            r = self.reqs[i]
            fresh = r["kv"] == 0
            r["ids"] += forced
            steps.append(self._step(r, r["ids"][r["kv"]:], r["kv"], fresh=fresh))
        self._take(which, self.runner.forward(ForwardMode.EXTEND, steps))

    def decode(self, which: list[int]):
        steps = [self._step(self.reqs[i], [self.reqs[i]["ids"][-1]], self.reqs[i]["kv"])
                 for i in which]
        before = self.runner.h2d_bytes
        self._take(which, self.runner.forward(ForwardMode.DECODE, steps))
        return self.runner.h2d_bytes - before, steps

    def overlapped(self, schedule: list[list[int]]):
        """Decode steps dispatched back to back, each naming the previous one's tokens by
        placeholder (rows shift when a request leaves), then their results read."""
        prev_row = {}
        handles = []
        lag = {i: 0 for i in range(len(self.reqs))}
        for which in schedule:
            steps = []
            for i in which:
                r = self.reqs[i]
                token = [placeholder_id(prev_row[i])] if i in prev_row else [r["ids"][-1]]
                step = self._step(r, token, r["kv"] + lag[i])
                step.num_output_tokens += lag[i]
                steps.append(step)
                lag[i] += 1
            prev_row = {i: row for row, i in enumerate(which)}
            handles.append((which, self.runner.dispatch(ForwardMode.DECODE, steps)))
        for which, handle in handles:
            self._take(which, handle.result())


def _even_tokens(vocab_size: int) -> np.ndarray:
    """A packed allowed-token mask (i32[W]) of the even token ids."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[:vocab_size:2] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _script(d: Driver) -> list[tuple[int, bool]]:
    """Every decode step in one compiled shape (batch bucket 4, 16 page columns). Prompts of
    3 and 7 tokens decode in step, so some steps start no page (they must copy nothing) and
    the jump-forward moves one request out of step. Returns
    (bytes copied, a row started a new page or has a grammar mask) of each serial decode step
    whose batch is the step before's."""
    unchanged = []

    def decode_same(which, n):
        for k in range(n):
            copied, steps = d.decode(which)
            if k:
                new_page = any(st.prefix_len % PAGE == 0 for st in steps)
                masked = any(st.bitmask is not None for st in steps)  # masks travel
                unchanged.append((copied, new_page or masked))

    d.extend([0, 1])
    d.extend([2])
    decode_same([0, 1, 2], 4)
    d.extend([3])  # a request joins
    decode_same([0, 1, 2, 3], 3)
    d.extend([1], forced=[7, 8, 9])  # jump-forward: its row is rewritten
    d.reqs[3]["mask"] = _even_tokens(d.runner.vocab_size)  # a grammar allows even ids only
    compiled = d.runner.num_compilations()
    decode_same([0, 1, 2, 3], 2)  # (the shape the maskless steps before compiled)
    d.masked_compilations = d.runner.num_compilations() - compiled
    d.reqs[3]["mask"] = None
    decode_same([0, 2, 3], 3)  # request 1 finished: the rows after it shift
    d.overlapped([[0, 2, 3], [0, 2, 3], [2, 3, 0], [2, 3, 0]])  # rows named elsewhere
    decode_same([2, 3, 0], 3)
    return unchanged


def test_state_matches_packing_path(llama):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, llama.config.vocab_size, n).tolist() for n in (3, 3, 7, 7)]
    params = [GREEDY, SAMPLED, dataclasses.replace(SAMPLED, min_p=0.05, seed=None), GREEDY]
    runner = _runner(llama, state=True)
    state = runner.decode_state
    runner.decode_state = None  # the packing path first, on the same runner (one EXTEND
    off = Driver(runner, prompts, params)  # compilation serves both runs)
    off_unchanged = _script(off)
    off_bytes, off_counts = runner.h2d_bytes, np.asarray(runner.token_counts)
    runner.decode_state = state
    on = Driver(runner, prompts, params)
    on_unchanged = _script(on)
    assert [r["ids"] for r in on.reqs] == [r["ids"] for r in off.reqs]
    for a, b in zip(off.logprobs, on.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_array_equal(off_counts, np.asarray(runner.token_counts))
    assert state.mirror.rows_copied > 0
    # an unchanged batch copies nothing; a new page copies that page-table row
    assert any(not new_page for _, new_page in on_unchanged), on_unchanged
    for copied, new_page in on_unchanged:
        assert (copied > 0) == new_page
        assert copied < min(c for c, _ in off_unchanged)
    assert runner.h2d_bytes - off_bytes < off_bytes

    # drift the device behind the host's back: the debug check names the cell
    state.arrays = dataclasses.replace(state.arrays,
                                       ints=state.arrays.ints.at[0, dr.STEP].add(1))
    with pytest.raises(RuntimeError, match=r"decode state ints\[0, 3\]"):
        on.decode([2, 3])


def test_warmup_compiles_the_state_path(llama):
    """Warm-up compiles the state step and its row scatters: traffic compiles nothing more."""
    runner = _runner(llama, state=True, max_running_requests=1, max_extend_seqs=1,
                     context_length=16, kv_tile=16)
    runner.warmup()
    compiled = runner.num_compilations()
    rng = np.random.default_rng(1)
    d = Driver(runner, [rng.integers(3, llama.config.vocab_size, n).tolist() for n in (2, 5)],
               [GREEDY, SAMPLED])
    d.extend([0])
    for _ in range(3):
        d.decode([0])
    d.extend([1])  # another request in row 0
    for _ in range(3):
        d.decode([1])
    assert runner.decode_state.mirror.rows_copied > 0
    assert runner.num_compilations() == compiled


def test_jax_decode_state_flag():
    """--jax-decode-state: auto is off on CPU (the packing path measured the same here), on /
    off force it, whatever --nnodes; the torch backend never takes it; a bad value is named."""
    from sgl_tpu.cli import parse_args

    def resolved(*flags: str) -> bool:
        return runner_config(parse_args(["--backend", "jax", *flags]), 4096).jax_decode_state

    assert not resolved()  # CPU
    assert resolved("--jax-decode-state", "on")
    assert resolved("--jax-decode-state", "on", "--nnodes", "2", "--node-rank", "1",
                    "--dist-init-addr", "127.0.0.1:5000", "--tp-size", "2")
    assert not resolved("--jax-decode-state", "off")
    torch_cfg = runner_config(parse_args(["--backend", "torch", "--jax-decode-state", "on"]),
                              4096)
    assert not torch_cfg.jax_decode_state
    with pytest.raises(ValueError, match="jax_decode_state"):
        ServerArgs(jax_decode_state="always")
