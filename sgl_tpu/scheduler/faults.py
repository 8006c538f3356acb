"""What an exception while handling one request means (host side, no JAX).

The scheduler loop runs many requests' host code (masks, grammar matchers, stop-string
decoders, output assembly) between device steps. An exception raised there for one request ends
that request alone, with an error output (logged with its rid) and its KV pages discarded
rather than cached (their content may be incomplete); everybody else keeps running:

    GrammarError (a grammar beyond the parser's limits) ........ 400 naming the limit
    anything else (a bug, a backend fault) ..................... 500 "internal error ..."

An exception outside any one request's code (the device step itself) fails the requests of that
step; only `is_fatal` faults (out of memory, a lost tensor-parallel rank, or the same step
failing `MAX_CONSECUTIVE_FAULTS` times in a row) stop the process, which the launcher reports
as a 503 and a clean exit.
"""

from __future__ import annotations

import logging

from sgl_tpu.constrained.errors import GrammarError, shorten
from sgl_tpu.scheduler.finish import FinishReason, abort

logger = logging.getLogger("sgl_tpu.scheduler")

MAX_CONSECUTIVE_FAULTS = 3


def fault_reason(rid: str, exc: BaseException) -> FinishReason:
    """The finish_reason ending request `rid` after `exc`; logs it with the rid."""
    if isinstance(exc, GrammarError):
        logger.warning("request %s ended: %s", rid, exc)
        return abort(str(exc), 400)
    logger.error("request %s ended by an internal error", rid, exc_info=exc)
    detail = shorten(f"{type(exc).__name__}: {exc}")
    return abort(f"internal error while handling the request ({detail})", 500)


def is_fatal(exc: BaseException, consecutive: int) -> bool:
    """Faults after which the process should die rather than serve on."""
    if isinstance(exc, MemoryError | SystemExit | KeyboardInterrupt):
        return True
    from sgl_tpu.parallel.leader import FollowerLost

    if isinstance(exc, FollowerLost):  # a tensor-parallel group cannot run without a rank
        return True
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return True
    return consecutive >= MAX_CONSECUTIVE_FAULTS
