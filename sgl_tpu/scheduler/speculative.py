"""Speculative decoding (host side, no JAX): draft a few tokens per running request, verify
them all in one DECODE step, keep the longest verified run plus one token from the model.

A request with draft d0 .. d(k-1) (from a drafter of `DRAFTERS`, e.g. n-gram lookup in its own
context) takes k + 1 rows of the DECODE step instead of one. Row j feeds the token before
output position o + j (o = outputs so far) and samples output position o + j:

    row      input      prefix_len   samples position   mask (grammar / min_new_tokens)
    0        last out   kv_len       o                  after the outputs
    1        d0         kv_len + 1   o + 1              after d0
    ...
    k        d(k-1)     kv_len + k   o + k              after d0 .. d(k-1)

Every row writes its input's K/V at its own position and attends to positions < prefix_len + 1,
which the rows before it wrote in the same layer (each layer writes the step's K/V before its
attention reads the pool), so row j sees exactly the context of plain decoding after
d0 .. d(j-1). No new step kind is needed: the runners (both backends) run it as a DECODE batch
of k + 1 sequences that share pages, and a radix-shared prompt is still read once per step.

Verification is exact, for greedy and for sampling alike. Let s_j be the token row j sampled:
with the row's own sampling knobs, mask, seed and output position, i.e. the very token plain
decoding would sample at position o + j after the same prefix (the sampler's random draw is
keyed by (seed, position), `executor/*/sampler.py`). The output keeps d_j while s_j == d_j and
then s_j itself (the bonus token s_k when every draft token matched):

    greedy:    s_j is the argmax, so the output is plain greedy decoding.
    sampling:  s_j ~ p_j, so d_j is kept with probability p_j(d_j), and on a rejection the
               token is s_j given s_j != d_j: p_j with d_j removed and renormalised. That is
               the speculative rejection rule for a point-mass draft, whose output is
               distributed as sampling from p_j; with a seed it is the same token sequence.

The KV rows past the kept tokens hold rejected inputs; kv_len stops before them, so later
steps overwrite them (pages allocated for a draft stay with the request until it ends).

"The very token plain decoding would sample" holds bit for bit only where a row's logits do
not depend on the rows beside it. On the torch CPU path they do not: the quantized GEMMs reduce
each row alone, and the fused attention reads every row's context in the same chunks whatever
shares the step (a decode batch's shared prefix is a whole number of chunks; kernels/csrc/
paged_attention_cpu.cpp, decode_impl). Where projections switch to a dense copy above some
row count (the runner's `decode_row_limit`), verify rows never push a step past it.

Excluded rows (they decode one token as before): requests with frequency / presence /
repetition penalties (the penalty counts of position o + j would have to include d0 .. d(j-1)),
and drafts that do not fit the step (rows <= the largest decode batch, and <= the runner's
`decode_row_limit` while the plain step is within it), the free pages (a draft never evicts
cached KV) or max_new_tokens.

Whether to draft is decided at two levels:

* per batch size (`DraftGate`, with `--speculative-algorithm auto`): each bucket of running
  requests (1, 2, 3-4, 5-8, ...) compares what it measured, seconds per emitted token of whole
  DECODE steps with drafting on against steps with it off (drafting, grammar masks and the
  verify's bookkeeping are inside the timed span), and keeps the cheaper arm. The other arm
  is retried in short trials whose spacing doubles while it keeps losing:

      steps   incumbent x24 | trial x6 | incumbent x48 | trial x6 | incumbent x96 | ...
      trial cheaper (drafting by GATE_MARGIN) -> it becomes the incumbent, spacing back to 24

* per request and step (`choose_num_draft`): a verify row costs a fraction `row_cost_at(batch)`
  of a sequence's share of the step, so a draft of k tokens pays off only while the expected
  number of kept tokens, from the request's running acceptance rate, beats k * row_cost. A
  new request's rate starts at the server's running rate over all verifies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.executor.step import SeqStep
from sgl_tpu.scheduler.ngram import NgramIndex
from sgl_tpu.scheduler.req import Req
from sgl_tpu.scheduler.suffix import SuffixTree

# A verify row's cost as a fraction of one sequence's share of the decode step (the quantity
# that decides whether a draft raises throughput), on the 2-core CPU (SmolLM2-135M, torch
# backend, 1,300-token contexts; docs/speculative-decoding.md): with bfloat16 dense
# weights 0.04-0.2 alone, 0.3-0.37 with 4 sequences and 0.3-0.64 with 8
# (benchmarks/results/speculative_rows.json); on the float32 block kernels of AVX2 CPUs, which
# are compute-bound, 0.25-0.4 alone and with 2 (speculative_rows_f32.json). Modelled as
# ROW_COST + ROW_COST_SLOPE * (batch - 1), at most ROW_COST_MAX, with the float32 kernels'
# cost alone (the dearer one: a draft is taken only where it pays on both). On an
# accelerator, where a decode step is bound by reading the weights, rows are far cheaper.
ROW_COST = 0.35
ROW_COST_SLOPE = 0.05
ROW_COST_MAX = 0.5
# Once the scheduler has timed enough DECODE steps of different row counts (StepCosts), the
# measured cost replaces that model: the last STEP_WINDOW steps, at least STEP_MIN of them,
# spanning at least STEP_MIN_SPREAD rows.
STEP_WINDOW = 256
STEP_MIN = 32
STEP_MIN_SPREAD = 3
# DraftGate (module docstring): a trial of the other arm lasts GATE_TRIAL_STEPS steps; the first
# comes after GATE_FIRST_INTERVAL steps of a bucket, then the spacing doubles while the
# incumbent wins, up to GATE_MAX_INTERVAL (then a losing arm's trials take 6 in 2,054 steps:
# at a 1.5x cost per token, 0.15% of the time). Drafting must be cheaper than plain steps by
# GATE_MARGIN to be chosen: a trial of 6 steps on a shared machine is noisy, and a wrong switch
# to drafting costs the steps until the next trial; where drafts pay they paid 1.3x or more.
# GATE_EMA: weight of the latest step in the incumbent's cost.
GATE_TRIAL_STEPS = 6
GATE_FIRST_INTERVAL = 24
GATE_MAX_INTERVAL = 2048
GATE_MARGIN = 0.1
GATE_EMA = 0.1
# The per-token acceptance rate assumed before any verify: near what the agent-loop workloads
# measured (react 71%, tool-json 83%), so that drafting is tried even in larger batches. A new
# request starts from the server's running rate over all verifies (weight ACCEPT_SERVER_EMA
# per verify), which begins here: the next turn of an agent whose drafts were all accepted
# drafts its longest from its first step instead of ramping up from the prior again.
ACCEPT_PRIOR = 0.7
ACCEPT_EMA = 0.3  # weight of the latest verify in the running acceptance rate
ACCEPT_SERVER_EMA = 0.05
# While a request does not draft (low acceptance), its rate drifts back to the prior by this
# fraction per step, so it is tried again later (what an agent copies changes within a turn).
ACCEPT_RECOVERY = 0.05


@dataclass
class SpecState:
    """One request's speculative-decoding state (on `Req.spec`)."""

    accept_rate: float = ACCEPT_PRIOR
    drafter: Any = None  # the drafter's own state (NGRAM: the request's NgramIndex)


