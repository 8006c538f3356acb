"""The torch backend's static decode step (backends/torch/static_decode.py) over device-resident
batch state (decode_state.py): on CPU the function a CUDA graph records runs eagerly and must
give the packing path's tokens and log-probs for padded buckets, ragged contexts and page
boundaries, with the device state equal to a host recomputation after every step (the debug
check is on in every runner here). CUDA graph replay is checked where a GPU is visible.
"""

from __future__ import annotations

import dataclasses

import checkpoints as ck
import gemma_checkpoints as gck
import numpy as np
import pytest
import torch

from sgl_tpu import Engine
from sgl_tpu.backends.torch import decode_state as ds
from sgl_tpu.backends.torch import sampler
from sgl_tpu.backends.torch.static_decode import StaticDecode
from sgl_tpu.cli import parse_args
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor import step as step_contract
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

PAGE = 4
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, frequency_penalty=0.5,
                         repetition_penalty=1.2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llama(llama_dir):
    return load_model(llama_dir)


def _runner(loaded, *, static: bool, device: str = "cpu"):
    args = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off", dtype="float32",
                      page_size=PAGE, max_total_tokens=2048, kv_tile=8, min_token_bucket=16,
                      chunked_prefill_size=128, max_running_requests=8, max_extend_seqs=8,
                      device=device, disable_cuda_graph=not static, quantization="none",
                      torch_threads=1)
    cfg = runner_config(args, 4096)
    if static:
        cfg = dataclasses.replace(cfg, static_decode=True, static_decode_max_bs=8,
                                  check_decode_state=True)
    return create_model_runner(loaded.config, loaded.params, cfg)


