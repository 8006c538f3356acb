"""The line a server prints once it answers requests (SGLang's words, which scripts wait for).
With --dp-size, only after the router has registered every replica: the router's /health
answers 200 before that, so /health alone is not readiness there."""

from __future__ import annotations

import re

READY_MESSAGE = "The server is fired up and ready to roll!"


def ready_line(port: int) -> re.Pattern[str]:
    """The ready line of the server on `port`. A `--dp-size` launch's replicas print their own
    (other ports) to the same output, so waiting scripts match the port too."""
    return re.compile(re.escape(READY_MESSAGE) + rf" http://\S+:{port}\b")
