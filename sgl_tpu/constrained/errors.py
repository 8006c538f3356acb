"""The error a grammar the client sent raises, and the one-line form of a backend's message
(shared by the backends, the schema checks and the scheduler's fault handling)."""

from __future__ import annotations

_MAX_MESSAGE_CHARS = 300


class GrammarError(ValueError):
    """A grammar the client sent cannot be used; the message names the problem (HTTP 400)."""


def shorten(message: str) -> str:
    """One line of a (possibly multi-line, compiler-style) error message."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    chosen = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    if len(chosen) > _MAX_MESSAGE_CHARS:
        chosen = chosen[: _MAX_MESSAGE_CHARS - 3] + "..."
    return chosen