class Driver:
    """Requests with page tables and penalty rows, prefilled then decoded step by step; the
    same script drives two runners (the packing path and the static step)."""

    def __init__(self, runner, prompts: list[list[int]], params: list[SamplingParams]):
        self.runner = runner
        self.reqs = []
        next_page = 1
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            n_pages = -(-(len(prompt) + 40) // PAGE)
            pages = np.arange(next_page, next_page + n_pages, dtype=np.int32)
            next_page += n_pages
            self.reqs.append(dict(ids=list(prompt), prompt_len=len(prompt), pages=pages, sp=sp,
                                  row=i + 1, seed=100 + i))

    def _step(self, r, token_ids, prefix_len, fresh=False) -> SeqStep:
        return SeqStep(token_ids=token_ids, prefix_len=prefix_len, pages=r["pages"],
                       sampling=r["sp"], seed=r["seed"],
                       num_output_tokens=len(r["ids"]) - r["prompt_len"], counts_row=r["row"],
                       counts_reset=fresh, return_logprob=r["row"] != 3)  # one row asks none

    def prefill(self, which: list[int]):
        steps = [self._step(self.reqs[i], self.reqs[i]["ids"], 0, fresh=True) for i in which]
        res = self.runner.forward(ForwardMode.EXTEND, steps)
        for i, t in zip(which, res.token_ids, strict=True):
            self.reqs[i]["ids"].append(int(t))

    def decode(self, which: list[int]):
        steps = [self._step(self.reqs[i], [self.reqs[i]["ids"][-1]],
                            len(self.reqs[i]["ids"]) - 1) for i in which]
        res = self.runner.forward(ForwardMode.DECODE, steps)
        for i, t in zip(which, res.token_ids, strict=True):
            self.reqs[i]["ids"].append(int(t))
        return res


def _script(loaded, params) -> list[tuple[list[int], object]]:
    """Prompts of 3, 6, 9, 14 tokens (pages of 4: ragged, some ending on a page boundary);
    decode batches of 3 (bucket 4: one padding row), then 4, then 2 after two leave."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (3, 6, 9, 14)]
    out = []
    for static in (False, True):
        d = Driver(_runner(loaded, static=static), prompts, params)
        results = []
        d.prefill([0, 1, 2])
        for _ in range(5):
            results.append(d.decode([0, 1, 2]))
        d.prefill([3])
        for _ in range(4):
            results.append(d.decode([0, 1, 2, 3]))
        for _ in range(4):
            results.append(d.decode([1, 3]))
        out.append(([r["ids"] for r in d.reqs], results, d.runner))
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_static_step_greedy_parity(tmp_path, llama, arch):
    """llama; mistral: a sliding window in the length mask; gemma3: local layers' window and
    the score soft-cap inside the attention kernel."""
    if arch == "llama":
        loaded = llama
    elif arch == "gemma3":
        loaded = load_model(gck.make_tiny_gemma(tmp_path / "m", "gemma3"))
    else:
        loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", arch))
    (ids_a, res_a, eager), (ids_b, res_b, static) = _script(loaded, [GREEDY] * 4)
    assert eager.static_decode is None and static.static_decode is not None
    assert ids_a == ids_b
    torch.testing.assert_close(eager.token_counts, static.token_counts)  # the greedy tail's
    for a, b in zip(res_a, res_b, strict=True):
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=1e-4)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_moe_models_keep_the_packing_path(tmp_path, monkeypatch):
    """Mixture-of-experts layers route on the host (per-expert counts), which a CUDA graph
    cannot record: where the static step would be on (CUDA, faked here), the registry keeps
    the packing path for them, and a runner handed a static config for them refuses it."""
    from sgl_tpu.backends.torch import platform
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import runner_config

    monkeypatch.setattr(platform, "cuda_graphs", lambda args: True)
    args = ServerArgs(backend="torch", dtype="float32")
    assert runner_config(args, 512).static_decode and runner_config(args, 512).cuda_graph
    moe = runner_config(args, 512, num_experts=4)
    assert not moe.static_decode and not moe.cuda_graph and not moe.static_decode_max_bs
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "qwen2_moe"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _runner(loaded, static=True)


def test_page_buckets_stop_at_what_the_kv_pool_can_hold(llama):
    """The widest page bucket is the widest page table a sequence can fill: the model's
    context (4,096 tokens here = 1,024 pages) or, smaller, the pool's usable pages (2,048
    tokens = 512 pages); a wider graph would reserve device memory no step uses."""
    runner = _runner(llama, static=True)
    assert runner.config.max_pages_per_seq == 1024 and runner.config.num_pages == 513
    assert runner.static_decode.page_buckets == (2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("wide", [False, True], ids=["candidates", "wide-top-k"])
def test_static_step_sampling_and_penalty_parity(llama, wide):
    """Seeded sampling (temperature, top-p, top-k) with frequency and repetition penalties:
    the uniforms come from the device state's seeds/steps, the counts from its rows. Every
    batch takes the fixed-shape sample tail: kept sets inside the sampler's candidates, and a
    top-k above them (200 of a 400-token vocabulary: the exact threshold by sorting)."""
    loaded = llama
    last = SamplingParams(temperature=1.0, top_k=200) if wide else \
        dataclasses.replace(SAMPLED, min_p=0.05)
    params = [SAMPLED, GREEDY, SAMPLED, last]
    (ids_a, _, eager), (ids_b, _, static) = _script(loaded, params)
    assert ids_a == ids_b
    torch.testing.assert_close(eager.token_counts, static.token_counts)
    tails = static.static_decode.tails
    assert tails["sample"] > 0 and tails["greedy"] == tails["masked"] == 0


# (temperature, top-p, top-k, min-p) rows by the draw `sampler.sample` gives them
SAMPLER_ROWS = {
    # greedy, top-k 1, top-p, top-k, min-p, top-k + top-p: kept sets inside 128 candidates
    "candidates": [(0.0, 1.0, -1, 0.0), (0.8, 1.0, 1, 0.0), (0.8, 0.9, -1, 0.0),
                   (1.2, 1.0, 20, 0.0), (1.0, 1.0, 40, 0.1), (0.7, 0.8, 50, 0.0)],
    # no truncation, a min-p below the candidates: drawn over the whole vocabulary
    "whole-vocab": [(1.0, 1.0, -1, 0.0), (0.0, 1.0, -1, 0.0), (1.0, 1.0, -1, 0.001),
                    (0.8, 0.9, -1, 0.0)],
    # a top-k of 500, a flat nucleus: `sample`'s thresholds by radix selection, sorted ones
    # in `sample_static`
    "radix": [(1.0, 1.0, 500, 0.0), (5.0, 0.99, -1, 0.0), (0.8, 1.0, 20, 0.0)],
}


def _sampler_rows(rng, vocab: int, kind: str):
    """Knobs of 24 rows of one SAMPLER_ROWS kind, penalties on about half."""
    kinds = SAMPLER_ROWS[kind]
    rows = [kinds[i % len(kinds)] for i in range(24)]
    temp, top_p, top_k, min_p = (torch.tensor(c) for c in zip(*rows, strict=True))
    n = len(rows)
    pen = rng.random(n) < 0.5
    counts = torch.from_numpy(rng.integers(0, 3, (n, vocab)).astype(np.int32))
    penalties = (counts, torch.from_numpy(np.where(pen, 0.5, 0.0).astype(np.float32)),
                 torch.from_numpy(np.where(pen, 0.3, 0.0).astype(np.float32)),
                 torch.from_numpy(np.where(pen, 1.2, 1.0).astype(np.float32)))
    return dict(temperature=temp.float(), top_p=top_p.float(), top_k=top_k.long(),
                min_p=min_p.float(), penalties=penalties)


def _bitmask(rng, n: int, vocab: int, mask: str) -> torch.Tensor | None:
    """Packed allowed-token masks i32[n, W]: `grammar`, a random third of the vocabulary per
    row and nothing at all in row 0 (`sample` applies it dense); `banned`, all but three ids
    per row (a min_new_tokens ban: `sample` sets them to -inf in place)."""
    if mask == "none":
        return None
    words = step_contract.mask_words(vocab)
    allowed = np.zeros((n, words * 32), bool)
    if mask == "grammar":
        allowed[:, :vocab] = rng.random((n, vocab)) < 0.3
        allowed[0] = False
    else:
        allowed[:, :vocab] = True
        allowed[np.arange(n)[:, None], rng.integers(0, vocab, (n, 3))] = False
    packed = np.packbits(allowed.astype(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32))


@pytest.mark.parametrize(("kind", "mask"), [(kind, "none") for kind in SAMPLER_ROWS]
                         + [("candidates", "grammar"), ("radix", "grammar"),
                            ("whole-vocab", "banned")])
def test_sample_static_equals_sampler(kind, mask):
    """The fixed-shape sampler a CUDA graph records gives `sampler.sample`'s tokens, log-probs
    and top log-probs bit for bit, whichever way `sample` finds a row's threshold, and with
    either way `sample` applies a mask."""
    rng = np.random.default_rng(11)
    vocab = 1000
    knobs = _sampler_rows(rng, vocab, kind)
    n = knobs["temperature"].shape[0]
    want = torch.from_numpy(rng.random(n) < 0.7)
    for _ in range(8):
        logits = torch.from_numpy((rng.standard_normal((n, vocab)) * 3).astype(np.float32))
        uniforms = torch.from_numpy(rng.random(n).astype(np.float32))
        bitmask = _bitmask(rng, n, vocab, mask)
        ref = sampler.sample(logits.clone(), uniforms=uniforms, bitmask=bitmask,
                             num_top_logprobs=3, logprob_rows=want, **knobs)
        got = sampler.sample_static(logits.clone(), uniforms=uniforms, num_top_logprobs=3,
                                    logprob_rows=want, bitmask=bitmask, **knobs)
        if bitmask is not None:  # every token drawn is allowed (row 0 of a grammar: none is)
            allowed = sampler.unpack_bitmask(bitmask, vocab)
            chosen = allowed.gather(1, got[0][:, None])[:, 0]
            assert bool(chosen[1:].all()) and bool(chosen[0]) == (mask == "banned")
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unchanged_batch_copies_nothing_and_check_catches_drift(llama):
    loaded = llama
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (5, 6)]
    d = Driver(_runner(loaded, static=True), prompts, [GREEDY, GREEDY])
    state = d.runner.static_decode.state
    d.prefill([0, 1])
    d.decode([0, 1])  # first step: every row is new
    copied = state.rows_copied
    assert copied > 0
    d.decode([0, 1])  # contexts of 7 and 8 tokens: no new page
    assert state.rows_copied == copied
    d.decode([0, 1])  # 8 and 9: the second needs a third page: one page-table row
    assert state.rows_copied == copied + 1
    state.ints[0, ds.STEP] += 1  # drift the device behind the host's back
    with pytest.raises(RuntimeError, match=r"decode state ints\[0, 3\]"):
        d.decode([0, 1])


def test_engine_traffic_identical_with_static_step(llama_dir):
    """The scheduler's real steps (chunked prefill, a shared prefix from the radix cache,
    n > 1, seeds, penalties, a regex, stop tokens, requests finishing mid-batch) through one
    Engine, with the packing path, then with the static step (state checked every step), then
    the static step under overlap scheduling (placeholder inputs resolved on the device)."""
    eng = Engine(llama_dir, page_size=4, max_total_tokens=2048, max_running_requests=8,
                 max_extend_seqs=4, chunked_prefill_size=64, min_token_bucket=16, kv_tile=8,
                 backend="torch", dtype="float32", torch_compile="off", torch_threads=1,
                 skip_warmup=True)
    try:
        runner = eng.scheduler.runner
        vocab = eng.model_config.vocab_size
        rng = np.random.default_rng(5)
        shared = rng.integers(3, vocab, 70).tolist()
        prompts = [shared + rng.integers(3, vocab, n).tolist() for n in (4, 9, 1, 13, 6)]
        params = [{"temperature": 0, "max_new_tokens": 7},
                  {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 15, "seed": 3},
                  {"temperature": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                   "max_new_tokens": 11, "seed": 4},
                  {"temperature": 0.9, "max_new_tokens": 4, "regex": "[a-z]+ [0-9]{2,4}",
                   "seed": 6},
                  {"temperature": 1.0, "top_k": 5, "n": 2, "max_new_tokens": 9, "seed": 8}]

        def run():
            assert eng.scheduler.flush_cache()  # both runs prefill from scratch
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            eng.scheduler.check_integrity()
            return [o["output_ids"] for o in outs]

        sched = eng.scheduler
        sched.speculator = None  # (drafts exclude overlap; all three runs without them)
        packing = run()
        cfg = dataclasses.replace(runner.config, static_decode=True, static_decode_max_bs=8,
                                  check_decode_state=True)
        runner.static_decode = StaticDecode(cfg, runner.model, runner.attn, runner.kv_pools,
                                            runner.token_counts, runner.device, runner.dtype,
                                            runner.model_config.sliding_window)
        static = run()
        assert runner.static_decode.state.rows_copied > 0  # the static step ran
        assert static == packing
        assert runner.static_decode.tails["masked"] > 0  # the regex's steps
        sched.overlap = True
        overlapped = sched.stats.num_overlapped_steps
        assert run() == packing
        assert sched.stats.num_overlapped_steps > overlapped + 5, sched.stats.num_overlapped_steps
    finally:
        eng.shutdown()


def test_row_uniforms_on_device_follow_the_contract():
    """The torch backend's uniforms (both paths draw them on the device) are the step
    contract's seed-to-uniform rule, bit for bit."""
    from sgl_tpu.executor.step import row_uniforms

    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 2**31 - 1, 512).astype(np.int32)
    seeds[:2], steps[:2] = (0, 2**32 - 1), (0, 2**31 - 1)
    got = ds.row_uniforms(torch.from_numpy(seeds.astype(np.int64)),
                          torch.from_numpy(steps.astype(np.int64)))
    np.testing.assert_array_equal(got.numpy(), row_uniforms(seeds, steps))


