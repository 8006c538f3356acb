"""Tensor-parallel cost: measured on this machine's CPU, and computed on paper for TPU slices.

    python -m sgl_tpu.bench.tp [--tp 3] [--decode-batches 1,8] [--context 256] [--repeats 5]
                               [--threads 2] [--output FILE]
    python -m sgl_tpu.bench.tp --paper-only

Measured (JAX, XLA:CPU, `--tp` forced host devices in one process; the default model): the
decode step of the real runner at TP 1 and TP N, interleaved; and a program that performs only
the step's collectives (the embedding's and two per layer all-reduces of [S, D], the logits'
all-gather of [S, V]) on the same mesh, so a step's time splits into collectives and the rest.

On paper (`paper_estimates`): per decode step and layer, the bytes each chip sends in its two
all-reduces for Llama-3-8B and -70B at TP 4/8 on TPU v5e/v6e, and an inter-token latency
estimate = weight (+KV) bytes / (TP x HBM bandwidth) + all-reduces x (latency + bytes / ICI
bandwidth). The chip figures are Google's published ones; the per-collective latency is an
assumption stated in the output (measure it on your slice).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass

from sgl_tpu.bench.report import emit

# ---- on paper -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_gib: float
    hbm_gb_s: float  # HBM bandwidth, GB/s
    ici_gb_s: float  # inter-chip interconnect bandwidth per chip, GB/s (all links)


@dataclass(frozen=True)
class Llama:
    name: str
    params_b: float  # parameters, billions
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int


# Google Cloud's TPU documentation: v5e 16 GiB HBM2 at 819 GB/s, 1,600 Gbps ICI per chip;
# v6e (Trillium) 32 GiB at 1,640 GB/s, 3,584 Gbps ICI per chip.
CHIPS = (Chip("v5e", 16, 819, 1600 / 8), Chip("v6e", 32, 1640, 3584 / 8))
MODELS = (Llama("Llama-3-8B", 8.03, 32, 4096, 8, 128, 128256),
          Llama("Llama-3-70B", 70.6, 80, 8192, 8, 128, 128256))
ACT_BYTES = 2  # bfloat16 activations on the wire
ALLREDUCE_LATENCY_US = 10.0  # assumed fixed cost of one small all-reduce on a slice


def paper_estimates(batch: int = 1, context: int = 2048) -> list[dict]:
    """Rows of (model, chip, tp): communication per decode step and layer, and expected ITL."""
    rows = []
    for m in MODELS:
        weight_gb = m.params_b * ACT_BYTES  # bf16 weights, GB
        kv_gb = batch * context * m.layers * 2 * m.kv_heads * m.head_dim * ACT_BYTES / 1e9
        for chip in CHIPS:
            for tp in (4, 8):
                msg = batch * m.hidden * ACT_BYTES  # one all-reduce's payload, bytes
                ring = 2 * (tp - 1) / tp  # bytes each chip sends per payload byte (ring)
                per_layer_sent = 2 * ring * msg
                num_allreduce = 2 * m.layers + 1  # + the vocab-parallel embedding's
                logits_sent = (tp - 1) / tp * batch * m.vocab * 4  # f32 all-gather
                fits = (weight_gb + kv_gb) * 1e9 <= 0.9 * tp * chip.hbm_gib * 2**30
                hbm_ms = (weight_gb + kv_gb) / (tp * chip.hbm_gb_s) * 1e3
                comm_ms = (num_allreduce * (ALLREDUCE_LATENCY_US * 1e-3
                                            + ring * msg / (chip.ici_gb_s * 1e9) * 1e3)
                           + logits_sent / (chip.ici_gb_s * 1e9) * 1e3)
                rows.append({
                    "model": m.name, "chip": chip.name, "tp": tp, "batch": batch,
                    "context": context,
                    "allreduce_payload_kib": msg / 1024,
                    "sent_per_chip_per_layer_kib": per_layer_sent / 1024,
                    "sent_per_chip_per_step_mib": (per_layer_sent * m.layers + ring * msg
                                                   + logits_sent) / 2**20,
                    "fits_bf16": fits,
                    "hbm_ms": round(hbm_ms, 2), "comm_ms": round(comm_ms, 2),
                    "itl_ms": round(hbm_ms + comm_ms, 2) if fits else None,
                })
    return rows


# ---- measured -------------------------------------------------------------------------------


def _decode_steps(n_seqs: int, context: int, page_size: int, vocab: int):
    import numpy as np

    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    pages_per_seq = -(-(context + 1) // page_size)
    rng = np.random.default_rng(0)
    return [SeqStep(token_ids=[int(rng.integers(3, vocab))], prefix_len=context,
                    pages=np.arange(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq),
                    sampling=greedy, seed=i, num_output_tokens=0, return_logprob=False)
            for i in range(n_seqs)]


def _collectives_only(mesh, layers: int, hidden: int, vocab_padded: int, n_seqs: int):
    """A jitted program doing only one decode step's collectives on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from sgl_tpu.parallel.mesh import TP_AXIS

    def per_device(x, logits):  # x [S, D] replicated, logits [S, Vp / tp]
        for _ in range(2 * layers + 1):
            x = lax.psum(x, TP_AXIS) * (1.0 / mesh.size)
        return x, lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, TP_AXIS)),
                               out_specs=(P(), P()), check_vma=False))
    x = jnp.ones((n_seqs, hidden), jnp.float32)
    logits = jax.device_put(jnp.ones((n_seqs, vocab_padded), jnp.float32),
                            jax.sharding.NamedSharding(mesh, P(None, TP_AXIS)))
    return lambda: jax.block_until_ready(fn(x, logits))


