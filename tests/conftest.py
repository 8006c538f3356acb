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

The session also holds one JAX persistent compilation cache, a fresh temporary directory that
this process and every process it starts (servers, multi-device checks) share and that is
removed at the end: a program compiled once (the same HLO: e.g. a step of the same shapes in
another module's engine or server) is read back instead of compiled again. Nothing is kept
between sessions, so a run's results and timings never depend on an earlier run.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
from server_harness import (
    DEFAULT_MODEL_F32_FLAGS,
    DEFAULT_MODEL_FLAGS,
    REPO_ROOT,
    ServerHandle,
    launch_server,
)

from sgl_tpu.loader import default_model_path


def _take_repo_root_off_sys_path() -> None:
    """The repository's top-level `kernels/` (installed as `sgl_tpu.kernels`) is a regular
    package, so while the repository root is on `sys.path` it shadows the PyPI package `kernels`
    that transformers (>= 5.25) imports: `python -m pytest` puts the working directory there.
    Nothing here imports from the root itself (`sgl_tpu` comes through its installation)."""
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO_ROOT]


_take_repo_root_off_sys_path()

# Programs that compile faster than this are not written (a read costs a few tens of ms).
JAX_CACHE_MIN_COMPILE_S = 0.5
_jax_cache_dir: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _jax_cache_dir
    _jax_cache_dir = tempfile.mkdtemp(prefix="sgl_tpu_test_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache_dir  # the processes tests start
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(JAX_CACHE_MIN_COMPILE_S)
    jax.config.update("jax_compilation_cache_dir", _jax_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", JAX_CACHE_MIN_COMPILE_S)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _jax_cache_dir is not None:
        shutil.rmtree(_jax_cache_dir, ignore_errors=True)


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
