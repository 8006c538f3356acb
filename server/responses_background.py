"""Background responses (`background: true`): the run goes on in this process after
`POST /v1/responses` answered; `GET` reads its progress, `POST .../cancel` stops it.

    POST ──start──► BackgroundRun (status queued) ──task: chat chunks ──ResponseEvents──►
        first output: in_progress ──► completed | incomplete | failed | cancelled
        ──► ResponseStore (the final object; the run is dropped)

While it runs, a response lives here, not in the store (so neither the store's bound nor its
expiry can drop it); its final object is stored when it ends, however it ends (the task's
`finally`), so a run never reads as `queued` or `in_progress` once its task is gone. A run
whose server lost a child process fails with the reason (`ServerDead`); the store is in
memory, so a response whose process exited is unknown (404) after a restart, never stale.
A run created with `stream` keeps its events (`log`, index = sequence number), so a stream
may start or resume anywhere; they are stored with the final object.
Cancelling the task closes the chat stream, which aborts the generate request
(`TokenizerManager.generate`'s `finally`): the scheduler frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sgl_tpu.server.responses_stream import ResponseEvents
from sgl_tpu.server.tokenizer_manager import RequestError, ServerDead

logger = logging.getLogger(__name__)

RUNNING = ("queued", "in_progress")


class BackgroundRun:
    """One background response while it runs; with `keep_events` (created with `stream`) it
    keeps every event it emits, for streams that start or resume at any sequence number."""

    def __init__(self, events: ResponseEvents, input_items: list[dict[str, Any]],
                 save: Callable[[dict[str, Any], list[dict[str, Any]] | None], None],
                 keep_events: bool = False) -> None:
        self.events = events
        self.input_items = input_items
        self.status = "queued"  # until its first output arrives
        self.final: dict[str, Any] | None = None
        self.cancelling = False
        self.log: list[dict[str, Any]] | None = [] if keep_events else None  # log[i]: seq i
        self._grew = asyncio.Event()
        self._save = save
        self.task: asyncio.Task | None = None
        self._emit([events.status_event("response.created", "queued"),
                    events.status_event("response.queued", "queued")])

    def response(self) -> dict[str, Any]:
        if self.final is None and self.task is not None and self.task.done():
            # a task that ended without a final object (cancelled before it started)
            self.end(self.events.cancelled() if self.cancelling else self._failed(
                "the background run was lost before it finished", 500))
        return self.final if self.final is not None else self.events.progress(self.status)

    def end(self, final: dict[str, Any]) -> None:
        """Store the final object (once) and wake the streams."""
        if self.final is None:
            self.final = final
            self._save(final, self.log)
            self._emit([])

    def _emit(self, events: list[dict[str, Any]]) -> None:
        if self.log is not None:
            self.log.extend(events)
            self._grew.set()
            self._grew = asyncio.Event()

    def _failed(self, message: str, code: int) -> dict[str, Any]:
        events = self.events.failed(message, code)
        self._emit(events)
        return events[-1]["response"]

    async def stream(self, starting_after: int) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number `starting_after`, live until the run ends."""
        assert self.log is not None
        i = max(starting_after + 1, 0)
        while True:
            grew = self._grew
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.final is not None:
                return
            await grew.wait()

    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        final = None
        try:
            async for chunk in chunks:
                if self.status == "queued":
                    self.status = "in_progress"
                    self._emit([self.events.status_event("response.in_progress",
                                                         "in_progress")])
                self._emit(self.events.feed(chunk))
            closing, final = self.events.finish()
            self._emit(closing)
        except asyncio.CancelledError:
            final = self.events.cancelled()
        except (RequestError, ServerDead) as e:
            final = self._failed(str(e), getattr(e, "status_code", 503))
        except Exception as e:  # the run must end in a final state, whatever went wrong
            logger.exception("a background response failed")
            final = self._failed(f"internal server error ({type(e).__name__}); see the "
                                 "server log", 500)
        finally:
            try:
                await chunks.aclose()
            finally:
                self.end(final if final is not None else self.events.cancelled())


class BackgroundRuns:
    """The background responses running in this process, by response id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def get(self, rid: str) -> BackgroundRun | None:
        """The run of response `rid` while it has not ended (None: not running here)."""
        run = self._runs.get(rid)
        if run is not None and run.response()["status"] not in RUNNING:
            return None
        return run

    def start(self, events: ResponseEvents, input_items: list[dict[str, Any]],
              save: Callable[[dict[str, Any], list[dict[str, Any]] | None], None],
              chunks: AsyncIterator[dict[str, Any]], keep_events: bool = False
              ) -> BackgroundRun:
        """Run `chunks` in a task (`save(final, events)` when it ends); the run, `queued`."""
        rid = events.response["id"]
        run = self._runs[rid] = BackgroundRun(events, input_items, save, keep_events)
        run.task = asyncio.get_running_loop().create_task(run.run(chunks))

        def ended(_: asyncio.Task) -> None:
            run.response()  # stores a final object if the task left none
            self._runs.pop(rid, None)

        run.task.add_done_callback(ended)
        return run

    async def cancel(self, rid: str) -> dict[str, Any] | None:
        """Stop a running response and wait for its final object (None: not running)."""
        run = self.get(rid)
        if run is None or run.task is None:
            return None
        if not run.cancelling:  # a second cancel must not interrupt the first one's abort
            run.cancelling = True
            run.task.cancel()
        await asyncio.wait([run.task])
        return run.response()

    async def stop(self) -> None:
        """Cancel every run (server shutdown: their requests are aborted while the sockets
        are still open)."""
        for rid in list(self._runs):
            await self.cancel(rid)
