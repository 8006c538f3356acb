"""Shared output of the benchmark scripts: the result JSON on stdout, and in a file if asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_label(model_path: str | None) -> str:
    """The model as a result JSON names it: the checkpoint's file or folder name (results are
    committed; a machine's absolute paths are not)."""
    return Path(model_path).name if model_path else "default"


def emit(results: dict[str, Any], output: str | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text)
