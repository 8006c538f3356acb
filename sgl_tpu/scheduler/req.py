"""`Req`: one generation request's state inside the scheduler (host side).

KV bookkeeping of a request, in tokens (ps = page_size):

    fill_ids   [p p p p p p p p p p o o o]      prompt + outputs so far
    kv_len     |<------------------------>|     tokens whose K/V are in `pages` (the last
                                                output has none yet: it is the next input)
    tree_len   |<-------------->|               leading tokens whose pages the radix tree owns
                                                (locked through `last_node`); page aligned
    pages      [t t t t | r r r r | r ...]      t = tree-owned, r = owned by this request
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_tpu.constrained.base import GrammarMatcher
from sgl_tpu.detokenize import IncrementalDecoder
from sgl_tpu.executor.step import SeqStep, placeholder_id
from sgl_tpu.mem_cache.radix_cache import PrefixPeek
from sgl_tpu.mem_cache.tree_node import TreeNode
from sgl_tpu.sampling_params import SamplingParams

_arrival = itertools.count()


@dataclass(eq=False)
class Req:
    # A field named as one of `messages.TokenizedGenerateReq`'s is copied from the request by
    # intake (scheduler/intake.py COPIED_FIELDS) unless intake derives it.
    rid: str
    origin_input_ids: list[int]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    session_id: str | None = None
    # cache control (scheduler/retention.py): the priority of its admission (priority.py) and
    # of its KV's eviction, higher = more urgent; its own retention pin, the client's hint that
    # the turn ends in a tool call, tools offered (the HTTP side may report a tool-call finish
    # later)
    priority: int = 0
    retention_seconds: float = 0.0
    tool_pause: bool = False
    may_call_tools: bool = False
    arrival: int = field(default_factory=lambda: next(_arrival))  # arrival order
    arrival_s: float = field(default_factory=time.monotonic)  # arrival time (priority aging)
    # the agent it is a turn of: a scheduler/programs.py Program (not imported: programs.py
    # imports this module)
    program: Any = None
    # LoRA (sgl_tpu/lora.py): the adapter it runs with (0: the base model) and its radix-cache
    # namespace (the adapter's digest; None: the base model's tree)
    lora_id: int = 0
    cache_namespace: str | None = None

    output_ids: list[int] = field(default_factory=list)
    # KV state (see module docstring)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    tree_len: int = 0
    last_node: TreeNode | None = None
    row: int = 0  # penalty-count row / running slot (1..max_running); 0 = none
    counts_fresh: bool = False  # row newly assigned: the runner clears its counts first
    cached_tokens: int = 0  # prompt tokens served from the radix cache (reported)
    pool_hit_tokens: int = 0  # of its prompt, tokens in the pool at arrival (of a program)
    num_retractions: int = 0
    # The waiting-queue policy's last look at this request's cached prefix, with the key it
    # was for: (num_retractions, max_prefix_len, peek). Only valid while the request waits.
    prefix_peek: tuple[int, int, PrefixPeek] | None = None
    jumped: bool = False  # jump-forward appended tokens that still need an EXTEND
    # Canonical forced tokens appended as a draft (greedy only): not yet sent, verified
    # against the model's masked argmax after the EXTEND that computes them.
    draft: list[int] = field(default_factory=list)
    draft_masks: list[np.ndarray] = field(default_factory=list)
    spec: Any = None  # speculative decoding's state (scheduler/speculative.py SpecState)
    # an embedding request (scheduler/pooling.py): its POOLING_METHODS name (None: a generation
    # request); whether that method reads rows a cached prefix would skip (then it matches
    # none); the sum of the hidden-state rows pooled so far, f64[D]
    pooling: str | None = None
    needs_prefix_rows: bool = False
    pooled_sum: np.ndarray | None = None

    finish_reason: dict[str, Any] | None = None
    stop_text_offset: int = -1
    decoder: IncrementalDecoder | None = None  # only with stop strings or stop_regex
    grammar_future: Future | None = None  # compiled grammar (regex / json_schema / ebnf)
    grammar_deadline: float = 0.0  # time.monotonic() by which it must have compiled
    matcher: GrammarMatcher | None = None
    input_logprobs_sent: bool = False
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose K/V must exist before the next decode step."""
        return self.origin_input_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return (self.return_logprob and self.logprob_start_len >= 0
                and not self.input_logprobs_sent)

    def extend_step(self, n: int, mask: np.ndarray | None) -> SeqStep:
        """This request's share of an EXTEND: its next `n` uncomputed tokens (a chunk, the
        whole uncached prompt, or jump-forward tokens); samples only if they complete it."""
        completes = self.kv_len + n == len(self.fill_ids)
        return SeqStep(token_ids=self.fill_ids[self.kv_len : self.kv_len + n],
                       prefix_len=self.kv_len, pages=self.pages, sampling=self.sampling,
                       seed=self.seed, num_output_tokens=len(self.output_ids),
                       counts_row=self.row, counts_reset=self.counts_fresh,
                       sample_valid=completes and self.sampling.max_new_tokens > 0,
                       bitmask=mask, return_logprob=self.return_logprob, lora_id=self.lora_id)

    def decode_step(self, mask: np.ndarray | None, prev_row: int | None = None) -> SeqStep:
        """This request's share of a DECODE: its last token, one new one sampled.

        `prev_row` (overlap scheduling, scheduler/overlap.py): its last token is the one the
        step in flight samples at that row, not yet on the host, so it runs as a placeholder
        and the step is one token further than the host's record (pages must cover it)."""
        lag = 0 if prev_row is None else 1
        token = self.output_ids[-1] if prev_row is None else placeholder_id(prev_row)
        # A copy of the pages: the host may change the list while a step is in flight.
        return SeqStep(token_ids=[token], prefix_len=self.kv_len + lag, pages=list(self.pages),
                       sampling=self.sampling, seed=self.seed,
                       num_output_tokens=len(self.output_ids) + lag, counts_row=self.row,
                       bitmask=mask, return_logprob=self.return_logprob, lora_id=self.lora_id)

    @property
    def max_prefix_len(self) -> int:
        """Longest cached prefix this request may reuse: at least one token must run (to get
        logits), positions whose input log-probs are wanted must be computed, and so must
        every row that a `mean` or `cls` embedding pools."""
        if self.needs_prefix_rows:
            return 0
        limit = len(self.origin_input_ids) + len(self.output_ids) - 1  # no fill_ids copy
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)
