"""JAX tensor parallelism across hosts (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`):
one process per host, all in one `jax.distributed` group whose devices form one global mesh.

    rank 0 (`launch_server --node-rank 0`)            rank r > 0 (`launch_server --node-rank r`)
    HTTP + tokenizer, detokenizer, and the            run_jax_follower (no HTTP, no scheduler)
    scheduler process, which:
      join_jax_group:
        FollowerGroup.bind(tcp://*:PORT+1)  ◄──FollowerHello──  connect_to_leader(HOST:PORT+1)
        init_jax_distributed  ═══ coordinator at HOST:PORT ═══  init_jax_distributed
      start_jax_leader:
        JaxModelRunner(global mesh)                             JaxModelRunner(global mesh)
      wait_until_ready  ◄────────────────────FollowerReady──
      LeaderRunner ──RunnerForward / TokenLogprobs / ...──►  run_follower: the same jitted
           │ the same jitted step                              step on its own devices
           ▼
      XLA collectives between the hosts' devices (Gloo on CPU, ICI/DCN on TPU)

Every rank first says hello on the runner channel, and only then do all join
`jax.distributed`: a rank that is missing or misaddressed is named by a clear error (the JAX
runtime aborts the process when its own join times out). The join runs before anything else
touches JAX in these processes (it must precede backend start-up). Every rank loads the
checkpoint from its own disk and places only its devices' slices (backends/jax/mesh.py). Runner
calls, not requests, are broadcast: the scheduler's time-based state (deadlines, session
retention) exists once, on rank 0.

Ending: SIGTERM to rank 0 stops its scheduler process, whose exit sends `RunnerShutdown`; the
followers leave their loop, and all ranks leave `jax.distributed` together. A rank 0 that dies
without a word drops the runner channel (socket closed, or heartbeats stop when its host
vanished) and each follower exits at once. The channel's port is the coordinator's plus one.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import time

from sgl_tpu.config import RunnerConfig, ServerArgs
from sgl_tpu.executor.step import ModelRunner
from sgl_tpu.parallel.channel import dist_host_port, runner_channel

logger = logging.getLogger("sgl_tpu.tp")
READY_TIMEOUT_S = 1800.0  # followers load weights and build their runner meanwhile


def init_jax_distributed(args: ServerArgs) -> None:
    """Join the `jax.distributed` group (before any other JAX use in this process)."""
    host, port = dist_host_port(args)
    import jax

    logger.info("rank %d of %d: joining jax.distributed at %s:%d", args.node_rank, args.nnodes,
                host, port)
    try:
        jax.distributed.initialize(
            coordinator_address=f"{host}:{port}", num_processes=args.nnodes,
            process_id=args.node_rank, initialization_timeout=args.dist_timeout)
    except Exception as e:  # the runtime's errors are long and name no flag
        raise ConnectionError(
            f"rank {args.node_rank} of {args.nnodes}: jax.distributed could not form the group "
            f"at --dist-init-addr {host}:{port} within {args.dist_timeout} s (is every rank "
            f"started with the same --nnodes and --dist-init-addr, and rank 0's port reachable "
            f"from this host?): {str(e).splitlines()[0]}") from None
    # jax.distributed installs a preemption notifier that swallows SIGTERM; a server must stop
    # when told to.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.tp_size != jax.device_count():
        raise ValueError(f"--tp-size {args.tp_size} with --nnodes {args.nnodes}: the group has "
                         f"{jax.device_count()} devices ({jax.local_device_count()} here); "
                         f"multi-host tensor parallelism spans all of them")


def join_jax_group(args: ServerArgs):
    """Rank 0, before anything touches JAX: bind the runner channel, wait for every follower's
    hello, then join `jax.distributed` with them. Returns the `FollowerGroup`."""
    from sgl_tpu.parallel.leader import FollowerGroup

    group = FollowerGroup(runner_channel(args, bind=True), args.nnodes)
    try:
        group.wait_for_followers(args.dist_timeout)
        init_jax_distributed(args)
    except BaseException:
        group.close()
        raise
    # SIGTERM (the launcher stopping this process) exits through Python, so the atexit hook
    # below tells the followers to stop before the JAX coordinator in this process goes away.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    atexit.register(group.close)
    return group


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(0)


def start_jax_leader(group, loaded, runner_cfg: RunnerConfig) -> ModelRunner:
    """Rank 0's runner: the JAX runner over the global mesh, behind a `LeaderRunner` that
    broadcasts every call to the follower hosts (`group` from `join_jax_group`)."""
    from sgl_tpu.executor.registry import create_model_runner
    from sgl_tpu.parallel.leader import LeaderRunner

    try:
        runner = create_model_runner(loaded.config, loaded.params, runner_cfg)
        group.wait_until_ready(READY_TIMEOUT_S)
    except BaseException:
        group.close()
        raise
    logger.info("JAX tensor parallelism over %d hosts, %d devices", group.world_size,
                runner_cfg.tp_size)
    return LeaderRunner(runner, group)


def run_jax_follower(args: ServerArgs) -> int:
    """A follower host's whole life (`launch_server --node-rank R`, R > 0); the exit code."""
    from sgl_tpu.messages import FollowerFailed, FollowerReady
    from sgl_tpu.parallel.follower import FollowerConnectError, connect_to_leader, run_follower

    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s tp rank {args.node_rank}] %(message)s")
    try:
        from sgl_tpu.executor.registry import resolve_backend

        if resolve_backend(args.backend) != "jax":
            raise ValueError("--nnodes > 1 runs on the JAX executor: add --backend jax")
        link = connect_to_leader(runner_channel(args, bind=False), args.node_rank,
                                 timeout_s=args.dist_timeout)
        init_jax_distributed(args)
    except (ValueError, ConnectionError, FollowerConnectError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _exit(1)
    try:
        from sgl_tpu.executor.registry import create_model_runner, runner_config
        from sgl_tpu.loader import load_model

        t0 = time.perf_counter()
        loaded = load_model(args.model_path)
        runner = create_model_runner(loaded.config, loaded.params,
                                     runner_config(args, loaded.config.context_len))
        del loaded
        link.send(FollowerReady(rank=args.node_rank))
        logger.info("rank %d ready in %.1f s", args.node_rank, time.perf_counter() - t0)
    except Exception as e:
        logger.exception("rank %d: start-up failed", args.node_rank)
        link.send(FollowerFailed(rank=args.node_rank, error=f"{type(e).__name__}: {e}"))
        link.close()
        _exit(1)
    how = run_follower(runner, link)
    # Leader gone: its coordinator went with it, and jax.distributed's exit-time barrier would
    # wait for it, so leave at once. A normal close shuts the group down together.
    if how == "shutdown":
        import jax

        jax.distributed.shutdown()
        return 0
    _exit(0)
    return 0


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
