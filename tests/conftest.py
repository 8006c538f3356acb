"""Servers of the default model (SmolLM2-135M) shared by every test module of a session.

Launching one costs about 15 s of CPU on torch (imports in three processes, the GGUF dequant)
and ~50 s on JAX (first compiles), and several modules only need the model as it ships, so a
session holds at most two, each launched the first time a test asks for it:

    default_model_server       default dtype    tool calling, OpenAI chat, response_format
    default_model_server_f32   float32          agent API, SGLang frontend programs (their
                                                answers must not depend on batch composition)

Tests must not assume a fresh server: the radix cache and the `/server_info` counters carry the
traffic of earlier modules (compare counters as differences, flush the cache before counting
cached tokens). Both are skipped where the default model's wheel is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import (
    DEFAULT_MODEL_F32_FLAGS,
    DEFAULT_MODEL_FLAGS,
    ServerHandle,
    launch_server,
)

from sgl_tpu.loader import default_model_path


def _serve_default_model(flags: tuple[str, ...]) -> Iterator[ServerHandle]:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    handle = launch_server(*flags)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def default_model_server() -> Iterator[ServerHandle]:
    yield from _serve_default_model(DEFAULT_MODEL_FLAGS)


@pytest.fixture(scope="session")
def default_model_server_f32() -> Iterator[ServerHandle]:
    yield from _serve_default_model(DEFAULT_MODEL_F32_FLAGS)
