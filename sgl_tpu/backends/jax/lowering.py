"""The JAX runner's jitted steps lowered for a TPU (or a GPU) on this host, without the chips.

    model config ──server flags──► RunnerConfig (as the server resolves it on that platform:
        │                          bfloat16, `pallas` attention on TPU, device decode state)
        ▼
    runner.step_functions(config, mesh)       the very jit objects the runner calls, over
        │                                     AbstractMesh(("tp",)) for --tp-size N > 1
        ▼  arguments: jax.ShapeDtypeStruct with the server's shardings (no weight exists)
    jax.export.export(fn, platforms=(p,))     StableHLO of the program that chip would run:
        │                                     custom calls (Pallas = tpu_custom_call), host
        │                                     callbacks, explicit (shard_map) collectives
        ▼
    the same functions over a concrete mesh of N host CPU devices, `ref` attention, compiled
    at 1 and 2 layers: the collectives XLA's SPMD partitioner inserts (counts per layer and
    bytes per step, scaled to the model's layers) and the temporary bytes per device

The programs lowered per (model, platform, TP): `extend` (a chunked-prefill step at the largest
token bucket), `decode` (the packed DECODE step at the largest batch; a speculative verify
is a DECODE step of k + 1 rows per request, so this program), `decode_state` (DECODE over
the device-resident batch state), `sample_extend` / `sample_decode` (sampler with penalties,
grammar bitmask, greedy / temperature / top-k / top-p / min-p and seeded draws, all chosen
by data), `token_logprobs`. Under TP the attention (any backend) runs per device inside
shard_map, so the `ref` attention of the CPU compile partitions like `pallas` does.

`lower_setup` gives the report's entry for one (model, platform, TP); the command that writes
the report, and the HBM plan read from it, are `sgl_tpu/bench/lowering.py`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import numpy as np

STEPS = ("extend", "decode", "decode_state")  # the programs with the model's layers
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "collective_permute", "all_to_all")
# custom-call targets that are kernels or partitioner markers, not host work
_KERNEL_CALLS = {
    "tpu": {"tpu_custom_call"},
    "cuda": {"cu_threefry2x32", "cu_threefry2x32_ffi", "__gpu$xla.gpu.triton"},
}
_MARKER_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                 "xla.sdy.FuncResultSharding", "xla.sdy.GlobalToLocalShape",
                 "xla.sdy.LocalToGlobalShape"}
_ATTENTION = {"tpu": "pallas", "cuda": "gathered", "cpu": "ref"}
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "f64": 8, "i32": 4, "i8": 1, "i1": 1, "i64": 8}


# ---- runner config ------------------------------------------------------------------------
def runner_config(cfg, platform: str, tp: int, flags: list[str]):
    """The RunnerConfig a server of `flags` resolves on `platform` (an accelerator: bfloat16,
    the platform's attention, the device-resident decode state, unquantized weights)."""
    from sgl_tpu.cli import parse_args
    from sgl_tpu.executor.registry import runner_config as resolve

    args = parse_args([*flags, "--backend", "jax", "--tp-size", str(tp)])
    rc = resolve(args, cfg.context_len)
    return dataclasses.replace(rc, dtype="bfloat16", attention_backend=_ATTENTION[platform],
                               jax_decode_state=True, quantization="none", kv_cache_dtype="auto")


# ---- abstract arguments -----------------------------------------------------------------------
@dataclasses.dataclass
class LoweredPrograms:
    """The runner's jitted functions and their ShapeDtypeStruct arguments for one setup."""

    calls: dict[str, tuple[Any, tuple, dict]]  # name -> (jitted fn, args, static kwargs)
    shard_config: Any
    num_layers: int
    weights_bytes_per_chip: int
    kv_bytes_per_token_per_chip: int
    kv_pool_bytes_per_chip: int
    buckets: dict[str, Any]
    recompile_free: dict[str, bool]


def _sds(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _per_chip(shape, dtype, spec, tp: int) -> int:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return n // tp if tp > 1 and any(s is not None for s in spec) else n


def build_programs(cfg, rc, mesh, num_layers: int | None = None) -> LoweredPrograms:
    """Every lowered program of a runner of `rc` over `mesh` (None, an AbstractMesh or a
    Mesh), with `num_layers` of the model's layers (None: all)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sgl_tpu.backends.jax import decode_state as jds
    from sgl_tpu.backends.jax import mesh as tp_mesh
    from sgl_tpu.backends.jax.forward_batch import ShapeBuckets, page_buckets, to_forward_batch
    from sgl_tpu.backends.jax.runner import sample_inputs, step_functions
    from sgl_tpu.executor.attention_registry import get_attention_backend
    from sgl_tpu.executor.step import ForwardMode, mask_words, warmup_step
    from sgl_tpu.loader.loaded import expected_param_shapes
    from sgl_tpu.parallel.head_split import check_tp_size

    tp = rc.tp_size
    shard = cfg
    if tp > 1:
        split = check_tp_size(cfg, tp)
        shard = dataclasses.replace(cfg, num_kv_heads=split.num_kv_heads_padded,
                                    intermediate_size=split.intermediate_size_padded,
                                    vocab_size=split.vocab_size_padded)
    if num_layers is not None:
        gemma = shard.gemma and dataclasses.replace(
            shard.gemma, sliding_layers=shard.gemma.sliding_layers[:num_layers])
        shard = dataclasses.replace(shard, num_layers=num_layers, gemma=gemma)

    def sharding(spec):
        return None if mesh is None else NamedSharding(mesh, spec)

    weights = 0

    def param(name, shape):
        nonlocal weights
        dtype = jnp.float32 if name.endswith("norm") or len(shape) == 1 else jnp.bfloat16
        spec = tp_mesh.param_spec(name) if tp > 1 else P()
        weights += _per_chip(shape, dtype, spec, tp)
        return _sds(shape, dtype, sharding(spec))

    top, layer = expected_param_shapes(shard)
    params = {k: param(k, s) for k, s in top.items()}
    params["layers"] = [{k: param(k, s) for k, s in layer.items()} for _ in range(shard.num_layers)]
    pool_shape = (shard.num_kv_heads, rc.num_pages, rc.page_size, shard.head_dim)
    pool_spec = tp_mesh.KV_POOL_SPEC if tp > 1 else P()
    pool = _sds(pool_shape, jnp.bfloat16, sharding(pool_spec))
    kv_pools = [(pool, pool) for _ in range(shard.num_layers)]
    pool_bytes = 2 * shard.num_layers * _per_chip(pool_shape, jnp.bfloat16, pool_spec, tp)
    rep = sharding(P())
    V, W = cfg.vocab_size, mask_words(cfg.vocab_size)
    counts = _sds((rc.max_running_requests + 1, V), jnp.int32, rep)
    width = max(*rc.seq_buckets, rc.max_extend_seqs)
    prev = _sds((width,), jnp.int32, rep)
    pages_per_tile = rc.kv_tile // rc.page_size
    page_widths = (page_buckets(rc.max_pages_per_seq, pages_per_tile)
                   if get_attention_backend(rc.attention_backend).bucket_page_table
                   else (rc.max_pages_per_seq,))
    buckets = ShapeBuckets(
        token_buckets=tuple(rc.token_buckets), seq_buckets=tuple(rc.seq_buckets),
        max_extend_seqs=rc.max_extend_seqs, max_pages=rc.max_pages_per_seq, block_q=rc.block_q,
        vocab_words=W, pages_per_tile=pages_per_tile, page_widths=page_widths)
    shapes = buckets.warmup_shapes()
    ext = max((s for s in shapes if s.mode == ForwardMode.EXTEND),
              key=lambda s: (s.num_tokens, s.max_pages))  # the largest chunk, full width
    dec = max((s for s in shapes if s.mode == ForwardMode.DECODE),
              key=lambda s: (s.num_seqs, s.max_pages))  # the largest batch, full width

    def abstract(tree):
        return jax.tree.map(lambda a: _sds(np.shape(a), np.asarray(a).dtype, rep), tree)

    def batch(shape, steps):
        return to_forward_batch(shape.host_batch(steps, rc.page_size), shape, rc.page_size)

    fb_ext, fb_dec = (abstract(batch(s, [warmup_step()])) for s in (ext, dec))
    # Steps of other requests in the same buckets must give the same argument types (one
    # program per bucket, never one per request).
    recompile_free = {
        name: jax.tree.map(lambda a: (a.shape, a.dtype), abstract(batch(s, _other_requests(s))))
        == jax.tree.map(lambda a: (a.shape, a.dtype), fb)
        for name, s, fb in (("extend", ext, fb_ext), ("decode", dec, fb_dec))}

    jits = step_functions(shard, cfg.vocab_size, rc, mesh)
    S = dec.num_seqs
    state = jds.DecodeStateArrays(**{
        name: _sds(shape, dt, rep) for name, (shape, dt) in {
            "ints": ((S, len(_int_cols())), jnp.int32),
            "floats": ((S, len(_float_cols())), jnp.float32),
            "pages": ((S, rc.max_pages_per_seq), jnp.int32)}.items()})
    logits = {n: _sds((n, V), jnp.float32, rep) for n in (ext.num_seqs, S)}
    hidden = _sds((ext.num_tokens, cfg.hidden_size), jnp.bfloat16, rep)
    calls = {
        "extend": (jits.step, (params, kv_pools, prev, fb_ext), {"mode": ForwardMode.EXTEND}),
        "decode": (jits.step, (params, kv_pools, prev, fb_dec), {"mode": ForwardMode.DECODE}),
        "decode_state": (jits.state_step,
                         (params, kv_pools, counts, prev, state, _sds((S, W), jnp.int32, rep)),
                         {"num_rows": S, "num_pages": dec.max_pages}),
        "sample_extend": (jits.sample, (logits[ext.num_seqs], counts, prev, sample_inputs(fb_ext)),
                          {"reset_rows": True}),
        "sample_decode": (jits.sample, (logits[S], counts, prev, sample_inputs(fb_dec)),
                          {"reset_rows": False}),
        "token_logprobs": (jits.token_logprobs,
                           (params, hidden, _sds((ext.num_tokens,), jnp.int32, rep)), {}),
    }
    kv_per_token = 2 * shard.num_layers * _per_chip((shard.num_kv_heads, shard.head_dim),
                                                     jnp.bfloat16, pool_spec, tp)
    rows = rc.seq_buckets  # the decode state's row buckets (runner: DeviceDecodeState)
    info = {
        "token_buckets": list(rc.token_buckets), "seq_buckets": list(rc.seq_buckets),
        "page_widths": list(page_widths),
        # what warm-up compiles (runner.warmup): steps per bucket, a sampler per (S, mode),
        # state steps per (S, width), row scatters, log-prob entry points per token bucket
        "warmup_programs": {
            "extend": len(rc.token_buckets) * len(page_widths),
            "decode_state": len(rc.seq_buckets) * len(page_widths),
            "sample": 1 if rc.jax_decode_state else 1 + len(rc.seq_buckets),
            "scatter_rows": len(rows) * (2 + len(page_widths)),
            "token_logprobs": len(rc.token_buckets), "row_logits": len(rc.token_buckets)},
    }
    info["warmup_programs"]["total"] = sum(info["warmup_programs"].values())
    return LoweredPrograms(calls, shard, shard.num_layers, weights, kv_per_token, pool_bytes, info,
                    recompile_free)


def _int_cols():
    from sgl_tpu.executor import decode_rows

    return decode_rows.INT_COLUMNS


def _float_cols():
    from sgl_tpu.executor import decode_rows

    return decode_rows.FLOAT_COLUMNS


def _other_requests(shape):
    """A few requests unlike the warm-up's: other lengths, sampling knobs, seeds, a grammar."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    n = 3 if shape.mode == ForwardMode.DECODE else 2
    steps = []
    for i in range(n):
        length = 1 if shape.mode == ForwardMode.DECODE else 5 + 7 * i
        pages = np.arange(1, 3 + i, dtype=np.int64)
        sp = SamplingParams(temperature=0.7 * i, top_p=0.9, top_k=20 + i, max_new_tokens=8)
        mask = np.full(shape.vocab_words, -1, np.int32) if i == 1 else None
        if mask is not None:
            mask[1:] = 0  # a grammar that allows 32 tokens
        steps.append(SeqStep(token_ids=list(range(1, length + 1)), prefix_len=3 * i,
                             pages=pages, sampling=sp, seed=1234 + i, num_output_tokens=i,
                             sample_valid=True, bitmask=mask))
    return steps


# ---- reading a lowered / compiled program ------------------------------------------------------
_HLO_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|"
                     r"collective-permute|all-to-all)(?:-start)?\(")
_HLO_TYPE = re.compile(r"\b(bf16|f16|f32|f64|s8|u8|s32|u32|s64|pred)\[([\d,]*)\]")
_MLIR_COLLECTIVE = re.compile(r"\b(?:stablehlo|mhlo)\.(all_reduce|all_gather|reduce_scatter|"
                              r"collective_permute|all_to_all)\b")
_HOST_TRANSFER = re.compile(r"\bstablehlo\.(?:send|recv)\b")
_CUSTOM_CALL = re.compile(r"custom_call\s*@([\w.$]+)|call_target_name\s*=\s*\"([^\"]+)\"")


def hlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """Collectives of a compiled (SPMD-partitioned) HLO module: count and per-device result
    bytes of each kind."""
    out = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if m is None or "-done(" in line:
            continue
        kind = m.group(2).replace("-", "_")
        nbytes = sum(_DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                     for dt, dims in _HLO_TYPE.findall(m.group(1)))
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
    return out


def stablehlo_findings(text: str, platform: str) -> dict[str, Any]:
    """Custom calls (kernels vs the rest, host callbacks among them) and explicit collectives
    of a lowered module."""
    calls: dict[str, int] = {}
    for a, b in _CUSTOM_CALL.findall(text):
        name = a or b
        calls[name] = calls.get(name, 0) + 1
    explicit = {k: 0 for k in COLLECTIVES}
    for kind in _MLIR_COLLECTIVE.findall(text):
        explicit[kind] += 1
    kernels = _KERNEL_CALLS.get(platform, set())
    callbacks = sorted(c for c in calls if "callback" in c.lower())
    # on a TPU a host callback lowers to send/recv host transfers, not a custom call
    transfers = len(_HOST_TRANSFER.findall(text))
    if transfers:
        callbacks.append(f"{transfers} host send/recv")
    return {"custom_calls": calls, "host_callbacks": callbacks,
            "non_kernel_custom_calls": sorted(c for c in calls
                                              if c not in kernels and c not in _MARKER_CALLS),
            "explicit_collectives": explicit}


def export_program(fn, args: tuple, static: dict, platform: str) -> str:
    """StableHLO text of `fn(*args, **static)` lowered for `platform` by jax.export."""
    from jax import export

    # Host callbacks are not export-safe; let them through so the report names them.
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in
              ("xla_python_cpu_callback", "xla_ffi_python_cpu_callback",
               "xla_python_gpu_callback", "xla_ffi_python_gpu_callback",
               "xla_ffi_partitioned_python_cpu_callback")]
    exp = export.export(fn, platforms=(platform,), disabled_checks=checks)(*args, **static)
    return exp.mlir_module()


