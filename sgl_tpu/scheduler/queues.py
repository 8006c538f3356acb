"""Where the scheduler's requests sit between steps, and the rows they hold (host side, no JAX).

    add_request ─► waiting ─admit─► EXTEND ──────────► running ◄──► DECODE ──► finished
                     ▲               │  ▲                ▲            │
                     │   next chunk  ▼  │                │ re-EXTEND  │ jump-forward
                     │           chunked_req             └─ jump_forward_reqs ◄─┘
                     └── retract (KV to the tree; to the front): running, jump_forward_reqs

A request sits in at most one place. Every request but a waiting one holds KV pages and a row:
its slot, 1 .. max_running_requests, in the runner's per-row state (penalty counts); row 0
means none.
"""

from __future__ import annotations

from collections.abc import Iterator

from sgl_tpu.scheduler.req import Req


class ReqQueues:
    def __init__(self, max_running_requests: int) -> None:
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # a prompt being prefilled in chunks
        self.jump_forward_reqs: list[Req] = []  # running requests with forced tokens to extend
        self.free_rows = list(range(max_running_requests, 0, -1))

    def __iter__(self) -> Iterator[tuple[list[Req] | None, Req]]:
        """Every request held, with the queue it sits in (None: the chunked prompt between its
        chunks); safe to remove the request it yields."""
        for queue in (self.waiting, self.running, self.jump_forward_reqs):
            for req in list(queue):
                yield queue, req
        if self.chunked_req is not None:
            yield None, self.chunked_req

    def is_empty(self) -> bool:
        """O(1): asked by `has_work` on every turn of the scheduler's loop."""
        return not (self.waiting or self.running or self.jump_forward_reqs
                    or self.chunked_req is not None)

    def remove(self, queue: list[Req] | None, req: Req) -> None:
        if queue is None:
            self.chunked_req = None
        else:
            queue.remove(req)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished: decoding, waiting to re-extend after a jump
        forward, or a prompt between its prefill chunks (all hold KV pages)."""
        return (len(self.running) + len(self.jump_forward_reqs)
                + (self.chunked_req is not None))

    def holding_kv(self) -> list[Req]:
        return [req for queue, req in self if queue is not self.waiting]

    def take_jump_forward(self, reqs: list[Req]) -> None:
        """Requests that jump-forward appended tokens to wait for the EXTEND that runs them."""
        for req in reqs:
            if req.jumped and not req.finished:
                self.jump_forward_reqs.append(req)

    def take_row(self, req: Req) -> None:
        req.row = self.free_rows.pop()
        req.counts_fresh = True

    def free_row(self, req: Req) -> None:
        if req.row:
            self.free_rows.append(req.row)
            req.row = 0
