"""The scheduler's runner: a single-device `ModelRunner`, or rank 0 of a tensor-parallel group.

    tp_size 1, one node           executor/registry.create_model_runner
    --backend torch, tp_size > 1  backends/torch/tp_launch.start_torch_tp -> LeaderRunner
                                  (follower processes, torch.distributed; --nnodes: hosts)
    --backend jax                 the registry's runner (tp_size: its device mesh); --nnodes:
                                  backends/jax/multihost (join_jax_group before the model
                                  loads, then start_jax_leader -> LeaderRunner)

Each backend's group launcher is reached by module name (`GROUP_LAUNCHERS`): a backend's
modules load only when it is chosen, and nothing here imports a backend's home.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from sgl_tpu.config import RunnerConfig, ServerArgs
from sgl_tpu.executor.registry import create_model_runner, resolve_backend
from sgl_tpu.executor.step import ModelRunner

GROUP_LAUNCHERS = {"torch": "sgl_tpu.backends.torch.tp_launch",
                   "jax": "sgl_tpu.backends.jax.multihost"}


def _launcher(backend: str) -> ModuleType:
    return importlib.import_module(GROUP_LAUNCHERS[backend])


def join_group(args: ServerArgs, backend: str) -> Any | None:
    """Multi-host JAX: rank 0 gathers its follower hosts and joins jax.distributed before
    anything starts JAX's backend (so before the model loads). The group, or None."""
    if args.nnodes > 1 and backend == "jax":
        return _launcher("jax").join_jax_group(args)
    return None


def create_runner(args: ServerArgs, loaded, runner_cfg: RunnerConfig, group: Any = None
                  ) -> ModelRunner:
    """`loaded`: the loader's `LoadedModel`; `group`: `join_group`'s."""
    if group is not None:
        return _launcher("jax").start_jax_leader(group, loaded, runner_cfg)
    if runner_cfg.backend == "torch" and (runner_cfg.tp_size > 1 or args.nnodes > 1):
        return _launcher("torch").start_torch_tp(args, loaded.config, loaded.params,
                                                 loaded.model_path, runner_cfg)
    return create_model_runner(loaded.config, loaded.params, runner_cfg)


def close_runner(runner: ModelRunner) -> None:
    """Release what a runner holds beyond the scheduler's thread: a group's follower ranks, a
    torch runner's compute thread."""
    close = getattr(runner, "close", None)
    if close is not None:
        close()


def run_follower_host(args: ServerArgs) -> int:
    """`launch_server --nnodes M --node-rank R` with R > 0: this host's follower ranks of the
    backend's multi-host group (no HTTP, no scheduler); the process exit code."""
    if resolve_backend(args.backend) == "torch":
        return _launcher("torch").run_torch_node(args)
    return _launcher("jax").run_jax_follower(args)
