"""Speculative decoding (`--speculative-algorithm NGRAM|SUFFIX`): the n-gram drafter, the
suffix tree over recent outputs, the draft-length rule, the scheduler against a
hand-computable runner, and the in-process Engine with a tiny random model (SUFFIX, which
also drafts as NGRAM does), where every output with speculation must equal the output
without it:

* greedy, with and without grammars (regex, JSON schema), with stop strings, min/max tokens;
* seeded sampling (top-p / top-k / min-p), token for token, and log-probs;
* unseeded sampling: a chi-square two-sample test on the sampled tokens at draft positions;
* KV pages: integrity after every run, none left held.

One engine serves both sides: speculation is switched by swapping the scheduler's
`speculator` (same weights, same runner)."""

from __future__ import annotations

import json

import checkpoints as ck
import numpy as np
import pytest
from test_scheduler import PlusOneRunner, expected, request, run_all

from sgl_tpu import Engine
from sgl_tpu.config import SchedulerConfig, ServerArgs
from sgl_tpu.executor.step import ForwardMode
from sgl_tpu.scheduler.ngram import NgramIndex
from sgl_tpu.scheduler.speculative import (
    ACCEPT_PRIOR,
    GATE_FIRST_INTERVAL,
    GATE_MAX_INTERVAL,
    GATE_TRIAL_STEPS,
    ROW_COST_MAX,
    STEP_MIN,
    BucketGate,
    DraftGate,
    Speculator,
    StepCosts,
    accept,
    batch_bucket,
    choose_num_draft,
    expected_kept,
)
from sgl_tpu.scheduler.suffix import SuffixTree