def partitioned(cfg, rc, tp: int, names) -> dict[str, dict[str, Any]]:
    """Collectives per layer and per step, and temporary bytes per device, of each program in
    `names`, from XLA:CPU compiles over `tp` host devices (the SPMD partitioner TPUs run too)
    at 1 and 2 layers, scaled to the model's layers."""
    import jax
    from jax.sharding import Mesh

    from sgl_tpu.backends.jax.mesh import TP_AXIS

    mesh = None if tp == 1 else Mesh(np.asarray(jax.devices("cpu")[:tp]), (TP_AXIS,))
    cpu_rc = dataclasses.replace(rc, attention_backend="ref")
    found: dict[int, dict[str, Any]] = {}
    for layers in (1, 2):
        progs = build_programs(cfg, cpu_rc, mesh, num_layers=layers)
        found[layers] = {}
        for name in names:
            if layers == 2 and name not in STEPS:  # no layers in it: the same program
                found[2][name] = found[1][name]
                continue
            fn, args, static = progs.calls[name]
            compiled = fn.trace(*args, **static).lower().compile()
            mem = compiled.memory_analysis()
            found[layers][name] = (hlo_collectives(compiled.as_text()),
                                   getattr(mem, "temp_size_in_bytes", None))
    out = {}
    for name in names:
        (one, temp1), (two, temp2) = found[1][name], found[2][name]
        entry: dict[str, Any] = {}
        for kind in COLLECTIVES:
            per_layer = two[kind]["count"] - one[kind]["count"]
            layer_bytes = two[kind]["bytes"] - one[kind]["bytes"]
            rest = one[kind]["count"] - per_layer
            entry[kind] = {"per_layer": per_layer, "outside_layers": rest,
                           "count": rest + per_layer * cfg.num_layers,
                           "bytes_per_step": one[kind]["bytes"] - layer_bytes
                           + layer_bytes * cfg.num_layers}
        entry["temp_bytes_per_chip"] = max(t for t in (temp1, temp2) if t is not None) \
            if temp1 is not None or temp2 is not None else None
        out[name] = entry
    return out