class StepCosts:
    """DECODE step time against the step's rows, as measured: a least-squares line
    seconds = fixed + per_row * rows through the last STEP_WINDOW steps. A verify row of a
    `batch`-sequence step then costs per_row / ((fixed + per_row * batch) / batch) of a
    sequence's share. The line is refitted every STEP_MIN steps."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=STEP_WINDOW)
        self.line: tuple[float, float] | None = None  # (fixed, per_row) seconds
        self._since_fit = 0

    def record(self, rows: int, seconds: float) -> None:
        self.steps.append((rows, seconds))
        self._since_fit += 1
        if self._since_fit >= STEP_MIN:
            self._since_fit = 0
            rows_seen = [r for r, _ in self.steps]
            if max(rows_seen) - min(rows_seen) >= STEP_MIN_SPREAD:
                per_row, fixed = np.polyfit(rows_seen, [t for _, t in self.steps], 1)
                self.line = (float(fixed), max(0.0, float(per_row)))

    def row_cost(self, batch: int) -> float | None:
        """A verify row's cost relative to a sequence's share; None before the first fit."""
        if self.line is None:
            return None
        fixed, per_row = self.line
        step = fixed + per_row * batch
        return per_row * batch / step if step > 0 else None


def batch_bucket(batch: int) -> str:
    """The gate's bucket of a batch of `batch` running requests: "1", "2", "3-4", "5-8", ..."""
    hi = 1 << (batch - 1).bit_length()
    lo = hi // 2 + 1
    return str(hi) if lo >= hi else f"{lo}-{hi}"


