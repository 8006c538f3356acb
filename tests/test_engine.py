"""The in-process Engine: prefix reuse across calls, stop conditions, n > 1, seeds, bad input,
and no XLA compilation after warm-up on mixed traffic (tiny random model, real code path)."""

from __future__ import annotations

import re
import threading

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu import Engine
from sgl_tpu.engine import GenerationError

GREEDY = {"temperature": 0.0}


# (TorchModelRunner method, the thread it ran on) for the "torch-overlap" engine
TORCH_CALLS: list[tuple[str, threading.Thread]] = []
RECORDED = ("_build", "_warmup", "_run", "_token_logprobs", "_row_logits")


@pytest.fixture(scope="module", params=["jax", "torch", "torch-overlap"])
def engine(request, tmp_path_factory):
    """Both executor backends, float32 (outputs are compared across calls), torch compiled (so
    the no-compilation-after-warm-up test covers torch.compile's buckets too). torch-overlap:
    overlap scheduling on, so every torch call runs on the runner's compute thread (recorded
    in TORCH_CALLS)."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")
    backend, _, overlap = request.param.partition("-")
    with pytest.MonkeyPatch.context() as mp:
        if overlap:
            from sgl_tpu.backends.torch.runner import TorchModelRunner

            for name in RECORDED:
                mp.setattr(TorchModelRunner, name, _recording(name, getattr(TorchModelRunner,
                                                                            name)))
        eng = Engine(model_dir, page_size=4, max_total_tokens=2048, max_running_requests=8,
                     max_extend_seqs=4, chunked_prefill_size=128, min_token_bucket=32,
                     kv_tile=16, block_q=16, backend=backend, dtype="float32",
                     torch_compile="on", overlap_schedule="on" if overlap else "auto")
        yield eng
        compute = eng.scheduler.runner._compute if backend == "torch" else None
        eng.shutdown()
        assert compute is None or not compute.thread.is_alive()  # shutdown ended it


def _recording(name, method):
    def recorded(self, *args, **kwargs):
        TORCH_CALLS.append((name, threading.current_thread()))
        return method(self, *args, **kwargs)

    return recorded


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_no_compilation_after_warmup_on_mixed_traffic(engine):
    compiled = engine.scheduler.runner.num_compilations()
    assert compiled > 0
    vocab = engine.model_config.vocab_size
    shared = _ids(150, 0, vocab)  # longer than one chunk: chunked prefill
    prompts = [shared + _ids(n, i, vocab) for i, n in enumerate((5, 17, 40, 1, 90, 3))]
    params = [{"temperature": 0, "max_new_tokens": 9},
              {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "seed": 1},
              {"temperature": 1.0, "top_k": 5, "min_p": 0.1, "max_new_tokens": 3},
              {"temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": 0.2,
               "repetition_penalty": 1.2, "max_new_tokens": 12},
              {"temperature": 0, "max_new_tokens": 0},
              {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                           logprob_start_len=140, top_logprobs_num=3)
    assert [o["meta_info"]["completion_tokens"] for o in outs][4] == 0
    engine.generate(input_ids=_ids(7, 9, vocab), sampling_params={"n": 3, "max_new_tokens": 4})
    assert engine.scheduler.runner.num_compilations() == compiled
    engine.scheduler.check_integrity()
    assert engine.scheduler.memory_info()["num_pages_requests"] == 0


def test_prefix_reuse_across_calls_and_identical_greedy_output(engine):
    vocab = engine.model_config.vocab_size
    prompt = _ids(64, 3, vocab)
    first = engine.generate(input_ids=prompt + [5], sampling_params={**GREEDY,
                                                                      "max_new_tokens": 8})
    second = engine.generate(input_ids=prompt + [5], sampling_params={**GREEDY,
                                                                       "max_new_tokens": 8})
    assert second["meta_info"]["cached_tokens"] >= 64
    assert second["output_ids"] == first["output_ids"]
    engine.scheduler.check_integrity()


def test_encode_pools_the_last_hidden_state(engine):
    """`Engine.encode` (`last` pooling): the unit vector of transformers' last hidden state of
    the prompt; a batch answers in order; a second call, a prefix-cache hit, gives the same
    vector; `dimensions` keeps the first values, normalized."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = engine.model_config.vocab_size
    prompts = [_ids(40, 11, vocab), _ids(7, 12, vocab)]
    hf = AutoModelForCausalLM.from_pretrained(engine.server_args.model_path,
                                              dtype=torch.float32)
    with torch.inference_mode():
        refs = [hf.model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in prompts]
    batch = engine.encode(input_ids=prompts)
    again = engine.encode(input_ids=prompts[0])
    assert again["meta_info"]["cached_tokens"] >= 32
    for out, ref, p in zip(batch, refs, prompts, strict=True):
        assert out["meta_info"]["prompt_tokens"] == len(p)
        np.testing.assert_allclose(out["embedding"], ref / np.linalg.norm(ref), atol=1e-4)
    np.testing.assert_allclose(again["embedding"], batch[0]["embedding"], atol=1e-5)
    short = engine.encode(input_ids=prompts[1], dimensions=4)["embedding"]
    np.testing.assert_allclose(short, refs[1][:4] / np.linalg.norm(refs[1][:4]), atol=1e-4)
    with pytest.raises(GenerationError, match="dimensions"):
        engine.encode(input_ids=prompts[1], dimensions=0)
    engine.scheduler.check_integrity()


