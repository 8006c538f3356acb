"""Start `--backend torch --tp-size N`: rank 0 in the calling process (the scheduler process, or
the caller of `Engine`), ranks 1..N-1 as follower processes (on this host, or with `--nnodes M`
N/M per host, started there by `run_torch_node`).

    start_torch_tp (rank 0)                            python -m sgl_tpu.backends.torch.tp_follower
      check_torch_tp: every refusal, before any          (one per rank, TorchFollowerSpec on stdin)
        process starts or weight reaches a device
      FollowerGroup.bind(ipc://<tmp>/sgl_tpu-<pid>-tp)
      spawn ranks 1..N-1 ───────────────────────────►  connect_to_leader ──FollowerHello──►
      wait_for_followers  ◄─────────────────────────   (FollowerConnectError: exit 1)
                                                        load_model ──FollowerReady──►
      wait_until_ready    ◄─────────────────────────
      TorchTPModelRunner(rank 0)  ══ init_process_group(tcp://127.0.0.1:<port>) ══ rank r
      LeaderRunner  ── Runner* calls ──────────────►  run_follower(TorchTPModelRunner(rank r))

While it waits, the leader checks that every follower process is alive, so a follower that
dies at start-up is reported (rank, exit code) instead of waited for. Any start-up failure
closes the group and ends the followers already started. `LeaderRunner.close()` sends the
followers away and reaps them; followers also die with their parent (PR_SET_PDEATHSIG), and
leave their loop when the leader's socket goes away.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from functools import partial

import msgspec
import torch

from sgl_tpu.backends.torch.device import resolve_device
from sgl_tpu.backends.torch.tp import TorchTPModelRunner, TPRank, dist_backend
from sgl_tpu.config import RunnerConfig, ServerArgs
from sgl_tpu.messages import TorchFollowerSpec
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.parallel.head_split import HeadSplit, check_tp_size
from sgl_tpu.parallel.leader import FollowerGroup, FollowerLost, LeaderRunner

logger = logging.getLogger(__name__)
FOLLOWER_MODULE = "sgl_tpu.backends.torch.tp_follower"
CONNECT_TIMEOUT_S = 60.0  # a follower's hello: a Python start and the torch import
READY_TIMEOUT_S = 1800.0  # followers load their weights (their liveness is checked meanwhile)
REAP_GRACE_S = 10.0  # followers leave on RunnerShutdown within this, else are terminated


def _device_count(kind: str) -> int | None:
    """Devices of `kind` visible here (None: no limit, the CPU)."""
    if kind == "cpu":
        return None
    module = getattr(torch, kind, None)
    count = getattr(module, "device_count", None)
    return count() if callable(count) else None


def check_torch_tp(args: ServerArgs, model_config: ModelConfig) -> HeadSplit:
    """Every reason `--backend torch --tp-size N` cannot run, as a ValueError, before any
    follower starts or any weight reaches a device."""
    check_nodes(args)
    split = check_tp_size(model_config, args.tp_size)
    if args.torch_compile == "on":
        raise ValueError("--tp-size > 1 with --backend torch runs eagerly: drop --torch-compile "
                         "on")
    if args.quantization not in ("auto", "none"):
        raise ValueError(f"--quantization {args.quantization} with --tp-size > 1 is not "
                         f"supported (ranks slice dense weights): use --quantization none")
    kind = resolve_device(args.device).type
    dist_backend(kind)
    available = _device_count(kind)
    per_node = args.tp_size // args.nnodes
    if available is not None and per_node > available:
        where = "" if args.nnodes == 1 else f" on each of --nnodes {args.nnodes} hosts"
        raise ValueError(f"--tp-size {args.tp_size} needs {per_node} {kind} devices{where}, one "
                         f"per rank; {available} visible")
    return split


def check_nodes(args: ServerArgs) -> int:
    """Ranks per host; ValueError when --tp-size does not spread evenly over --nnodes."""
    if args.tp_size % args.nnodes or args.tp_size < args.nnodes:
        raise ValueError(f"--tp-size {args.tp_size} over --nnodes {args.nnodes}: every host runs "
                         f"the same number of torch ranks, so --tp-size must be a multiple of "
                         f"--nnodes")
    return args.tp_size // args.nnodes


def rank_runner_config(cfg: RunnerConfig, kind: str, local_rank: int, world_size: int
                       ) -> RunnerConfig:
    """One rank's runner config: eager, dense, its own device; on the CPU the ranks share the
    cores (each rank's all-reduce waits for the slowest, so oversubscribing hurts)."""
    threads = cfg.cpu_threads
    if kind == "cpu" and threads == 0:
        threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    return dataclasses.replace(cfg, compile=False, quantization="none", cpu_threads=threads,
                               device=kind if kind == "cpu" else f"{kind}:{local_rank}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(spec: TorchFollowerSpec) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE], stdin=subprocess.PIPE)
    proc.stdin.write(msgspec.json.encode(spec))
    proc.stdin.close()
    return proc


def _check_alive(procs: Mapping[int, subprocess.Popen]) -> None:
    for rank, p in procs.items():
        if p.poll() is not None:
            raise FollowerLost(f"follower rank {rank} (pid {p.pid}) exited with code "
                               f"{p.returncode} during start-up (its log is above)")


def reap(procs: Mapping[int, subprocess.Popen], grace_s: float) -> None:
    """Wait up to `grace_s` for the followers to exit, then terminate / kill the rest."""
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _finish(procs: Mapping[int, subprocess.Popen], grace_s: float = REAP_GRACE_S) -> None:
    import torch.distributed as dist

    reap(procs, grace_s)
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn_ranks(args: ServerArgs, ranks: range, per_node: int, leader_endpoint: str,
                 init_method: str, connect_timeout_s: float) -> dict[int, subprocess.Popen]:
    return {rank: _spawn(TorchFollowerSpec(
        rank=rank, world_size=args.tp_size, leader_endpoint=leader_endpoint,
        init_method=init_method, model_path=args.model_path,
        server_args=msgspec.to_builtins(args), parent_pid=os.getpid(),
        local_rank=rank % per_node, ranks_per_node=per_node, log_level=args.log_level,
        connect_timeout_s=connect_timeout_s)) for rank in ranks}


def start_torch_tp(args: ServerArgs, model_config: ModelConfig, params: dict,
                   model_path: str, runner_cfg: RunnerConfig) -> LeaderRunner:
    """Rank 0's runner of a new torch tensor-parallel group (see the module docstring).

    With `--nnodes M` the runner channel listens on `--dist-init-addr`'s port + 1 (as for
    JAX, backends/jax/multihost.py), the ranks meet at `--dist-init-addr`, and this host starts
    ranks 1..N/M-1; hosts 1..M-1 start theirs with `run_torch_node`."""
    check_torch_tp(args, model_config)
    tp, per_node = args.tp_size, args.tp_size // args.nnodes
    kind = resolve_device(args.device).type
    leader_cfg = rank_runner_config(runner_cfg, kind, 0, per_node)
    args = dataclasses.replace(args, model_path=model_path)  # followers load the same file
    if args.nnodes > 1:
        from sgl_tpu.parallel.channel import runner_channel

        bind, dial = runner_channel(args, bind=True), runner_channel(args, bind=False)
        init_method, connect_timeout_s = f"tcp://{args.dist_init_addr}", args.dist_timeout
    else:
        bind, dial = f"ipc://{tempfile.gettempdir()}/sgl_tpu-{os.getpid()}-tp", None
        init_method, connect_timeout_s = f"tcp://127.0.0.1:{_free_port()}", CONNECT_TIMEOUT_S
    group = FollowerGroup(bind, tp)
    procs: dict[int, subprocess.Popen] = {}
    try:
        procs = _spawn_ranks(args, range(1, per_node), per_node, dial or group.endpoint,
                             init_method, connect_timeout_s)
        check = partial(_check_alive, procs)
        group.wait_for_followers(connect_timeout_s, check)
        group.wait_until_ready(READY_TIMEOUT_S, check)
        runner = TorchTPModelRunner(model_config, params, leader_cfg,
                                    TPRank(rank=0, world_size=tp, init_method=init_method))
    except BaseException:
        group.close()
        _finish(procs, grace_s=0.0)  # followers still starting never read the shutdown call
        raise
    logger.info("torch tensor parallelism: %d ranks on %d host(s) (%s), local followers %s", tp,
                args.nnodes, dist_backend(kind), {r: p.pid for r, p in procs.items()})
    return LeaderRunner(runner, group, on_close=partial(_finish, procs))


def run_torch_node(args: ServerArgs) -> int:
    """A follower host of multi-host torch tensor parallelism (`launch_server --node-rank R`,
    R > 0): start this host's ranks, wait for them; the first non-zero exit code of theirs
    (a rank that cannot reach rank 0 prints why), else 0. No HTTP, no scheduler."""
    from sgl_tpu.parallel.channel import runner_channel

    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s tp host {args.node_rank}] %(message)s")
    try:
        per_node = check_nodes(args)
        dial = runner_channel(args, bind=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    procs = _spawn_ranks(args, ranks, per_node, dial, f"tcp://{args.dist_init_addr}",
                         args.dist_timeout)
    logger.info("host %d: ranks %s, pids %s", args.node_rank, list(ranks),
                [p.pid for p in procs.values()])
    try:
        codes = [p.wait() for p in procs.values()]
    finally:
        reap(procs, 0.0)
    return next((c for c in codes if c), 0)