def lower_setup(cfg, platform: str, tp: int, flags: list[str], collectives: str = "all"
                ) -> dict[str, Any]:
    """The report of one (model, platform, TP): every program lowered, or `error`.
    `collectives`: which programs the partitioned CPU compiles cover: "all", "steps" (the
    STEPS, and only under TP) or "none"."""
    from jax.sharding import AbstractMesh

    from sgl_tpu.backends.jax.mesh import TP_AXIS

    try:
        rc = runner_config(cfg, platform, tp, flags)
        mesh = AbstractMesh((tp,), (TP_AXIS,)) if tp > 1 else None
        progs = build_programs(cfg, rc, mesh)
    except ValueError as e:  # e.g. the head-split rule refuses this TP
        return {"error": str(e)}
    entry: dict[str, Any] = {
        "attention_backend": rc.attention_backend, "num_layers": cfg.num_layers,
        "weights_bytes_per_chip": progs.weights_bytes_per_chip,
        "kv_pool_tokens": (rc.num_pages - 1) * rc.page_size,
        "kv_pool_bytes_per_chip": progs.kv_pool_bytes_per_chip,
        "kv_bytes_per_token_per_chip": progs.kv_bytes_per_token_per_chip,
        "buckets": progs.buckets, "recompile_free": progs.recompile_free, "programs": {}}
    for name, (fn, args, static) in progs.calls.items():
        t0 = time.perf_counter()
        try:
            text = export_program(fn, args, static, platform)
            entry["programs"][name] = {**stablehlo_findings(text, platform),
                                       "stablehlo_bytes": len(text)}
        except Exception as e:  # noqa: BLE001 - any lowering failure is the finding
            entry["programs"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        entry["programs"][name]["lower_s"] = round(time.perf_counter() - t0, 2)
    names = {"all": list(progs.calls), "steps": list(STEPS) if tp > 1 else [],
             "none": []}[collectives]
    if names:
        try:
            for name, found in partitioned(cfg, rc, tp, names).items():
                entry["programs"][name].update(found)
        except Exception as e:  # noqa: BLE001
            entry["partition_error"] = f"{type(e).__name__}: {e}"[:2000]
    acts = [p.get("temp_bytes_per_chip") or 0 for p in entry["programs"].values()]
    entry["largest_activation_bytes_per_chip"] = max(acts)
    return entry
