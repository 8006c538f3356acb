"""Shared fixtures: the tiny random model, and servers shared by every test module of a session.

    tiny_model                a tiny random llama (tests/checkpoints.py), context 512
    tiny_model_4k             a tiny random llama with a 4,096-token context (agent prompts)
    server_pool               running servers keyed by (model, flags): `server_pool.get(*flags,
                              model_path=...)` launches one the first time, then returns it
    default_model_server      the default model (SmolLM2-135M), default dtype: tool calling,
                              OpenAI chat, response_format
    default_model_server_f32  the same in float32: the agent API, SGLang frontend programs
                              (their answers must not depend on batch composition)

Launching a default-model server costs about 15 s of CPU on torch (imports in three processes,
the GGUF dequant) and ~50 s on JAX (first compiles); a tiny-model one about 7 s and 15 s. The
flag tuples of tests/server_harness.py (DEFAULT_MODEL_FLAGS, TINY_F32, ...) name the servers
that several modules share: modules that ask the pool for the same tuple get the same server.
Tests must not assume a fresh server (see `server_pool`). The default-model servers are skipped
where the default model's wheel is not installed.

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
from checkpoints import make_tiny_hf_checkpoint
from server_harness import (
    DEFAULT_MODEL_F32_FLAGS,
    DEFAULT_MODEL_FLAGS,
    REPO_ROOT,
    ServerHandle,
    ServerPool,
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random llama (hidden 64, 2 layers, context 512) with its tokenizer."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_4k(tmp_path_factory) -> str:
    """A tiny random llama with a 4,096-token context (agent-sized prompts)."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama_4k"), "llama",
                                   max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    """Servers shared by the whole session: `server_pool.get(*flags, model_path=None)` returns
    the running server of exactly those flags and model (`None`: the default model), launching
    it the first time; all are stopped at the end of the session. Spell shared flag sets with
    the tuples of tests/server_harness.py (TINY_F32, ...) so that equal servers are asked for alike.

    A pooled server carries the traffic of every module before: its radix cache and the
    `/server_info` counters are not fresh. Compare counters as differences, and count cached
    tokens of prompts no other test sends (or flush right before). Any test may flush the
    cache (tests run one at a time), so none may rely on a prefix an earlier test cached.
    A test that changes what later tests would see launches its own server with
    `launch_server` instead: one that stops or kills the server or one of its processes,
    leaves state behind (open sessions, retained KV, a full pool, a timed gate such as the
    speculative draft gate), or needs a server no other test has touched."""
    pool = ServerPool()
    yield pool
    pool.stop_all()


def _require_default_model() -> None:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_model_server(server_pool: ServerPool) -> ServerHandle:
    _require_default_model()
    return server_pool.get(*DEFAULT_MODEL_FLAGS)


@pytest.fixture(scope="session")
def default_model_server_f32(server_pool: ServerPool) -> ServerHandle:
    _require_default_model()
    return server_pool.get(*DEFAULT_MODEL_F32_FLAGS)
