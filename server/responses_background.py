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
    """One background response while it runs."""

    def __init__(self, events: ResponseEvents, input_items: list[dict[str, Any]],
                 save: Callable[[dict[str, Any]], None]) -> None:
        self.events = events
        self.input_items = input_items
        self.status = "queued"  # until its first output arrives
        self.final: dict[str, Any] | None = None
        self.cancelling = False
        self._save = save
        self.task: asyncio.Task | None = None

    def response(self) -> dict[str, Any]:
        if self.final is None and self.task is not None and self.task.done():
            # a task that ended without a final object (cancelled before it started)
            self.end(self.events.cancelled() if self.cancelling else self._failed(
                "the background run was lost before it finished", 500))
        return self.final if self.final is not None else self.events.progress(self.status)

    def end(self, final: dict[str, Any]) -> None:
        """Store the final object (once)."""
        if self.final is None:
            self.final = final
            self._save(final)

    def _failed(self, message: str, code: int) -> dict[str, Any]:
        return self.events.failed(message, code)[-1]["response"]

    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        final = None
        try:
            async for chunk in chunks:
                self.status = "in_progress"
                self.events.feed(chunk)
            final = self.events.finish()[1]
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
              save: Callable[[dict[str, Any]], None],
              chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
        """Run `chunks` in a task; the response as it is now (`queued`)."""
        rid = events.response["id"]
        run = self._runs[rid] = BackgroundRun(events, input_items, save)
        run.task = asyncio.get_running_loop().create_task(run.run(chunks))

        def ended(_: asyncio.Task) -> None:
            run.response()  # stores a final object if the task left none
            self._runs.pop(rid, None)

        run.task.add_done_callback(ended)
        return run.response()

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