def test_step_counters_count_computed_tokens_and_step_time(engine):
    """`/server_info`'s step counters: EXTEND steps count the tokens they computed (a cached
    prefix is not among them), and both step kinds add their time."""
    vocab = engine.model_config.vocab_size
    prompt = _ids(40, 11, vocab)
    params = {**GREEDY, "max_new_tokens": 5, "ignore_eos": True}
    cached = []
    for ids in (prompt, prompt + [7, 8, 9]):
        before = engine.get_server_info()["stats"]
        out = engine.generate(input_ids=ids, sampling_params=params)
        after = engine.get_server_info()["stats"]
        cached.append(out["meta_info"]["cached_tokens"])
        computed = len(ids) - cached[-1]
        assert after["extend_tokens"] - before["extend_tokens"] == computed
        assert after["num_extend_steps"] > before["num_extend_steps"]
        assert after["extend_seconds"] > before["extend_seconds"]
        assert after["num_decode_steps"] > before["num_decode_steps"]
        assert after["decode_seconds"] > before["decode_seconds"]
    assert cached[1] >= 36  # the first prompt's whole pages


def test_n_and_seeds(engine):
    vocab = engine.model_config.vocab_size
    prompt = _ids(20, 4, vocab)
    sp = {"temperature": 1.0, "max_new_tokens": 12, "seed": 42, "ignore_eos": True}
    a = engine.generate(input_ids=prompt, sampling_params={**sp, "n": 3})
    b = engine.generate(input_ids=prompt, sampling_params={**sp, "n": 3})
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]  # seeded: reproducible
    assert len({tuple(x["output_ids"]) for x in a}) > 1  # seed + k: different samples


