"""`--dp-size N`: N replicas of the server behind SGLang's cache-aware router (`sglang-router`,
a Rust load balancer from PyPI). sgl-tpu writes no router of its own; this module only starts
and supervises the processes:

    launcher (this process)
      ├── replica 0: python -m sgl_tpu.launch_server ... --host 127.0.0.1 --port P0
      │              (its own tokenizer/HTTP, scheduler and detokenizer processes)
      ├── replica N-1 ... --port P(N-1)
      └── router:    python -m sglang_router.launch_router --port PORT --worker-urls ...

1. Each replica gets its share of the machine before it starts: on CPU a disjoint set of cores
   (sched_setaffinity, inherited by its scheduler, whose executor sizes its thread pool from
   it); on a TPU VM one chip (libtpu's per-process chip variables); on CUDA one GPU.
2. The launcher waits until every replica answers `/health` (a replica that exits first ends
   the launch with a non-zero exit; its own error is on stderr above), then starts the router
   on `--host/--port` with the replicas' URLs and `--api-key` (for its probes of `/server_info`
   and `/model_info`), and waits until the router lists every replica.
3. The router's policy settings: the launcher's defaults spread agents that share a prefix
   (`router_defaults`); any `--router-*` flag the user gives replaces the matching default.
4. Supervision: a replica that dies later is reported once (the router's health checks route
   around it); the router dying, or every replica, ends the launch with exit 1. SIGTERM/SIGINT
   stop the router, then the replicas (SIGTERM, then SIGKILL after a grace period). Every child
   also gets SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from sgl_tpu.cli import to_argv
from sgl_tpu.config import ServerArgs
from sgl_tpu.server.ready import READY_MESSAGE

logger = logging.getLogger("sgl_tpu.replicas")
REPLICA_HOST = "127.0.0.1"  # replicas are reached through the router only
READY_TIMEOUT_S = 1800.0  # model load + warm-up of the slowest replica
ROUTER_READY_TIMEOUT_S = 60.0
POLL_PERIOD_S = 0.5
STOP_GRACE_S = 15.0
TPU_PORT_BASE = 8476  # libtpu's per-process controller port, one per replica
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Placement:
    """What one replica may use: CPU cores (None = all), and environment variables."""

    cpus: tuple[int, ...] | None
    env: dict[str, str]


def plan_placements(dp_size: int, device: str, cpus: list[int], tp_size: int = 1
                    ) -> list[Placement]:
    """Split the machine between `dp_size` replicas. `device` is "tpu", "cuda" or "cpu".
    On CPU each replica gets len(cpus) // dp_size cores (at least one; with more replicas than
    cores they share round-robin; its tensor-parallel ranks split them); on CUDA `tp_size`
    GPUs, one per tensor-parallel rank."""
    if device == "tpu":
        return [Placement(None, {
            "TPU_VISIBLE_CHIPS": str(i), "TPU_VISIBLE_DEVICES": str(i),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(TPU_PORT_BASE + i),
            "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{TPU_PORT_BASE + i}",
            "TPU_MESH_CONTROLLER_PORT": str(TPU_PORT_BASE + i)}) for i in range(dp_size)]
    if device == "cuda":
        return [Placement(None, {"CUDA_VISIBLE_DEVICES": ",".join(
            str(g) for g in range(i * tp_size, (i + 1) * tp_size))}) for i in range(dp_size)]
    per = max(1, len(cpus) // dp_size)
    out = []
    for i in range(dp_size):
        share = tuple(cpus[i * per:(i + 1) * per]) if dp_size <= len(cpus) \
            else (cpus[i % len(cpus)],)
        out.append(Placement(share, {"OMP_NUM_THREADS": str(len(share))}))
    return out


def detect_device(args: ServerArgs) -> str:
    """Which accelerator the replicas split: the --device flag, else what the host has."""
    if args.device in ("tpu", "cuda"):
        return args.device
    if args.device == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return "cpu"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    return "cpu"


def free_ports(after: int, count: int, host: str = REPLICA_HOST) -> list[int]:
    """The first `count` ports above `after` that can be bound now."""
    ports, port = [], after + 1
    while len(ports) < count:
        if port > 65535:
            raise RuntimeError(f"no {count} free ports above {after}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                ports.append(port)
            except OSError:
                pass
        port += 1
    return ports


def replica_argv(args: ServerArgs, port: int, rank: int = 0) -> list[str]:
    """The command line of replica `rank`: the same flags, one replica, its own address (and
    its KV events on the configured ports + `rank`, stamped with it)."""
    one = args.replace(dp_size=1, router_args=(), router_policy="cache_aware", host=REPLICA_HOST,
                       port=port)
    if args.kv_events is not None:
        one = one.replace(kv_events_config=dataclasses.replace(
            args.kv_events, dp_rank=rank).to_json())
    return [sys.executable, "-m", "sgl_tpu.launch_server", *to_argv(one)]


def router_defaults(args: ServerArgs) -> list[str]:
    """The router flags the launcher sets for `args.router_policy`, less those the user gave.

    cache_aware sends a request to the replica holding the longest prefix of its text unless the
    replicas' loads (the router's count of requests in flight to each) are apart by more than
    `--balance-abs-threshold` AND the busiest exceeds `--balance-rel-threshold` x the idlest;
    then it goes to the idlest. The router's own thresholds (64 requests, 1.5x) suit SGLang GPU
    workers that run thousands of requests at once; here a replica runs
    `--max-running-requests` (64 by default), so they never trip, and agents that share a
    system prompt all follow the replica that cached it first. The launcher scales the absolute
    threshold to the replica (1/32 of `--max-running-requests`, at least 2) and asks for 1.2x:
    a new agent goes to the idler replica, and an agent whose replica is the busier one keeps
    its replica while the gap stays within the threshold (with two replicas, a returning agent
    whose replica is the idler one goes back to it either way).

    manual pins each `X-SMG-Routing-Key` to one replica; the launcher gives a new key to the
    replica with the fewest keys in flight (`min_group`) rather than a random one, so sessions
    split evenly and each stays where its KV is."""
    if args.router_policy == "cache_aware":
        defaults = {"--balance-abs-threshold": str(max(2, args.max_running_requests // 32)),
                    "--balance-rel-threshold": "1.2"}
    elif args.router_policy == "manual":
        defaults = {"--assignment-mode": "min_group"}
    else:
        return []
    given = {token.split("=", 1)[0] for token in args.router_args if token.startswith("--")}
    return [t for flag, value in defaults.items() if flag not in given for t in (flag, value)]


def router_argv(args: ServerArgs, urls: list[str], metrics_port: int | None = None
                ) -> list[str]:
    """The router's command line. `metrics_port`: where it exports its Prometheus metrics
    (its own default, 29000, would collide between two launches on one host)."""
    metrics = [] if metrics_port is None else ["--prometheus-port", str(metrics_port)]
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host,
            "--port", str(args.port), "--worker-urls", *urls, "--policy", args.router_policy,
            *metrics, "--log-level", "warn", *router_defaults(args)]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + list(args.router_args)  # the user's router flags (parsed last)


def _child_setup(cpus: tuple[int, ...] | None):
    def setup() -> None:  # runs in the child between fork and exec
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass  # not Linux: the replicas' own parent-watch still ends their children
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return setup


def http_status(url: str) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


class ReplicaSet:
    """The replicas and the router: start, wait for health, supervise, stop."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.replicas: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.router: subprocess.Popen | None = None
        self.reported_dead: set[int] = set()
        self.stopping = False

    def start_replicas(self) -> None:
        device = detect_device(self.args)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else list(range(os.cpu_count() or 1))
        placements = plan_placements(self.args.dp_size, device, cpus, self.args.tp_size)
        self.ports = free_ports(self.args.port, self.args.dp_size)
        for i, (place, port) in enumerate(zip(placements, self.ports, strict=True)):
            logger.info("replica %d: port %d, %s", i, port,
                        f"cpus {list(place.cpus)}" if place.cpus is not None else place.env)
            self.replicas.append(subprocess.Popen(
                replica_argv(self.args, port, i), env={**os.environ, **place.env},
                preexec_fn=_child_setup(place.cpus)))

    def wait_replicas(self) -> bool:
        """True once every replica is healthy; False if one exited first or we were stopped."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = set(range(len(self.replicas)))
        while pending and not self.stopping:
            for i in sorted(pending):
                code = self.replicas[i].poll()
                if code is not None:
                    print(f"error: replica {i} (port {self.ports[i]}) exited with code {code} "
                          "before it was ready", file=sys.stderr, flush=True)
                    return False
                if http_status(f"http://{REPLICA_HOST}:{self.ports[i]}/health") == 200:
                    pending.discard(i)
            if time.monotonic() > deadline:
                print(f"error: replicas {sorted(pending)} not ready after {READY_TIMEOUT_S:.0f} "
                      "s", file=sys.stderr, flush=True)
                return False
            if pending:
                time.sleep(POLL_PERIOD_S)
        return not self.stopping

    def start_router(self) -> bool:
        urls = [f"http://{REPLICA_HOST}:{p}" for p in self.ports]
        logger.info("router: --policy %s %s", self.args.router_policy,
                    " ".join(router_defaults(self.args)))
        metrics_port = free_ports(max(self.ports), 1)[0]
        self.router = subprocess.Popen(router_argv(self.args, urls, metrics_port),
                                       preexec_fn=_child_setup(None))
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else self.args.host
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while not self.stopping and time.monotonic() < deadline:
            if self.router.poll() is not None:
                print(f"error: the router exited with code {self.router.returncode}",
                      file=sys.stderr, flush=True)
                return False
            if self._router_has_replicas(f"http://{host}:{self.args.port}"):
                return True
            time.sleep(POLL_PERIOD_S)
        if not self.stopping:
            print(f"error: the router did not answer /health within "
                  f"{ROUTER_READY_TIMEOUT_S:.0f} s", file=sys.stderr, flush=True)
        return False

    def _router_has_replicas(self, url: str) -> bool:
        """The router is up and has registered every replica (it answers /health before its
        registration probes of /server_info and /model_info are done)."""
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        try:
            req = urllib.request.Request(url + "/workers", headers=headers)
            with urllib.request.urlopen(req, timeout=5) as resp:
                workers = json.loads(resp.read()).get("workers", [])
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
        return len(workers) >= len(self.replicas)

    def supervise(self) -> int:
        """Until stopped: report dead replicas; the router's or every replica's death is fatal.
        Returns the exit code."""
        while not self.stopping:
            assert self.router is not None
            if self.router.poll() is not None:
                logger.error("the router died (exit code %s); stopping", self.router.returncode)
                return 1
            for i, proc in enumerate(self.replicas):
                if proc.poll() is not None and i not in self.reported_dead:
                    self.reported_dead.add(i)
                    logger.error("replica %d (port %d) died (exit code %s); the router routes "
                                 "around it", i, self.ports[i], proc.returncode)
            if len(self.reported_dead) == len(self.replicas):
                logger.error("every replica died; stopping")
                return 1
            time.sleep(POLL_PERIOD_S)
        return 0

    def stop(self) -> None:
        """The router first (no new requests), then the replicas; SIGKILL after a grace."""
        procs = ([self.router] if self.router else []) + self.replicas
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def launch_replicas(args: ServerArgs) -> None:
    """Run `args.dp_size` replicas behind the router until SIGTERM/SIGINT; exits non-zero when
    the launch fails or the router or every replica dies."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s %(name)s] %(message)s")
    if importlib.util.find_spec("sglang_router") is None:
        print("error: --dp-size needs the sglang-router package: pip install "
              "'sgl-tpu[router]'", file=sys.stderr, flush=True)
        raise SystemExit(1)
    replicas = ReplicaSet(args)

    def on_signal(signum, frame) -> None:
        replicas.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    code = 1
    try:
        replicas.start_replicas()
        if replicas.wait_replicas() and replicas.start_router():
            print(f"{READY_MESSAGE} http://{args.host}:{args.port} "
                  f"({args.dp_size} replicas, router policy {args.router_policy})", flush=True)
            code = replicas.supervise()
        elif replicas.stopping:
            code = 0
    finally:
        replicas.stop()
    if code:
        raise SystemExit(code)
