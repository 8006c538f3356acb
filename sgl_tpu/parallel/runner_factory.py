"""The scheduler's runner: a single-device `ModelRunner`, or rank 0 of a tensor-parallel group.

    tp_size 1, one node           executor/registry.create_model_runner
    --backend torch, tp_size > 1  parallel/torch_launch.start_torch_tp -> LeaderRunner (follower
                                  processes, torch.distributed; --nnodes: several hosts)
    --backend jax                 the registry's runner (tp_size: its device mesh)

Import-light: a backend's modules load only when it is chosen.
"""

from __future__ import annotations

from sgl_tpu.config import RunnerConfig, ServerArgs
from sgl_tpu.executor.registry import create_model_runner
from sgl_tpu.executor.step import ModelRunner


def create_runner(args: ServerArgs, loaded, runner_cfg: RunnerConfig) -> ModelRunner:
    """`loaded`: the loader's `LoadedModel`."""
    if runner_cfg.backend == "torch" and (runner_cfg.tp_size > 1 or args.nnodes > 1):
        from sgl_tpu.parallel.torch_launch import start_torch_tp

        return start_torch_tp(args, loaded.config, loaded.params, loaded.model_path, runner_cfg)
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
    from sgl_tpu.executor.registry import resolve_backend

    if resolve_backend(args.backend) == "torch":
        from sgl_tpu.parallel.torch_launch import run_torch_node

        return run_torch_node(args)
    from sgl_tpu.parallel.jax_multihost import run_jax_follower

    return run_jax_follower(args)
