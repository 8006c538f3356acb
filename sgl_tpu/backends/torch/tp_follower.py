"""A local torch tensor-parallel follower process: `python -m sgl_tpu.backends.torch.tp_follower`
with a `messages.TorchFollowerSpec` (JSON) on stdin; started by backends/torch/tp_launch.py.

    connect to the leader (hello)   nothing loaded yet: a wrong address fails fast, exit 1
    load the checkpoint, FollowerReady
    TorchTPModelRunner(rank r)      joins the process group, keeps its slice of the weights
    run_follower                    replays rank 0's calls until shutdown / the leader is gone

It dies with its parent (PR_SET_PDEATHSIG), so a killed scheduler leaves no follower behind.
"""

from __future__ import annotations

import logging
import os
import sys

import msgspec

from sgl_tpu.messages import FollowerFailed, FollowerReady, TorchFollowerSpec
from sgl_tpu.parallel.follower import (
    FollowerConnectError,
    connect_to_leader,
    run_follower,
    set_parent_death_signal,
)

logger = logging.getLogger("sgl_tpu.tp_follower")


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=TorchFollowerSpec)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"[%(asctime)s tp rank {spec.rank}] %(message)s")
    set_parent_death_signal()
    if os.getppid() != spec.parent_pid:  # the parent died before the signal was armed
        return 0
    try:
        link = connect_to_leader(spec.leader_endpoint, spec.rank,
                                 timeout_s=spec.connect_timeout_s)
    except FollowerConnectError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        from sgl_tpu.backends.torch.device import resolve_device
        from sgl_tpu.backends.torch.tp import TorchTPModelRunner, TPRank
        from sgl_tpu.backends.torch.tp_launch import rank_runner_config
        from sgl_tpu.config import ServerArgs
        from sgl_tpu.executor.registry import runner_config
        from sgl_tpu.loader import load_model

        args = msgspec.convert(spec.server_args, ServerArgs)
        loaded = load_model(spec.model_path)
        config = rank_runner_config(runner_config(args, loaded.config.context_len),
                                    resolve_device(args.device).type, spec.local_rank,
                                    spec.ranks_per_node)
        link.send(FollowerReady(rank=spec.rank))
        runner = TorchTPModelRunner(
            loaded.config, loaded.params, config,
            TPRank(rank=spec.rank, world_size=spec.world_size, init_method=spec.init_method,
                   local_rank=spec.local_rank, timeout_s=spec.dist_timeout_s))
        del loaded
    except Exception as e:
        logger.exception("rank %d: start-up failed", spec.rank)
        link.send(FollowerFailed(rank=spec.rank, error=f"{type(e).__name__}: {e}"))
        link.close()
        return 1
    run_follower(runner, link, parent_pid=spec.parent_pid)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