def measure(tp: int, batches: list[int], context: int, repeats: int) -> dict:
    import jax

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(None)
    cfg = loaded.config
    runners = {}
    for size in (1, tp):
        args = ServerArgs(backend="jax", dtype="float32", tp_size=size, page_size=16,
                          max_total_tokens=max(batches) * (context + 32) + 64,
                          max_running_requests=max(batches), chunked_prefill_size=64,
                          min_token_bucket=64, skip_warmup=True)
        runners[size] = create_model_runner(cfg, loaded.params, runner_config(args, 4096))
    out: dict = {"tp": tp, "devices": jax.device_count(), "cpus": len(os.sched_getaffinity(0)),
                 "context": context, "batches": {}}
    for n in batches:
        steps = _decode_steps(n, context, 16, cfg.vocab_size)
        calls = {f"tp{size}": (lambda r=r, s=steps: r.forward(ForwardMode.DECODE, s))
                 for size, r in runners.items()}
        sharded = runners[tp]
        calls["collectives_only"] = _collectives_only(
            sharded.mesh, cfg.num_layers, cfg.hidden_size, sharded.shard_config.vocab_size, n)
        for fn in calls.values():
            fn()
            fn()
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(repeats):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out["batches"][n] = {
            "step_ms": {k: round(v, 2) for k, v in med.items()},
            "tp_over_tp1": round(med[f"tp{tp}"] / med["tp1"], 2),
            "collectives_share_of_tp_step": round(med["collectives_only"] / med[f"tp{tp}"], 2),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="XLA:CPU threads (0: XLA's default)")
    p.add_argument("--paper-only", action="store_true")
    p.add_argument("--output")
    a = p.parse_args()
    result: dict = {"paper": {"assumptions": {
        "allreduce_latency_us": ALLREDUCE_LATENCY_US, "activation_bytes": ACT_BYTES,
        "chips": [asdict(c) for c in CHIPS], "models": [asdict(m) for m in MODELS],
        "itl": "bf16 weights + KV at the context read once per step from HBM, split over tp "
               "chips; plus (2 x layers + 1) all-reduces (fixed latency + ring bytes / ICI) "
               "and the f32 logits all-gather; compute and overlap ignored (decode is "
               "memory-bound at small batch)"},
        "batch_1": paper_estimates(batch=1), "batch_32": paper_estimates(batch=32)}}
    if not a.paper_only:
        # Forced host devices must be configured before JAX starts.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={a.tp}")
        if a.threads:
            os.environ["XLA_FLAGS"] += (" --xla_cpu_multi_thread_eigen=true "
                                        f"intra_op_parallelism_threads={a.threads}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        result["measured"] = measure(a.tp, [int(b) for b in a.decode_batches.split(",")],
                                     a.context, a.repeats)
    emit(result, a.output)


if __name__ == "__main__":
    main()