class BucketGate:
    """One batch-size bucket's choice between steps with drafts and plain steps, from their
    measured seconds per emitted token (the incumbent's as a running average, the challenger's
    from its last trial)."""

    def __init__(self) -> None:
        self.drafting = False  # the incumbent arm; plain first, drafting must earn its place
        self.cost: dict[bool, float | None] = {True: None, False: None}  # s per token, by arm
        self.interval = GATE_FIRST_INTERVAL
        self.until_trial = GATE_FIRST_INTERVAL
        self.trial_left = 0
        self._trial = [0.0, 0]  # the trial's seconds, tokens
        self.trials = 0
        self.switches = 0

    def arm(self) -> bool:
        """This step's arm: True = drafting."""
        return self.drafting != (self.trial_left > 0)

    def record(self, seconds: float, tokens: int) -> None:
        """The step this gate chose `arm()` for took `seconds` and emitted `tokens`."""
        if self.trial_left > 0:
            self._trial[0] += seconds
            self._trial[1] += tokens
            self.trial_left -= 1
            if self.trial_left == 0:
                self._conclude()
            return
        if tokens > 0:
            sample = seconds / tokens
            old = self.cost[self.drafting]
            self.cost[self.drafting] = sample if old is None else old + GATE_EMA * (sample - old)
        self.until_trial -= 1
        if self.until_trial <= 0:
            self.trial_left = GATE_TRIAL_STEPS
            self._trial = [0.0, 0]

    def _conclude(self) -> None:
        seconds, tokens = self._trial
        self.trials += 1
        challenger = not self.drafting
        self.cost[challenger] = seconds / max(tokens, 1)
        draft, plain = self.cost[True], self.cost[False]
        prefer = draft is not None and plain is not None and draft < plain * (1 - GATE_MARGIN)
        if prefer != self.drafting:
            self.drafting = prefer
            self.switches += 1
            self.interval = GATE_FIRST_INTERVAL
        else:
            self.interval = min(2 * self.interval, GATE_MAX_INTERVAL)
        self.until_trial = self.interval

    def info(self) -> dict[str, Any]:
        ms = {arm: None if c is None else round(1e3 * c, 3) for arm, c in self.cost.items()}
        return {"drafting": self.drafting, "draft_ms_per_token": ms[True],
                "plain_ms_per_token": ms[False], "trials": self.trials,
                "switches": self.switches, "next_trial_in_steps": self.until_trial}


