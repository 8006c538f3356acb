"""Shared output of the benchmark scripts: the result JSON on stdout, and in a file if asked."""

from __future__ import annotations

import json
from typing import Any


def emit(results: dict[str, Any], output: str | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text)
