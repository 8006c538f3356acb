"""Overlap scheduling (SGLang's "zero-overhead" scheduler): which DECODE steps may be dispatched
before the previous step's tokens reached the host, and the step in flight.

    host:   dispatch t │ dispatch t+1 (inputs: placeholders for t's tokens) │ process t │ ...
    device:            │ ......... run t ......... │ ......... run t+1 ......... │ ...

While the device runs step t+1, the host appends step t's tokens, checks stop conditions and
sends outputs. So every request of step t+1 is one token ahead of its host state ("lagged"):
its input token is `placeholder_id(its row in step t)`, resolved by the runner on the device,
and its KV length and output count are one more than the host has recorded.

Exactness: a request step t finishes (EOS, stop string) has one extra row in step t+1; that
row's token is discarded, and the page it wrote is the request's own (the tree keeps only
whole pages of KV the host has recorded), freed when the request finishes. A request that
step t certainly finishes (it reaches max_new_tokens) gets no row. Everything else whose next
step needs host data first runs the serial way (`can_overlap`): requests waiting to
be admitted or extended (prefill, chunks, jump-forward), grammars (the mask depends on the
token), speculative decoding (drafts depend on it), aborts and retraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sgl_tpu.executor.step import PendingStep
from sgl_tpu.scheduler.kv_manager import KVManager
from sgl_tpu.scheduler.queues import ReqQueues
from sgl_tpu.scheduler.req import Req


@dataclass(frozen=True)
class PendingDecode:
    """A dispatched DECODE step whose results the host has not processed yet."""

    batch: list[tuple[Req, list[int], int]]  # (request, its draft, its first row)
    step: PendingStep
    dispatched_at: float = field(default_factory=time.perf_counter)  # (stats: step seconds)

    @property
    def reqs(self) -> list[Req]:
        return [req for req, _, _ in self.batch]


def overlappable(req: Req) -> bool:
    """Whether `req`'s next decode step can be built without its last token on the host."""
    return req.matcher is None and not req.draft and not req.jumped


def finishes_in_flight(req: Req) -> bool:
    """Whether the step in flight certainly ends `req` (its last token by max_new_tokens)."""
    return len(req.output_ids) + 1 >= req.sampling.max_new_tokens


def can_overlap(queues: ReqQueues, kv: KVManager) -> bool:
    """Whether the next DECODE may be dispatched before the one in flight is processed:
    nothing to admit or extend, no request that needs its last token on the host, and a page
    for every running request's next token without retracting any. (The caller checks that
    overlap is on and that no abort is pending.)"""
    if queues.chunked_req is not None or queues.jump_forward_reqs:
        return False
    if any(r.grammar_future is None or r.matcher is not None for r in queues.waiting):
        return False  # admissible now: the serial loop would prefill it next
    if not all(overlappable(r) for r in queues.running):
        return False
    needy = sum(1 for r in queues.running if not finishes_in_flight(r)
                and kv.pages_needed(r, r.kv_len + 2))
    return needy <= kv.available_pages()


def lagged_rows(in_flight: PendingDecode, running: list[Req], kv: KVManager
                ) -> list[tuple[Req, int]]:
    """The requests of the DECODE after `in_flight` (each running request that `in_flight`
    does not certainly finish), each with its row in `in_flight`, whose sampled token it runs
    (read on the device); the pages their lagged tokens need are allocated here."""
    rows = {id(req): row for req, _, row in in_flight.batch}
    reqs = [r for r in running if not finishes_in_flight(r)]
    for r in reqs:
        if not kv.alloc_pages(r, kv.pages_needed(r, r.kv_len + 2)):
            raise RuntimeError("page allocation failed despite available pages")
    return [(r, rows[id(r)]) for r in reqs]