def test_cuda_graph_flags():
    args = parse_args(["--cuda-graph-max-bs", "16", "--disable-cuda-graph"])
    assert args.cuda_graph_max_bs == 16 and args.disable_cuda_graph
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)
    cpu = runner_config(ServerArgs(backend="torch", device="cpu", cuda_graph_max_bs=16), 4096)
    assert not cpu.static_decode and not cpu.cuda_graph  # accepted, inert on CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager(llama):
    """On CUDA: the replayed graphs give exactly what the same static step gives eagerly
    (batches with the sampled row take the sample tail, the plain greedy ones the greedy
    tail), and the packing path's greedy tokens."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, llama.config.vocab_size, n).tolist() for n in (3, 6, 9)]
    runs = {}
    for name in ("packing", "static", "graphs"):
        runner = _runner(llama, static=name != "packing", device="cuda")
        assert runner.config.cuda_graph == (name != "packing")  # on for CUDA unless disabled
        if name == "static":  # the same step without graphs
            runner.static_decode.use_graphs = False
        d = Driver(runner, prompts, [GREEDY, SAMPLED, GREEDY])
        d.prefill([0, 1, 2])
        results = [d.decode([0, 1, 2]) for _ in range(3)]
        results += [d.decode([0, 2]) for _ in range(3)]  # plain greedy: the captured tail
        runs[name] = ([r["ids"] for r in d.reqs], results)
        if name == "graphs":
            assert runner.static_decode.num_graphs() >= 3  # forward + tail per bucket
    ids, results = runs["graphs"]
    assert ids == runs["static"][0]
    for a, b in zip(results, runs["static"][1], strict=True):
        np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)
    assert [ids[0], ids[2]] == [runs["packing"][0][0], runs["packing"][0][2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_warmup_captures_every_bucket(llama):
    runner = _runner(llama, static=True, device="cuda")
    runner.warmup()
    sd = runner.static_decode
    expected = len(sd.batch_buckets) * (len(sd.page_buckets) + 3)  # forward per (S, P) + tails
    assert sd.num_graphs() == expected
    prompts = [list(range(3, 3 + n)) for n in (5, 11)]
    d = Driver(runner, prompts, [GREEDY, SAMPLED])
    d.prefill([0, 1])
    for _ in range(3):
        d.decode([0, 1])
    assert sd.num_graphs() == expected  # served from the captured graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_static_launch_never_waits(llama):
    """On CUDA, after warm-up, launching a static step makes no synchronising CUDA call (torch's
    sync debug mode raises on one), so step t+1 is enqueued behind step t: changed state rows
    (new pages every 4 tokens, a request leaving), a grammar mask and the result copies all
    go through pinned memory."""
    runner = _runner(llama, static=True, device="cuda")
    sd = runner.static_decode
    sd.config = dataclasses.replace(sd.config, check_decode_state=False)  # (it reads back)
    runner.warmup()
    d = Driver(runner, [list(range(3, 3 + n)) for n in (5, 11, 7)], [GREEDY, SAMPLED, GREEDY])
    d.prefill([0, 1, 2])
    allow_all = np.full(step_contract.mask_words(llama.config.vocab_size), -1, np.int32)
    for k in range(8):
        which = [0, 1, 2] if k < 4 else [0, 2]
        steps = [d._step(d.reqs[i], [d.reqs[i]["ids"][-1]], len(d.reqs[i]["ids"]) - 1)
                 for i in which]
        if k == 6:
            steps[0] = dataclasses.replace(steps[0], bitmask=allow_all)
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = sd.launch(steps, runner._last_token_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runner._last_token_ids = pending.device_token_ids
        for i, t in zip(which, pending.result().token_ids, strict=True):
            d.reqs[i]["ids"].append(int(t))
    assert sd.tails["masked"] == 1 and sd.tails["sample"] == 4 and sd.tails["greedy"] == 3
    assert sd.num_graphs() == len(sd.batch_buckets) * (len(sd.page_buckets) + 3)


def test_static_step_resolves_overlap_placeholders(llama):
    """Overlap scheduling dispatches decode step t+1 before step t's tokens reach the host, its
    inputs naming them by placeholder (`placeholder_id(row in step t)`). The static step gets
    the tokens a plain serial loop gets: three requests' steps dispatched back to back, then
    two of them after the first leaves (the rows shift: each names its row of step t)."""
    from sgl_tpu.executor.step import placeholder_id

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, llama.config.vocab_size, n).tolist() for n in (5, 8, 11)]
    schedule = [[0, 1, 2]] * 3 + [[1, 2]] * 3
    serial = Driver(_runner(llama, static=False), prompts, [GREEDY] * 3)
    serial.prefill([0, 1, 2])
    for which in schedule:
        serial.decode(which)

    d = Driver(_runner(llama, static=True), prompts, [GREEDY] * 3)
    mirror = d.runner.static_decode.state.mirror
    diff, int_rows_copied = mirror.diff, []

    def spy(*args):
        out = diff(*args)
        int_rows_copied.append(out[0][0].size)
        return out

    mirror.diff = spy
    d.prefill([0, 1, 2])  # each request now holds its prompt and one token
    emitted = {i: 1 for i in range(3)}
    prev_row = {i: i for i in range(3)}  # the request's row in the previous step
    handles = []
    for which in schedule:
        steps = []
        for i in which:
            r = d.reqs[i]
            step = d._step(r, [placeholder_id(prev_row[i])], r["prompt_len"] + emitted[i] - 1)
            steps.append(dataclasses.replace(step, num_output_tokens=emitted[i]))
            emitted[i] += 1
        prev_row = {i: row for row, i in enumerate(which)}
        handles.append((which, d.runner.dispatch(ForwardMode.DECODE, steps)))
    for which, handle in handles:
        for i, t in zip(which, handle.result().token_ids, strict=True):
            d.reqs[i]["ids"].append(int(t))
    assert [r["ids"] for r in d.reqs] == [r["ids"] for r in serial.reqs]
    # ints rows each step copied: all 4 of the bucket after the prefill (the 3 placeholders
    # resolved on the device), none while rows keep their requests (the device already holds
    # the token a placeholder names), both after the shift
    assert int_rows_copied == [4, 0, 0, 2, 0, 0]