def test_stop_conditions(engine):
    vocab = engine.model_config.vocab_size
    prompt = _ids(10, 5, vocab)
    base = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12,
                                                               "ignore_eos": True})
    ids = base["output_ids"]
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # stop token id: ends at its first occurrence (included in output_ids, not in the text)
    stop_id = ids[5]
    out = engine.generate(input_ids=prompt, sampling_params={
        **GREEDY, "max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [stop_id]})
    k = ids.index(stop_id)
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # min_new_tokens suppresses an early stop
    out = engine.generate(input_ids=prompt, sampling_params={
        **GREEDY, "max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [ids[0]],
        "min_new_tokens": 3})
    assert len(out["output_ids"]) >= 3
    # stop string: text is trimmed before it
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = engine.generate(input_ids=prompt, sampling_params={
            **GREEDY, "max_new_tokens": 12, "ignore_eos": True, "stop": [stop]})
        assert out["text"] == text[: text.find(stop)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        # stop_regex: the first match ends the request, trimmed; matched is the pattern
        pattern = f"{re.escape(stop)}|\\d{{7}}"
        out = engine.generate(input_ids=prompt, sampling_params={
            **GREEDY, "max_new_tokens": 12, "ignore_eos": True, "stop_regex": pattern})
        assert out["text"] == text[: re.search(pattern, text).start()]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_stream_interval(engine):
    """A stream yields a dict once the request has a token, then once `stream_interval` more
    arrived, and the final one, whatever a step brings (a speculative verify brings several
    tokens, so the every-step stream and the interval-4 one need not see the same counts):
    with 4, every dict between the first and the last is at least 4 tokens past the one
    before it, and both streams end with the whole output."""
    sp = {**GREEDY, "max_new_tokens": 14, "ignore_eos": True}
    prompt = _ids(9, 50, engine.model_config.vocab_size)
    whole = engine.generate(input_ids=prompt, sampling_params=sp)
    counts = {}
    for interval in (1, 4):
        chunks = list(engine.generate(input_ids=prompt, stream=True,
                                      sampling_params={**sp, "stream_interval": interval}))
        assert chunks[-1]["meta_info"]["finish_reason"] is not None
        assert chunks[-1]["output_ids"] == whole["output_ids"]
        counts[interval] = [c["meta_info"]["completion_tokens"] for c in chunks]
    every_step, four = counts[1], counts[4]
    for c in (every_step, four):
        assert c[0] == 1 and c[-1] == 14 and c == sorted(set(c)), counts
    assert all(b - a >= 4 for a, b in zip(four[:-2], four[1:-1], strict=True)), counts
    assert len(four) <= 1 + -(-13 // 4) and len(four) <= len(every_step), counts


def test_input_logprobs_match_output_logprobs(engine):
    """The log-prob of a generated token equals its input log-prob when fed back."""
    vocab = engine.model_config.vocab_size
    prompt = _ids(12, 6, vocab)
    out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4,
                                                             "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=2)
    lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    again = engine.generate(input_ids=prompt + out["output_ids"],
                            sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0)
    inp = again["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(prompt) + 4 and inp[0][0] is None
    np.testing.assert_allclose([e[0] for e in inp[-4:]], lps, atol=1e-4)
    tops = out["meta_info"]["output_top_logprobs"]
    assert all(len(t) == 2 and t[0][0] >= t[1][0] for t in tops)


@pytest.mark.parametrize("kwargs,match", [
    ({"input_ids": [1] * 3000}, "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "exceeds"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": -5}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_regex": ["a("]}}, "invalid regular exp"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_regex": "a*"}}, "matches the empty"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": []}, "empty"),
    ({}, "exactly one"),
])
def test_bad_input_raises_clear_error(engine, kwargs, match):
    with pytest.raises(GenerationError, match=match):
        engine.generate(**kwargs)
    # ... and the engine keeps serving.
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert out["meta_info"]["completion_tokens"] == 2
    engine.scheduler.check_integrity()


@pytest.mark.parametrize("path,match", [
    ("/nonexistent/model", "does not exist"),
])
def test_bad_model_path(path, match):
    with pytest.raises(FileNotFoundError, match=match):
        Engine(path)


def test_unsupported_architecture(tmp_path):
    import json

    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "mamba"
    cfg["architectures"] = ["MambaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mamba"):
        Engine(model_dir, skip_warmup=True)


def test_overlap_schedule_gives_the_serial_outputs(engine):
    """The same engine with overlap scheduling off, then on: token-for-token the same outputs
    (and log-probs) under mixed traffic: chunked prefill, greedy and seeded sampling with
    penalties, stop ids and strings met mid-batch (found one step late under overlap),
    max_new_tokens hit mid-batch, n > 1, and a grammar with jump-forward (its steps run the
    serial way). Every page is back once all finish."""
    sched = engine.scheduler
    vocab = engine.model_config.vocab_size
    shared = _ids(150, 11, vocab)  # longer than one chunk
    base = engine.generate(input_ids=shared, sampling_params={**GREEDY, "max_new_tokens": 16,
                                                               "ignore_eos": True})
    text = base["text"]
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    prompts = [shared, shared + _ids(9, 12, vocab), _ids(30, 13, vocab), shared,
               _ids(5, 14, vocab), _ids(40, 15, vocab), _ids(12, 16, vocab)]
    params = [{**GREEDY, "max_new_tokens": 16, "stop_token_ids": [base["output_ids"][6]]},
              {**GREEDY, "max_new_tokens": 9},
              {"temperature": 0.9, "top_k": 20, "frequency_penalty": 0.4,
               "repetition_penalty": 1.1, "max_new_tokens": 14, "seed": 3, "ignore_eos": True},
              {**GREEDY, "max_new_tokens": 16, "ignore_eos": True,
               **({"stop": [stop_str]} if stop_str.strip() else {})},
              {**GREEDY, "max_new_tokens": 1},
              {**GREEDY, "max_new_tokens": 20, "ignore_eos": True},
              {"temperature": 1.0, "max_new_tokens": 7, "seed": 5, "n": 3, "ignore_eos": True}]
    grammar = {**GREEDY, "max_new_tokens": 12, "regex": r"The answer is (yes|no)\. [0-9]{3}"}

    def run() -> list:
        assert sched.flush_cache()  # the same (uncached) prefills in both runs
        outs = [engine.generate(input_ids=p, sampling_params=sp, return_logprob=True,
                                top_logprobs_num=2) for p, sp in zip(prompts[-1:], params[-1:],
                                                                     strict=True)][0]
        outs += engine.generate(input_ids=prompts[:-1], sampling_params=params[:-1],
                                return_logprob=True, top_logprobs_num=2)
        outs += engine.generate(input_ids=prompts[1:4], sampling_params=[
            params[1], grammar, params[5]], return_logprob=True)
        sched.check_integrity()
        assert engine.scheduler.memory_info()["num_pages_requests"] == 0
        return [(o["output_ids"], o["meta_info"]["finish_reason"],
                 [round(e[0], 4) for e in o["meta_info"]["output_token_logprobs"]])
                for o in outs]

    # both runs without speculation (`auto` drafts on CPUs; overlap scheduling excludes it,
    # and its verify rows may round a log-prob differently from a plain step's)
    enabled, speculator = sched.overlap, sched.speculator
    sched.speculator = None
    try:
        sched.overlap = False
        serial = run()
        sched.overlap = True
        overlapped = sched.stats.num_overlapped_steps
        assert run() == serial
        assert sched.stats.num_overlapped_steps > overlapped + 10
    finally:
        sched.overlap, sched.speculator = enabled, speculator
    assert any(r[1]["type"] == "stop" for r in serial)  # a stop did end a request early
    assert engine.tokenizer.decode(serial[-2][0]).startswith("The answer is ")  # the grammar


def test_torch_overlap_runs_every_torch_call_on_the_compute_thread(engine):
    """Under overlap scheduling on CPU the torch runner's every call (building the model,
    warm-up, prefill and decode steps, log-probs) runs on its one compute thread, so the
    scheduler's thread never starts an OpenMP team of its own (compute_thread.py). (The
    fixture checks that shutdown ends the thread.)"""
    runner = engine.scheduler.runner
    if runner.config.backend != "torch" or not runner.config.cpu_compute_thread:
        assert engine.scheduler.config.overlap_schedule is False  # auto is off on CPU
        pytest.skip("the torch-overlap engine's test")
    vocab = engine.model_config.vocab_size
    overlapped = engine.scheduler.stats.num_overlapped_steps
    engine.generate(input_ids=[_ids(140, 40, vocab), _ids(20, 41, vocab)],
                    sampling_params={**GREEDY, "max_new_tokens": 12, "ignore_eos": True},
                    return_logprob=True, logprob_start_len=0)
    assert engine.scheduler.stats.num_overlapped_steps > overlapped
    compute = runner._compute.thread
    assert compute is not threading.main_thread() and compute.is_alive()
    assert {t for _, t in TORCH_CALLS} == {compute}
    assert {"_build", "_warmup", "_run", "_token_logprobs"} <= {n for n, _ in TORCH_CALLS}


def test_samples_follow_expand_n():
    """`SamplingParams.samples` (the Engine's per-sample params, not parsed again) equals
    parsing each of `expand_n`'s sample dicts (the HTTP routes' rule)."""
    from sgl_tpu.sampling_params import SamplingParams, expand_n

    for d in ({"n": 3, "seed": 2**63 - 2, "temperature": 0.5, "stop": "x"},
              {"n": 2, "sampling_seed": 7}, {"n": 4}, {"seed": 5}, {}):
        parsed = SamplingParams.from_dict(d)
        samples = parsed.samples()
        assert samples == [SamplingParams.from_dict(x) for x in expand_n(d, parsed.n)]
        assert [s.seed for s in samples] == [
            SamplingParams.from_dict(x).seed for x in expand_n(d, parsed.n)]
        assert all(s.n == 1 for s in samples)
    one = SamplingParams(temperature=0.3)
    assert one.samples()[0] is one


def test_engine_parses_sampling_params_once(tmp_path, monkeypatch):
    """The in-process Engine parses a request's sampling params once: its scheduler takes the
    parsed ones (one per sample for n > 1) instead of parsing the message's dict again."""
    from sgl_tpu.sampling_params import SamplingParams
    from sgl_tpu.scheduler.intake import Intake

    parse = SamplingParams.from_dict.__func__
    calls, parsed, admitted = [], [], []

    def counting(cls, d):
        calls.append(d)
        parsed.append(parse(cls, d))
        return parsed[-1]

    new_req = Intake.new_req

    def admitting(self, msg, sampling=None):
        admitted.append(sampling)
        return new_req(self, msg, sampling)

    monkeypatch.setattr(SamplingParams, "from_dict", classmethod(counting))
    monkeypatch.setattr(Intake, "new_req", admitting)
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    with Engine(model_dir, backend="torch", torch_compile="off", skip_warmup=True,
                page_size=4, max_total_tokens=256, max_running_requests=4) as eng:
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2})
        assert out["meta_info"]["completion_tokens"] == 2
        assert len(calls) == 1 and len(admitted) == 1 and admitted[0] is parsed[0]

        calls.clear(), parsed.clear(), admitted.clear()
        outs = eng.generate(input_ids=[5, 6, 7], sampling_params={
            "max_new_tokens": 2, "temperature": 0.7, "n": 3, "seed": 11})
        assert len(outs) == 3 and len(calls) == 1
        assert [s.seed for s in admitted] == [11, 12, 13] and {s.n for s in admitted} == {1}

        calls.clear(), parsed.clear(), admitted.clear()
        with pytest.raises(GenerationError, match=r"temperature must be in \[0.0, 100.0\]"):
            eng.generate(input_ids=[5, 6, 7], sampling_params={"temperature": -1})
        assert len(calls) == 1 and admitted == []  # refused before the scheduler
        with pytest.raises(GenerationError, match="context"):
            eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 10**6})
        assert len(calls) == 2 and len(admitted) == 1  # the scheduler's checks still run
