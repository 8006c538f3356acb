"""What the scheduler reports outside its process: `/server_info` (memory, queues, counters,
and when idle the KV integrity check) and the load a router polls (`/get_load`)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sgl_tpu.executor import omp_wait

if TYPE_CHECKING:
    from sgl_tpu.scheduler.scheduler import Scheduler


def server_info(scheduler: Scheduler) -> dict[str, Any]:
    """What `/server_info` reports from the scheduler (the server process and the in-process
    Engine both use this): memory, queues, counters, and when idle the KV integrity check."""
    stats = {k: v for k, v in asdict(scheduler.stats).items() if not k.startswith("last_log")}
    memory = scheduler.memory_info()
    kv_bytes = scheduler.runner.kv_bytes
    data: dict[str, Any] = {
        # the KV pool: its element type, bytes and tokens per GB (a bfloat16 pool holds twice
        # a float32 pool's tokens in the same bytes; a sliding-window pool more still)
        "memory": {**memory, "kv_cache_dtype": scheduler.config.kv_cache_dtype,
                   "kv_bytes": kv_bytes,
                   "kv_tokens_per_gb": round(memory["max_total_tokens"] * 1e9 / kv_bytes)
                   if kv_bytes else None},
        "num_running_reqs": scheduler.num_running,
        "num_waiting_reqs": len(scheduler.waiting),
        "num_compilations": scheduler.runner.num_compilations(),
        "device_decode_state": scheduler.config.device_decode_state,
        "scheduler_pid": os.getpid(),
        "omp_wait": omp_wait.settings(),
        # the arithmetic the runner runs (CPU ISA, oneDNN's kernels, AMX, compiled kernels)
        "compute": scheduler.runner.compute_info(),
        "stats": stats,
    }
    # speculative decoding: what --speculative-algorithm resolved to and why, and with auto the
    # live decision per batch-size bucket (scheduler/speculative.py DraftGate)
    spec = scheduler.speculator
    data["speculative"] = {"algorithm": scheduler.config.speculative_algorithm or "none",
                           "resolution": scheduler.config.speculative_resolution,
                           **({} if spec is None else spec.info())}
    # LoRA adapters loaded (name -> id, folder, rank; None: --enable-lora off)
    data["lora_adapters"] = None if scheduler.lora is None else scheduler.lora.info()
    # cache control: open sessions (scheduler/sessions.py), the eviction policy, tool pauses
    data["sessions"] = scheduler.sessions.info()
    # programs (agents): how many, active / paused on a tool / held by admission control
    data["programs"] = scheduler.programs.info()
    data["cache_control"] = {
        "radix_eviction_policy": scheduler.config.radix_eviction_policy,
        "max_retention_s": scheduler.config.max_retention_s,
        "tool_pause_grace_s": scheduler.config.tool_pause_grace_s,
        "num_tool_pauses": scheduler.kv.retention.num_tool_pauses}
    if scheduler.tiers is not None:  # host/disk tiers: hits, loads, demotions, occupancy
        data["tiers"] = scheduler.tiers.info()
    if not scheduler.has_work:
        try:
            scheduler.check_integrity()
            data["integrity"] = "ok"
        except RuntimeError as e:
            data["integrity"] = str(e)
    return data


def load_info(scheduler: Scheduler) -> dict[str, Any]:
    """The load a router balances on (`/get_load`, SGLang's fields): requests running and
    waiting, tokens whose K/V the running requests hold, prompt tokens still to compute. Cheap:
    no integrity check, one pass over the queues."""
    queues = scheduler.queues
    chunked = [] if queues.chunked_req is None else [queues.chunked_req]
    running = [*queues.running, *queues.jump_forward_reqs, *chunked]
    waiting = list(scheduler.waiting)
    return {
        "num_reqs": len(running) + len(waiting),
        "num_waiting_reqs": len(waiting),
        "num_tokens": sum(r.kv_len for r in running),
        "num_pending_tokens": sum(max(r.prompt_len - r.kv_len, 0) for r in waiting + chunked),
    }