# ---- drafter and rules ----------------------------------------------------------------------
def test_ngram_longest_match_wins_and_periodic_continuation():
    idx = NgramIndex(1, 3)
    idx.sync([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix (1 2 3) occurred at 0..2, followed by 9; (2 3) alone would say 7 (its latest)
    assert idx.propose(3) == ([9, 2, 3], 3)
    idx.sync([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3, 5])  # no earlier 5
    assert idx.propose(4) == ([], 0)
    rep = NgramIndex(1, 2)
    rep.sync([4, 5, 4, 5, 4])  # period 2: the continuation runs into the suffix
    assert rep.propose(5) == ([5, 4, 5, 4, 5], 2)
    rep.sync([4, 5, 6])  # cut back and changed: rebuilt
    assert rep.tokens == [4, 5, 6] and rep.propose(2) == ([], 0)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def _runs(outputs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Brute force: how often each run of up to `depth` tokens occurs in the outputs."""
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        for i in range(len(out)):
            for j in range(i + 1, min(i + depth, len(out)) + 1):
                counts[tuple(out[i:j])] = counts.get(tuple(out[i:j]), 0) + 1
    return counts


def _tree_runs(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    counts, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def test_suffix_tree_counts_every_run_and_removes_exactly():
    rng = np.random.default_rng(0)
    tree = SuffixTree(max_depth=5, max_cached_requests=3)
    outputs: dict[str, list[int]] = {}
    for step in range(60):  # 5 requests growing in random chunks, the oldest removed
        key = f"r{int(rng.integers(0, 5))}"
        chunk = rng.integers(0, 4, int(rng.integers(1, 4))).tolist()
        if key not in outputs:
            outputs[key] = []
        outputs[key] += chunk
        tree.extend(key, chunk)
        assert tree.output(key) is not None  # the request being extended stays
        for k in [k for k in outputs if tree.output(k) is None]:
            del outputs[k]  # removed, oldest first, past 3 requests
        assert len(tree) <= 3 and tree.num_tokens == sum(map(len, outputs.values()))
        assert _tree_runs(tree) == _runs(list(outputs.values()), 5), step
    for key in list(outputs):
        tree.remove(key)
    assert tree.root.children == {} and tree.num_tokens == 0


def test_suffix_tree_drafts_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8, max_cached_requests=10)
    tree.extend("a", [1, 2, 3, 4, 5])
    tree.extend("b", [1, 2, 3, 4, 6])
    tree.extend("c", [9, 2, 3, 4, 6])
    # after (2 3) came 4 three times, then 6 twice in three: probability 2/3
    assert tree.propose([7, 2, 3], 4, 0.1, 2.0) == ([4, 6], 2)
    assert tree.propose([7, 2, 3], 4, 0.7, 2.0) == ([4], 2)  # 2/3 < 0.7: cut
    assert tree.propose([7, 2, 3], 4, 0.1, 0.5) == ([4], 2)  # at most 0.5 x 2 tokens
    # the longer match (1 2 3): 4, then 5 and 6 once each (a tie: the first seen)
    assert tree.propose([1, 2, 3], 4, 0.1, 2.0) == ([4, 5], 3)
    assert tree.propose([8], 4, 0.1, 2.0) == ([], 0)


def test_suffix_tree_skips_a_running_requests_own_tail():
    # the running request's last tokens are in the tree with no continuation yet: the draft
    # comes from the longest suffix that has one
    tree = SuffixTree(max_depth=8, max_cached_requests=10)
    tree.extend("old", [5, 6, 7, 8])
    tree.extend("now", [1, 5, 6])
    assert tree.propose([1, 5, 6], 2, 0.1, 2.0) == ([7, 8], 2)
    tree.close("now")
    tree.extend("next", [2])  # a closed request is no longer extended from its last runs
    assert tree.output("now") == [1, 5, 6] and tree.num_tokens == 8


def test_accept_and_draft_length_rule():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept + bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch replaced
    assert accept([5], [4, 1]) == [4]
    assert expected_kept(0.5, 2) == pytest.approx(1.75)
    assert choose_num_draft(0.9, 8, 0.0) == 8  # free rows: draft the most
    assert choose_num_draft(0.05, 8, 0.25) == 0  # rows cost more than they keep
    assert 0 < choose_num_draft(0.6, 8, 0.25) < 8
    spec = Speculator(SchedulerConfig(page_size=4, max_running_requests=64, max_extend_seqs=8,
                                      chunked_prefill_size=64, context_len=512,
                                      speculative_algorithm="NGRAM"))
    assert spec.row_cost_at(1) < spec.row_cost_at(8) <= ROW_COST_MAX == spec.row_cost_at(64)


def test_step_costs_measure_a_rows_cost():
    costs = StepCosts()
    for i in range(STEP_MIN - 1):  # steps of 8..12 rows, 20 ms + 3 ms per row
        costs.record(8 + i % 5, 0.020 + 0.003 * (8 + i % 5))
    assert costs.row_cost(8) is None  # not fitted yet
    costs.record(8, 0.044)
    assert costs.row_cost(8) == pytest.approx(0.003 * 8 / 0.044)
    assert costs.row_cost(1) == pytest.approx(0.003 / 0.023)
    flat = StepCosts()  # one row count only: no slope to read
    for _ in range(2 * STEP_MIN):
        flat.record(8, 0.05)
    assert flat.row_cost(8) is None


def _drive(gate: BucketGate, steps: int, draft_s_per_token: float, plain_s_per_token: float,
           tokens: int = 4) -> int:
    """Run `steps` steps of a bucket whose arms cost what is given (a step emits `tokens`);
    returns how many of them drafted."""
    drafted = 0
    for _ in range(steps):
        arm = gate.arm()
        drafted += arm
        gate.record((draft_s_per_token if arm else plain_s_per_token) * tokens, tokens)
    return drafted


def test_draft_gate_keeps_plain_steps_where_drafts_cost_more():
    # a 2-core AVX-512 CPU without AMX: a lone stream's drafting steps cost 1.56x per token
    gate = BucketGate()
    drafted = _drive(gate, 4200, draft_s_per_token=0.0100, plain_s_per_token=0.0064)
    assert not gate.drafting and gate.switches == 0
    # only the trials drafted: 6 steps after 24, 48, ... incumbent steps, at most every 2048
    trials = gate.trials + (gate.trial_left > 0)
    assert drafted == GATE_TRIAL_STEPS * trials - gate.trial_left
    assert 6 <= trials <= 8 and drafted / 4200 < 0.015
    assert gate.interval == GATE_MAX_INTERVAL
    assert gate.cost[True] == pytest.approx(0.0100) and gate.cost[False] == pytest.approx(0.0064)


def test_draft_gate_drafts_where_it_pays_and_leaves_when_it_stops():
    # an AMX CPU: rows nearly free, drafting 1.75x cheaper per token
    gate = BucketGate()
    first = GATE_FIRST_INTERVAL + GATE_TRIAL_STEPS
    assert _drive(gate, first, 0.0046, 0.0081) == GATE_TRIAL_STEPS  # the first trial
    assert gate.drafting and gate.switches == 1
    assert _drive(gate, 2000, 0.0046, 0.0081) > 0.98 * 2000
    # the workload changes (nothing to copy): drafting now costs more; the next trial of plain
    # steps finds it within the longest spacing
    _drive(gate, GATE_MAX_INTERVAL + GATE_TRIAL_STEPS + 1, 0.0100, 0.0064)
    assert not gate.drafting and gate.switches == 2
    # a draft that is cheaper than plain steps by less than the margin does not win back
    _drive(gate, 3000, 0.0060, 0.0064)
    assert not gate.drafting


def test_draft_gate_decides_per_batch_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == \
        ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32"]
    gate = DraftGate()
    for _ in range(200):  # one stream: drafts cost; 8 streams: they pay
        for batch, (draft, plain) in ((1, (0.010, 0.0064)), (7, (0.002, 0.003))):
            arm = gate.drafting(batch)
            gate.record(4 * (draft if arm else plain), 4)
    info = gate.info()
    assert info["drafting_buckets"] == ["5-8"]
    assert info["buckets"]["1"]["plain_ms_per_token"] == pytest.approx(6.4)
    assert info["buckets"]["5-8"]["draft_ms_per_token"] == pytest.approx(2.0)
    gate.record(1.0, 1)  # no step asked about: nothing recorded
    assert gate.info() == info
    # under the gate a new request drafts in a trial at any batch size (the constants' row
    # cost, not a fit that could price every draft out so that no trial ever drafts)
    spec = Speculator(SchedulerConfig(page_size=4, max_running_requests=64, max_extend_seqs=8,
                                      chunked_prefill_size=64, context_len=512,
                                      speculative_algorithm="SUFFIX", speculative_gate=True))
    assert spec.step_costs is None and spec.gate is not None
    assert all(choose_num_draft(ACCEPT_PRIOR, 4, spec.row_cost_at(b)) > 0 for b in (1, 8, 64))


def test_config_validation_and_cli():
    from sgl_tpu.choices import check_registry_names
    from sgl_tpu.cli import parse_args

    args = parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                       "6"])
    assert args.speculative_algorithm == "NGRAM"
    assert args.scheduler_config(_runner_cfg()).speculative_num_draft_tokens == 6
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="must not exceed"):
        ServerArgs(speculative_ngram_min_match_window_size=5,
                   speculative_ngram_max_match_window_size=2)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        check_registry_names(ServerArgs(speculative_algorithm="EAGLE"))
    for name in ("auto", "none", None):
        check_registry_names(ServerArgs(speculative_algorithm=name))
    assert parse_args([]).speculative_algorithm == "auto"


def test_suffix_tree_depth_must_exceed_the_draft_length(capsys):
    from sgl_tpu.cli import parse_args

    # a draft of k matches at most max_depth - k context tokens: none at depth k, one at k + 1
    tree = SuffixTree(max_depth=4, max_cached_requests=10)
    tree.extend("old", [1, 2, 3, 4, 5])
    assert tree.propose([9, 1], 4, 0.1, 2.0) == ([], 0)
    tree = SuffixTree(max_depth=5, max_cached_requests=10)
    tree.extend("old", [1, 2, 3, 4, 5])
    assert tree.propose([9, 1], 4, 0.1, 2.0) == ([2, 3], 1)
    for algorithm in ("auto", "SUFFIX"):
        with pytest.raises(ValueError, match="raise --speculative-suffix-max-tree-depth above"):
            ServerArgs(speculative_algorithm=algorithm, speculative_num_draft_tokens=4,
                       speculative_suffix_max_tree_depth=4)
        ServerArgs(speculative_algorithm=algorithm, speculative_num_draft_tokens=4,
                   speculative_suffix_max_tree_depth=5)
    ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=32)  # no tree
    with pytest.raises(SystemExit):
        parse_args(["--speculative-num-draft-tokens", "32"])
    assert "raise --speculative-suffix-max-tree-depth above" in capsys.readouterr().err


def test_auto_speculation_resolves_to_suffix_on_cpus_only():
    from sgl_tpu.executor.registry import explain_speculation, resolve_speculation

    auto = ServerArgs(device="cpu")
    assert resolve_speculation(auto, "torch", False) == ("SUFFIX", None)
    assert explain_speculation(auto, "torch", False).startswith("auto -> SUFFIX, gated")
    assert explain_speculation(auto, "jax", False).startswith("auto -> off")
    # off where overlap scheduling runs, on the JAX runner, in deterministic mode, or asked off
    assert resolve_speculation(auto, "torch", True) == (None, None)
    assert resolve_speculation(auto, "jax", False) == (None, None)
    assert resolve_speculation(ServerArgs(device="cpu", enable_deterministic_inference=True),
                               "torch", False) == (None, None)
    for off in ("none", None):
        assert resolve_speculation(ServerArgs(speculative_algorithm=off), "torch", False) \
            == (None, None)
    # asked for by name: every batch size, every backend
    named = ServerArgs(speculative_algorithm="NGRAM")
    assert resolve_speculation(named, "jax", False) == ("NGRAM", None)
    cfg = named.scheduler_config(_runner_cfg(), speculative_algorithm="NGRAM",
                                 speculative_max_batch=2)
    assert (cfg.speculative_algorithm, cfg.speculative_max_batch) == ("NGRAM", 2)


def _runner_cfg():
    from sgl_tpu.config import RunnerConfig

    return RunnerConfig(model_path=None, dtype="float32", page_size=4, num_pages=8,
                        max_running_requests=4, max_extend_seqs=4, context_len=64,
                        token_buckets=(64,), seq_buckets=(1, 2, 4), kv_tile=8, block_q=8,
                        max_top_logprobs=2)


# ---- scheduler with a hand-computable runner ------------------------------------------------
def _spec_scheduler(num_pages: int = 64, max_running: int = 8, draft: int = 4,
                    max_batch: int | None = None, algorithm: str = "NGRAM", chunk: int = 64):
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=4, max_running_requests=max_running, max_extend_seqs=8,
                          chunked_prefill_size=chunk, context_len=512,
                          speculative_algorithm=algorithm, speculative_num_draft_tokens=draft,
                          speculative_max_batch=max_batch)
    runner = PlusOneRunner()
    sched = Scheduler(cfg, runner, num_pages=num_pages, decode=lambda ids, skip: "",
                      eos_token_ids=(), vocab_size=1000)
    sched.speculator.row_cost = sched.speculator.row_cost_slope = 0.0
    sched.speculator.step_costs = None
    return sched, runner


def test_scheduler_verifies_drafts_in_decode_rows_exactly():
    # The runner answers last token + 1; a prompt that already counted 100..119 once lets the
    # drafter predict the continuation exactly, so every draft token is kept.
    sched, runner = _spec_scheduler()
    prompts = {"a": list(range(100, 130)) + list(range(100, 110)),
               "b": list(range(300, 320)) + [7, 7] + list(range(300, 305))}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, 17)) is None
    out = run_all(sched)
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, 17), rid
        assert out[rid]["reason"] == {"type": "length", "length": 17}
    s = sched.stats
    # one wrong guess: b's prompt went on with 7 after 319, the runner says 320
    assert s.spec_accepted_tokens == s.spec_draft_tokens - 1 > 0
    decodes = [c for m, c in runner.calls if m == ForwardMode.DECODE]
    assert len(decodes) <= 6  # 16 tokens after the prefill's: 16 steps without drafts
    # a verify is one DECODE row per input (the last token, then each draft token), within
    # the largest decode batch (max_running_requests = 8 rows; 2 x 5 would not fit)
    assert max(len(c) for c in decodes) == 8
    assert sched.memory_info()["num_pages_requests"] == 0


def test_a_new_request_starts_from_the_servers_acceptance_rate():
    # Rows cost 0.35 of a sequence's share: at the 0.7 prior a request's first verify drafts
    # 2 tokens; after a's ~40 verifies kept every draft token, b's first verify drafts the
    # most (4)
    sched, runner = _spec_scheduler(num_pages=256)
    sched.speculator.row_cost = 0.35
    assert choose_num_draft(ACCEPT_PRIOR, 4, 0.35) == 2
    first_verify_rows = []
    for rid, base in (("a", 100), ("b", 600)):
        prompt = list(range(base, base + 200)) + list(range(base, base + 10))
        assert sched.add_request(request(rid, prompt, 150)) is None
        calls = len(runner.calls)
        out = run_all(sched)
        assert out[rid]["ids"] == expected(prompt, 150)
        decodes = [c for m, c in runner.calls[calls:] if m == ForwardMode.DECODE]
        first_verify_rows.append(len(decodes[0]))
        if rid == "a":
            assert sched.speculator.info()["accept_rate"] > 0.9
    assert sched.stats.spec_accepted_tokens == sched.stats.spec_draft_tokens > 0
    assert first_verify_rows == [1 + 2, 1 + 4]


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_suffix_drafts_from_other_requests_outputs(algorithm):
    # b's prompt has nothing to match in itself, but a's output (500, 501, ...) went on
    # from b's last token: SUFFIX drafts from it, NGRAM cannot
    sched, runner = _spec_scheduler(algorithm=algorithm)
    assert sched.add_request(request("a", [1, 2, 499], 30)) is None
    run_all(sched)
    assert sched.stats.spec_accepted_tokens == 0  # a's own output never repeats
    prompt = [7, 8, 9, 505]
    assert sched.add_request(request("b", prompt, 16)) is None
    out = run_all(sched)
    assert out["b"]["ids"] == expected(prompt, 16)
    decodes = [c for m, c in runner.calls if m == ForwardMode.DECODE]
    if algorithm == "NGRAM":
        assert sched.stats.spec_draft_tokens == 0 and len(decodes) == 29 + 15
    else:  # a draft of 1 (one token matched), then longer ones as b's run of a's grows
        assert sched.stats.spec_accepted_tokens == sched.stats.spec_draft_tokens > 5
        assert len(decodes) < 29 + 8
    assert sched.memory_info()["num_pages_requests"] == 0


@pytest.mark.parametrize("rows_cheap", [False, True])
def test_scheduler_gate_drafts_only_where_the_clock_says_it_pays(monkeypatch, rows_cheap):
    # A fake clock: a DECODE step of r rows takes 10 ms x r^1.5 (a row costs more than a
    # sequence's step: drafts never pay, even all kept) or 10 ms + 0.1 ms x r (rows nearly
    # free). Every draft is right (the prompt repeats), so only the clock decides.
    from types import SimpleNamespace

    from sgl_tpu.scheduler import scheduler as scheduler_module

    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    sched, runner = _spec_scheduler(num_pages=128)
    sched.speculator.gate = DraftGate()
    forward = runner.forward

    def timed_forward(mode, steps):
        rows = len(steps)
        clock[0] += 0.010 + 0.0001 * rows if rows_cheap else 0.010 * rows**1.5
        return forward(mode, steps)

    runner.forward = timed_forward
    prompt = list(range(100, 300)) + list(range(100, 105))
    assert sched.add_request(request("a", prompt, 120)) is None
    out = run_all(sched)
    assert out["a"]["ids"] == expected(prompt, 120)  # the gate never changes the output
    decodes = [c for m, c in runner.calls if m == ForwardMode.DECODE]
    drafted = sum(len(c) > 1 for c in decodes)
    bucket = sched.speculator.info()["gate"]["buckets"]["1"]
    if rows_cheap:  # plain steps first, then a trial of drafts wins: drafts from then on
        assert bucket["drafting"] and bucket["switches"] == 1
        assert decodes[GATE_FIRST_INTERVAL - 1] == [(1, len(prompt) + GATE_FIRST_INTERVAL - 1)]
        assert drafted == len(decodes) - GATE_FIRST_INTERVAL < 30
    else:  # only the trials drafted (each step of 5 rows, all kept: 22.4 ms per token)
        assert not bucket["drafting"] and bucket["switches"] == 0
        assert 0 < drafted <= GATE_TRIAL_STEPS * (bucket["trials"] + 1)
        assert bucket["draft_ms_per_token"] == pytest.approx(10 * 5**1.5 / 5, abs=0.01)
        assert bucket["plain_ms_per_token"] == 10.0


def test_scheduler_drafts_only_while_the_batch_is_small():
    # max_batch 2 (what `auto` resolves to on CPUs): 3 requests decoding together never
    # draft; once one finishes, the other two do (the prompts prefill in one EXTEND, so the
    # three start decoding together)
    sched, runner = _spec_scheduler(max_batch=2, chunk=256)
    # (each prompt's end repeats its start: the drafter finds the runner's continuation)
    prompts = {r: list(range(base, base + 40)) + list(range(base, base + 5))
               for r, base in (("a", 100), ("b", 200), ("c", 300))}
    lengths = {"a": 4, "b": 20, "c": 20}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, lengths[rid])) is None
    out = run_all(sched)
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, lengths[rid]), rid
    decodes = [c for m, c in runner.calls if m == ForwardMode.DECODE]
    # a's tokens 2..4 come from the first 3 decode steps, one row per request (no drafts);
    # then b and c draft: their last 16 tokens take fewer than 16 steps of more rows
    assert [len(c) for c in decodes[:3]] == [3, 3, 3]
    assert max(len(c) for c in decodes[3:]) > 2 and len(decodes) < 3 + 16, \
        [len(c) for c in decodes]
    assert sched.stats.spec_verify_reqs > 0 and sched.stats.spec_accepted_tokens > 0


def test_verify_rows_stay_within_the_runners_decode_row_limit():
    # A runner whose projections switch kernel above 5 rows (a quantized linear's dense copy):
    # 2 requests decode in steps of at most 5 rows with drafts (3 draft rows between them),
    # though max_running_requests would take 2 x 5.
    sched, runner = _spec_scheduler(max_running=16)
    sched.speculator.row_limit = 5
    prompts = {r: list(range(base, base + 40)) + list(range(base, base + 5))
               for r, base in (("a", 100), ("b", 200))}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, 16)) is None
    out = run_all(sched)
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, 16), rid
    decodes = [len(c) for m, c in runner.calls if m == ForwardMode.DECODE]
    assert max(decodes) == 5 and sched.stats.spec_accepted_tokens > 0, decodes


def test_scheduler_speculation_under_kv_pressure_keeps_outputs_exact():
    # 15 usable pages of 4 tokens; each request grows to 20 + 24 tokens (11 pages)
    sched, _ = _spec_scheduler(num_pages=16, max_running=6)
    prompts = {f"r{i}": list(range(100 * i, 100 * i + 16)) + list(range(100 * i, 100 * i + 4))
               for i in range(3)}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, 24)) is None
    out = run_all(sched)  # checks integrity after every step
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, 24), rid
    assert sched.stats.spec_accepted_tokens > 0 and sched.stats.num_retractions > 0
    tree_pages = sched.kv.tree.evictable_size() // 4
    assert sched.kv.allocator.num_free_pages + tree_pages == 15


# ---- the Engine with a tiny random model ----------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")
    eng = Engine(model_dir, page_size=4, max_total_tokens=4096, max_running_requests=16,
                 max_extend_seqs=8, chunked_prefill_size=256, min_token_bucket=32,
                 kv_tile=16, block_q=16, backend="torch", dtype="float32",
                 speculative_algorithm="SUFFIX", speculative_num_draft_tokens=4)
    spec = eng.scheduler.speculator
    spec.row_cost = spec.row_cost_slope = 0.0  # draft whenever the n-grams match (coverage)
    spec.step_costs = None
    yield eng
    eng.shutdown()


def _prompts(engine, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (agents' context does), so the n-grams match."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    out = []
    for _ in range(n):
        unit = rng.integers(3, vocab, int(rng.integers(4, 12))).tolist()
        out.append(unit * 3 + rng.integers(3, vocab, 3).tolist() + unit[:2])
    return out


def _generate(engine, spec: bool, prompts, params, **kw):
    sched = engine.scheduler
    saved = sched.speculator
    before = sched.stats.spec_verify_reqs
    if not spec:
        sched.speculator = None
    try:
        engine.flush_cache()
        outs = engine.generate(input_ids=prompts, sampling_params=params, **kw)
    finally:
        sched.speculator = saved
    sched.check_integrity()
    assert sched.memory_info()["num_pages_requests"] == 0
    if not spec:
        assert sched.stats.spec_verify_reqs == before
    return outs


def _tokens(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_greedy_identical_with_stops_and_lengths(engine):
    prompts = _prompts(engine, 6)
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 7},
              {"temperature": 0, "max_new_tokens": 30, "min_new_tokens": 20},
              {"temperature": 0, "max_new_tokens": 30, "stop": ["e", " t"]},
              {"temperature": 0, "max_new_tokens": 25, "frequency_penalty": 0.5},
              {"temperature": 0, "max_new_tokens": 33, "top_k": 1}]
    base = _generate(engine, False, prompts, params)
    stats = engine.scheduler.stats
    drafted, kept = stats.spec_draft_tokens, stats.spec_accepted_tokens
    spec = _generate(engine, True, prompts, params)
    assert stats.spec_verify_reqs > 0
    assert _tokens(spec) == _tokens(base)
    assert [o["text"] for o in spec] == [o["text"] for o in base]
    assert [o["meta_info"]["finish_reason"] for o in spec] == \
        [o["meta_info"]["finish_reason"] for o in base]
    assert stats.spec_draft_tokens > drafted and stats.spec_accepted_tokens > kept


def test_greedy_identical_under_grammars(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "maxItems": 4,
                                                        "items": {"enum": ["ab", "cd"]}}},
              "required": ["name", "tags"]}
    prompts = _prompts(engine, 4, seed=1)
    params = [{"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(schema)},
              {"temperature": 0, "max_new_tokens": 40, "regex": r"(ab|cd|e){3,20}"},
              {"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(schema)},
              {"temperature": 0, "max_new_tokens": 30, "regex": r"[a-c]{1,25}x"}]
    base = _generate(engine, False, prompts, params)
    stats = engine.scheduler.stats
    drafted, kept = stats.spec_draft_tokens, stats.spec_accepted_tokens
    spec = _generate(engine, True, prompts, params)
    assert _tokens(spec) == _tokens(base)
    assert stats.spec_draft_tokens > drafted and stats.spec_accepted_tokens > kept
    for o in spec[::2]:  # the tiny model rambles: the object may be cut at max_new_tokens
        assert o["text"].startswith('{"name"')


SAMPLED = [{"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30},
           {"temperature": 1.0, "top_k": 20, "max_new_tokens": 30},
           {"temperature": 0.6, "min_p": 0.05, "max_new_tokens": 30, "stop": ["e"]},
           {"temperature": 0.5, "max_new_tokens": 30, "presence_penalty": 0.3}]


def test_seeded_sampling_identical_with_logprobs(engine):
    prompts = _prompts(engine, 4, seed=2)
    params = [{**p, "seed": 11 + i} for i, p in enumerate(SAMPLED)]
    kw = {"return_logprob": True, "top_logprobs_num": 2}
    base = _generate(engine, False, prompts, params, **kw)
    spec = _generate(engine, True, prompts, params, **kw)
    assert _tokens(spec) == _tokens(base)
    for b, s in zip(base, spec, strict=True):
        lb, ls = b["meta_info"]["output_token_logprobs"], s["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in ls] == [t[1] for t in lb] == s["output_ids"]
        np.testing.assert_allclose([t[0] for t in ls], [t[0] for t in lb], atol=1e-4)
        tb, ts = b["meta_info"]["output_top_logprobs"], s["meta_info"]["output_top_logprobs"]
        assert [[t[1] for t in row] for row in ts] == [[t[1] for t in row] for row in tb]


def test_sampled_distribution_matches_plain_decoding(engine, monkeypatch):
    """Independent samples (disjoint seeds) with and without speculation: the tokens at output
    positions 1..3, where drafts are verified, must be drawn from the same distribution
    (chi-square two-sample test over the tokens seen at least 10 times, the rest pooled).
    The drafts are the greedy continuation (the likeliest tokens), so the verify both keeps
    and rejects them often."""
    from scipy.stats import chi2_contingency

    prompt = _prompts(engine, 1, seed=3)[0]
    n = 240
    # the random model's logits are flat: a low temperature and top-k make a spread of
    # likely and unlikely tokens
    sp = {"temperature": 0.15, "top_k": 3, "max_new_tokens": 4, "ignore_eos": True}
    greedy = engine.generate(input_ids=prompt, sampling_params={**sp, "temperature": 0})
    guess = greedy["output_ids"]
    monkeypatch.setattr(engine.scheduler.speculator.drafter, "propose",
                        lambda req, k: guess[len(req.output_ids) : len(req.output_ids) + k])
    stats = engine.scheduler.stats
    drafted, kept = stats.spec_draft_tokens, stats.spec_accepted_tokens
    chunk = 4  # requests per call: their drafts fit the decode batch (16 rows)

    def run(spec: bool, seed0: int) -> list[dict]:
        return [o for c in range(0, n, chunk) for o in _generate(
            engine, spec, [prompt] * chunk,
            [{**sp, "seed": seed0 + c + s} for s in range(chunk)])]

    spec = run(True, 0)
    num_drafted, num_kept = stats.spec_draft_tokens - drafted, stats.spec_accepted_tokens - kept
    assert num_drafted > n and 0.1 < num_kept / num_drafted < 0.9  # kept and rejected
    base = run(False, 10_000)
    for pos in (1, 2, 3):
        a = [o["output_ids"][pos] for o in spec]
        b = [o["output_ids"][pos] for o in base]
        values, counts = np.unique(a + b, return_counts=True)
        common = values[counts >= 10].tolist()
        table = [[sum(t == v for t in side) for v in common]
                 + [sum(t not in common for t in side)] for side in (a, b)]
        table = np.array(table)
        table = table[:, table.sum(axis=0) > 0]
        assert table.shape[1] >= 2, "degenerate distribution: the test would prove nothing"
        p_value = chi2_contingency(table)[1]
        assert p_value > 1e-3, (pos, table.tolist())


def test_jax_backend_greedy_identical(tmp_path_factory):
    """The JAX runner runs the same verify rows (a DECODE batch of more sequences)."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("mj") / "llama", "llama")
    eng = Engine(model_dir, page_size=4, max_total_tokens=2048, max_running_requests=8,
                 max_extend_seqs=4, chunked_prefill_size=128, min_token_bucket=64,
                 kv_tile=16, block_q=16, backend="jax", dtype="float32", skip_warmup=True,
                 speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    try:
        eng.scheduler.speculator.row_cost = eng.scheduler.speculator.row_cost_slope = 0.0
        eng.scheduler.speculator.step_costs = None
        prompts = _prompts(eng, 2, seed=5)
        params = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                  {"temperature": 0.7, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}]
        base = _generate(eng, False, prompts, params)
        spec = _generate(eng, True, prompts, params)
        assert _tokens(spec) == _tokens(base)
        assert eng.scheduler.stats.spec_accepted_tokens > 0
    finally:
        eng.shutdown()


# ---- the default model's server: `auto` speculation ------------------------------------------
@pytest.fixture
def fresh_f32_server():
    """A float32 default-model server of its own: the draft gate decides from the steps it has
    timed, so on a server other tests used it may already have priced drafts out at one row
    and spaced its next trial past a 64-token request. `auto` named, so that
    SGL_TPU_TEST_SPECULATIVE (server_harness.py) leaves it the shipped setting."""
    from server_harness import DEFAULT_MODEL_F32_FLAGS, launch_server

    server = launch_server(*DEFAULT_MODEL_F32_FLAGS, "--speculative-algorithm", "auto")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_default_server_speculates_for_a_lone_request(fresh_f32_server):
    """The shipped server (torch, CPU, `--speculative-algorithm auto`): SUFFIX behind the draft
    gate, which starts plain and tries drafts after GATE_FIRST_INTERVAL steps, so a lone
    agent-like request on a fresh server verifies drafts within its 64 tokens; /server_info
    says what auto resolved to and the gate's live decision; the greedy text equals the same
    prompt's in a batch of 3 (float32)."""
    import requests

    server = fresh_f32_server
    prompt = ("Tool result: {\"city\": \"Paris\", \"temperature_c\": 21, \"sky\": \"clear\"}\n"
              * 4 + "Summarize the tool result above, repeating it exactly:\n")
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}

    def generate(text):
        r = requests.post(server.base_url + "/generate",
                          json={"text": text, "sampling_params": params}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    before = server.wait_idle()["stats"]
    lone = generate(prompt)
    after_lone = server.wait_idle()
    batch = generate([prompt] * 3)
    info = server.wait_idle()
    stats = after_lone["stats"]
    assert stats["spec_verify_reqs"] > before["spec_verify_reqs"]
    assert stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    spec = after_lone["speculative"]
    assert spec["algorithm"] == "SUFFIX" and spec["resolution"].startswith("auto -> SUFFIX")
    lone_gate = spec["gate"]["buckets"]["1"]
    assert lone_gate["trials"] >= 1 and lone_gate["plain_ms_per_token"] > 0
    assert (lone_gate["drafting"] is True) == ("1" in spec["gate"]["drafting_buckets"])
    assert [o["text"] for o in batch] == [lone["text"]] * 3
    assert lone["meta_info"]["completion_tokens"] == 64
    assert info["memory"]["num_pages_requests"] == 0


# ---- the default path: drafts never change a greedy token ---------------------------------------
SYSTEM = ("You are a travel agent's assistant. Tools: search_flights(origin, destination, "
          "date), book_hotel(city, nights), get_weather(city). Answer briefly. " * 12)
QUESTIONS = ["Count from one to five.", "Tell a story.", "List the days of the week.",
             "Repeat: the cat sat on the mat, the cat sat on the mat.",
             "Write a Python function that adds two numbers.",
             "What is the capital of France? Answer in a sentence."]


@pytest.fixture(scope="module")
def default_engine():
    """The shipped model on the default path of the host that runs the tests (`auto`
    quantization: int8 activations where the kernels have the tiles (AVX512-VNNI, AVX-VNNI,
    AVX2); the fused attention, bfloat16
    products where it has AVX512-BF16), with drafts forced: every n-gram match is drafted."""
    from sgl_tpu.loader.default_model import default_model_path

    eng = Engine(default_model_path(), speculative_algorithm="SUFFIX")
    spec = eng.scheduler.speculator
    spec.row_cost = spec.row_cost_slope = 0.0
    spec.step_costs = spec.gate = None
    yield eng
    eng.shutdown()


@pytest.mark.isa_invariance
@pytest.mark.parametrize("system", [False, True], ids=["short", "shared-prefix"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["one-by-one", "batch"])
def test_default_path_greedy_identical_with_drafts(default_engine, system, concurrent):
    """Greedy chats on the default path give the same tokens with drafts and without, one at a
    time and as a batch of 6 (a verify's k + 1 rows and its batch mates must leave each row's
    bits as a one-row decode computes them: row-invariant GEMMs, batch-invariant attention);
    with a long system prompt the decode steps read a shared prefix of whole chunks. A
    verify of the first pass's outputs drafts them (the suffix tree holds them), so drafts
    are kept on any host."""
    eng = default_engine
    tok = eng.tokenizer
    prompts = [tok.apply_chat_template(([{"role": "system", "content": SYSTEM}] if system
                                        else []) + [{"role": "user", "content": q}])
               for q in QUESTIONS]
    params = {"temperature": 0, "max_new_tokens": 40}

    def run(spec: bool) -> list[list[int]]:
        if concurrent:
            return _tokens(_generate(eng, spec, [tok.encode(p) for p in prompts],
                                     [params] * len(prompts)))
        return [_generate(eng, spec, [tok.encode(p)], [params])[0]["output_ids"]
                for p in prompts]

    stats = eng.scheduler.stats
    kept = stats.spec_accepted_tokens
    base = run(False)
    assert run(True) == base
    assert stats.spec_accepted_tokens > kept