class DraftGate:
    """Per batch-size bucket (`batch_bucket`), whether this DECODE step drafts: `BucketGate`."""

    def __init__(self) -> None:
        self.buckets: dict[str, BucketGate] = {}
        self._step: BucketGate | None = None  # the gate of the step in progress

    def drafting(self, batch: int) -> bool:
        """The arm of the coming step of `batch` running requests (recorded by `record`)."""
        self._step = self.buckets.setdefault(batch_bucket(batch), BucketGate())
        return self._step.arm()

    def record(self, seconds: float, tokens: int) -> None:
        """The step `drafting` was last asked about took `seconds` (drafting to appended
        tokens) and emitted `tokens`."""
        if self._step is not None:
            self._step.record(seconds, tokens)
            self._step = None

    def info(self) -> dict[str, Any]:
        buckets = {name: gate.info() for name, gate in sorted(
            self.buckets.items(), key=lambda item: int(item[0].split("-")[-1]))}
        return {"drafting_buckets": [n for n, g in buckets.items() if g["drafting"]],
                "buckets": buckets}


class NgramDrafter:
    """NGRAM: drafts from the request's own prompt and output (ngram.py; its index on
    `req.spec.drafter`)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.min_n = config.speculative_ngram_min_match_window_size
        self.max_n = config.speculative_ngram_max_match_window_size

    def observe(self, running: Sequence[Req]) -> None:
        """Every DECODE step, before drafting: the running requests' outputs so far."""

    def finished(self, req: Req) -> None:
        """`req` ended (its last tokens are in its output)."""

    def propose(self, req: Req, num_tokens: int) -> list[int]:
        return self._own(req, num_tokens)[0]

    def _own(self, req: Req, num_tokens: int) -> tuple[list[int], int]:
        if req.spec.drafter is None:
            req.spec.drafter = NgramIndex(self.min_n, self.max_n)
        req.spec.drafter.sync(req.fill_ids)
        return req.spec.drafter.propose(num_tokens)


class SuffixDrafter(NgramDrafter):
    """SUFFIX: drafts from the outputs of recent requests, running ones included (suffix.py),
    and, as NGRAM, from the request's own prompt and output; the longer match wins, the
    request's own on a tie (it is the more specific)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.tree = SuffixTree(config.speculative_suffix_max_tree_depth,
                               config.speculative_suffix_max_cached_requests)
        self.min_token_prob = config.speculative_suffix_min_token_prob
        self.max_spec_factor = config.speculative_suffix_max_spec_factor

    def observe(self, running: Sequence[Req]) -> None:
        for req in running:
            self._sync(req)

    def finished(self, req: Req) -> None:
        self._sync(req)
        self.tree.close(req.rid)

    def _sync(self, req: Req) -> None:
        counted = self.tree.output(req.rid)
        have = 0 if counted is None else len(counted)
        if have > len(req.output_ids):  # cut back (a grammar's rejected jump): count anew
            self.tree.remove(req.rid)
            have = 0
        self.tree.extend(req.rid, req.output_ids[have:])

    def propose(self, req: Req, num_tokens: int) -> list[int]:
        own, own_len = self._own(req, num_tokens)
        depth = self.tree.max_depth
        context = req.output_ids[-depth:]
        if len(context) < depth:
            context = req.origin_input_ids[len(context) - depth :] + context
        shared, shared_len = self.tree.propose(context, num_tokens, self.min_token_prob,
                                               self.max_spec_factor)
        return shared if shared_len > own_len else own


# name (SGLang's --speculative-algorithm) -> drafter class
DRAFTERS: dict[str, type[NgramDrafter]] = {"NGRAM": NgramDrafter, "SUFFIX": SuffixDrafter}


def expected_kept(accept_rate: float, k: int) -> float:
    """Expected tokens a verify of k draft tokens appends: the bonus or correction token plus
    the accepted run, each draft token accepted with `accept_rate` given the ones before."""
    return sum(accept_rate**i for i in range(k + 1))


def choose_num_draft(accept_rate: float, max_tokens: int, row_cost: float) -> int:
    """The draft length (0..max_tokens) with the most expected tokens per unit of step cost
    (1 + row_cost * k); 0 when drafting is not expected to pay."""
    best, best_k = 1.0, 0
    for k in range(1, max_tokens + 1):
        gain = expected_kept(accept_rate, k) / (1.0 + row_cost * k)
        if gain > best:
            best, best_k = gain, k
    return best_k


def accept(draft: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """Tokens a verify appends: draft tokens while they equal the rows' samples, then the
    first differing sample (or the bonus sample after a fully accepted draft).
    sampled: the k + 1 rows' tokens."""
    out: list[int] = []
    for d, s in zip(draft, sampled, strict=False):
        if d != s:
            break
        out.append(d)
    out.append(int(sampled[len(out)]))
    return out


def verify_steps(req: Req, draft: Sequence[int], masks: Sequence[np.ndarray | None]
                 ) -> list[SeqStep]:
    """The k + 1 DECODE rows of `req` (module docstring); masks[j] for row j."""
    inputs = [req.output_ids[-1], *draft]
    o = len(req.output_ids)
    return [SeqStep(token_ids=[int(inputs[j])], prefix_len=req.kv_len + j, pages=req.pages,
                    sampling=req.sampling, seed=req.seed, num_output_tokens=o + j,
                    counts_row=req.row, sample_valid=False, bitmask=masks[j],
                    return_logprob=req.return_logprob, lora_id=req.lora_id)
            for j in range(len(draft) + 1)]


def mask_allows(mask: np.ndarray | None, token: int) -> bool:
    return mask is None or bool((int(mask.view(np.uint32)[token // 32]) >> (token % 32)) & 1)


class Speculator:
    """Drafts for the running requests of a DECODE step and the bookkeeping of their verify.
    Holds no request state of its own (that is on `Req.spec`)."""

    def __init__(self, config: SchedulerConfig, row_limit: int | None = None) -> None:
        algorithm = config.speculative_algorithm
        if algorithm not in DRAFTERS:
            raise ValueError(f"speculative_algorithm must be one of {tuple(DRAFTERS)}, "
                             f"got {algorithm!r}")
        self.drafter = DRAFTERS[algorithm](config)
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.max_rows = config.max_running_requests
        # the runner's decode_row_limit: a step of at most this many rows runs the kernels a
        # one-row step runs, so verify rows never push a step past it (lossless drafts)
        self.row_limit = row_limit
        # draft only while at most this many requests run (None: any)
        self.max_batch = config.speculative_max_batch
        self.row_cost, self.row_cost_slope = ROW_COST, ROW_COST_SLOPE
        # None: every batch size drafts (by the per-request rule); an algorithm asked for by
        # name, or tests
        self.gate = DraftGate() if config.speculative_gate else None
        # None: the constants only. Under the gate, which measures whether drafting pays as a
        # whole, the per-request rule keeps the constants: a fitted row cost above what the
        # acceptance prior pays for would let no request draft, so neither the gate's trials
        # nor the requests' acceptance rates would ever see a draft.
        self.step_costs: StepCosts | None = None if self.gate is not None else StepCosts()
        self.accept_rate = ACCEPT_PRIOR  # over all requests' verifies: a new request's start

    def row_cost_at(self, batch: int) -> float:
        """A verify row's cost relative to a sequence's share of a `batch`-sequence step:
        measured once enough steps were timed, else the constants' model."""
        measured = None if self.step_costs is None else self.step_costs.row_cost(batch)
        if measured is not None:
            return measured
        return min(ROW_COST_MAX, self.row_cost + self.row_cost_slope * (batch - 1))

    def record_step(self, rows: int, seconds: float) -> None:
        """A DECODE step of `rows` rows took `seconds` (dispatch to tokens on the host)."""
        if self.step_costs is not None:
            self.step_costs.record(rows, seconds)

    def record_decode(self, seconds: float, tokens: int) -> None:
        """The DECODE step whose drafts `drafts` made took `seconds`, from drafting to its
        appended tokens, and emitted `tokens` (the gate's measure)."""
        if self.gate is not None:  # (a grammar's cut-back can shorten an output)
            self.gate.record(seconds, max(0, tokens))

    def info(self) -> dict[str, Any]:
        """What /server_info reports: the gate's live decision per batch-size bucket."""
        fit = None if self.step_costs is None else self.step_costs.line
        return {"measured_row_line_ms": None if fit is None else
                [round(1e3 * fit[0], 3), round(1e3 * fit[1], 3)],
                "accept_rate": round(self.accept_rate, 4),
                "gate": None if self.gate is None else self.gate.info()}

    def finished(self, req: Req) -> None:
        self.drafter.finished(req)

    @staticmethod
    def eligible(req: Req) -> bool:
        return not req.sampling.uses_penalties and not req.finished

    def draft_room(self, req: Req) -> int:
        """Draft tokens `req` may take: the bonus token must still fit max_new_tokens."""
        left = req.sampling.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(self.num_draft_tokens, left))

    def drafts(self, running: Sequence[Req]) -> dict[int, list[int]]:
        """Drafts (by id(req)) for this step's requests, within the step's row budget; none
        while more than max_batch requests run."""
        self.drafter.observe(running)  # every step: the suffix tree stays current
        if self.max_batch is not None and len(running) > self.max_batch:
            return {}
        if self.gate is not None and not self.gate.drafting(len(running)):
            return {}
        spare = self.max_rows - len(running)
        if self.row_limit is not None and len(running) <= self.row_limit:
            spare = min(spare, self.row_limit - len(running))
        row_cost = self.row_cost_at(len(running))
        out: dict[int, list[int]] = {}
        for req in running:
            if spare <= 0:
                break
            room = min(self.draft_room(req), spare)
            if room == 0 or not self.eligible(req):
                continue
            if req.spec is None:
                req.spec = SpecState(accept_rate=self.accept_rate)
            rate = req.spec.accept_rate
            k = choose_num_draft(rate, room, row_cost)
            if k == 0:
                req.spec.accept_rate += ACCEPT_RECOVERY * (ACCEPT_PRIOR - rate)
                continue
            draft = self.drafter.propose(req, k)
            if draft:
                out[id(req)] = draft
                spare -= len(draft)
        return out

    @staticmethod
    def masks(req: Req, draft: list[int], step_mask: Callable[[Req, int], np.ndarray | None]
              ) -> tuple[list[int], list[np.ndarray | None]]:
        """The mask of each verify row (`step_mask(req, j)`: the grammar's mask and the
        min_new_tokens ban at output position o + j), with the draft cut at its first token
        that a mask disallows or after which the grammar terminates. The grammar matcher is
        advanced through the draft and rolled back."""
        matcher = req.matcher
        masks: list[np.ndarray | None] = []
        kept = 0
        try:
            for j, token in enumerate(draft):
                mask = step_mask(req, j)
                masks.append(mask)
                if not mask_allows(mask, token) or (
                        matcher is not None and not matcher.accept_token(token)):
                    break
                kept = j + 1
                if matcher is not None and matcher.is_terminated():
                    break
            draft = draft[:kept]
            del masks[kept:]
            masks.append(step_mask(req, kept))
        finally:
            if matcher is not None and kept:
                matcher.rollback(kept)
        return draft, masks

    def record(self, req: Req, num_draft: int, num_accepted: int) -> None:
        """Fold one verify into the request's acceptance rate and the server's:
        num_accepted successes out of num_accepted + 1 tries (one failure) or num_draft tries
        (all accepted)."""
        tries = num_accepted + (num_accepted < num_draft)
        rate = num_accepted / tries
        req.spec.accept_rate += ACCEPT_EMA * (rate - req.spec.accept_rate)
        self.accept_rate += ACCEPT_SERVER_EMA * (rate - self.accept_rate)
