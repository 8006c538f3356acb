"""JaxModelRunner (`--backend jax`; the `ModelRunner` contract is in executor/step.py): owns
the device state (weights, paged KV pools, penalty counts) and every jitted entry point. The
scheduler hands it host-side `SeqStep`s; it lays them out at a bucket's sizes (the step
contract's `HostBatch`, converted by `to_forward_batch`), runs the jitted model step, then the
jitted sampler, and returns host numpy results. With
`config.jax_decode_state` (auto: on for accelerators) DECODE steps instead read a batch state
kept on the device, copying only the rows that changed (decode_state.py).

Jitted entry points (all here, compiled per bucket at warm-up):

    _step(params, kv_pools, prev_token_ids, fb; mode)     -> (logits [S, V], hidden, kv_pools)
        donates kv_pools, so the KV write is in place; resolves placeholder input ids (overlap
        scheduling, executor/step.py) from the previous step's token ids, kept on the device
        padded to a fixed width.
    _sample(logits, token_counts, prev_token_ids, cols; reset_rows)
                                  -> (SampleOutput, token_counts, last_token_ids)
        the sampler and the penalty-count update; donates token_counts. Compiled per (S,
        EXTEND or DECODE), not per step bucket: its XLA:CPU compile (~2 s) would otherwise
        repeat in every step variant.
    _state_step(params, kv_pools, token_counts, prev_token_ids, state, bitmask; S, P)
                                  -> (SampleOutput, kv_pools, counts, last_token_ids, state)
        DECODE over the device-resident batch state (`config.jax_decode_state`,
        decode_state.py): the same step and sampler in one program, its ForwardBatch read
        from the state's rows [0, S) and page columns [0, P); the state advanced and donated.
    _scatter_rows(buf, idx, rows)  -> buf      the state's changed rows (K padded), donated
    _token_logprobs(params, hidden, target_ids; T)        -> input log-probs for prompt positions

`num_compilations()` counts XLA compilations of these functions, so tests can assert that mixed
traffic after warm-up compiles nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_tpu.backends.jax import decode_state as jds
from sgl_tpu.backends.jax import kv_pages
from sgl_tpu.backends.jax import mesh as tp_mesh
from sgl_tpu.backends.jax.forward_batch import (
    BatchShape,
    ForwardBatch,
    ShapeBuckets,
    page_buckets,
    to_forward_batch,
)
from sgl_tpu.backends.jax.sampler import sample
from sgl_tpu.backends.jax.shard_ops import replicated, vocab_logits
from sgl_tpu.config import RunnerConfig
from sgl_tpu.executor.attention_registry import get_attention_backend
from sgl_tpu.executor.step import (
    ForwardMode,
    SeqStep,
    StepResult,
    mask_words,
    pack_bitmask,
    warmup_step,
)
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.registry import jax_model
from sgl_tpu.parallel.head_split import check_tp_size
from sgl_tpu.quantization.blocks import quantize_int8

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _logits(params, hidden, cfg: ModelConfig, vocab_size: int, mesh: Mesh | None):
    """hidden [N, D] -> float32 logits [N, V], gathered from the vocab shards under TP."""
    model = jax_model(cfg.arch)
    return vocab_logits(lambda p, h: model.compute_logits(p, h, cfg), params, hidden,
                        vocab_size, mesh)


def _step_impl(params, kv_pools, prev_token_ids, fb: ForwardBatch, *, cfg: ModelConfig,
               mode: ForwardMode, kv_tile: int, attention_backend: str, vocab_size: int,
               mesh: Mesh | None):
    """The model's part of a step -> (logits f32[S, V] of the sampled rows, hidden [T, D],
    kv_pools)."""
    model = jax_model(cfg.arch)
    ids = fb.input_ids  # [T]; placeholder -(i + 1) = the previous step's token of sequence i
    ids = jnp.where(ids < 0, prev_token_ids[jnp.maximum(-ids - 1, 0)], ids)
    fb = dataclasses.replace(fb, input_ids=ids)
    tp = {"mesh": mesh} if mesh is not None else {}
    # Named scopes split a profile of the step into parts (tools/jax_step_profile.py);
    # the model names its layer parts inside "layers".
    with jax.named_scope("layers"):
        hidden, kv_pools = model.forward(params, kv_pools, fb, cfg, mode, kv_tile=kv_tile,
                                         attention_backend=attention_backend, **tp)
    with jax.named_scope("logits"):
        logits = _logits(params, hidden[fb.sample_idx], cfg, vocab_size, mesh)  # [S, V]
    if mesh is not None:
        # Pin the shardings of what comes back in: an input sharding GSPMD chose differently
        # from the allocation's would compile the step (or the sampler) again on its next call.
        logits, hidden = (lax.with_sharding_constraint(a, replicated(mesh))
                          for a in (logits, hidden))
        pool_sharding = NamedSharding(mesh, tp_mesh.KV_POOL_SPEC)
        kv_pools = [tuple(lax.with_sharding_constraint(p, pool_sharding) for p in layer)
                    for layer in kv_pools]
    return logits, hidden, kv_pools


def sample_inputs(fb: ForwardBatch) -> dict:
    """What the sampler reads of a ForwardBatch (all [S]-leading)."""
    return {"counts_rows": fb.counts_rows, "counts_reset": fb.counts_reset,
            "sample_valid": fb.sample_valid, "sampling": fb.sampling,
            "vocab_bitmask": fb.vocab_bitmask}


def _sample_impl(logits, token_counts, prev_token_ids, cols: dict, *, num_top: int,
                 reset_rows: bool, mesh: Mesh | None):
    """logits f32[S, V] -> (SampleOutput, token_counts, last_token_ids i32[L]): penalties,
    grammar mask, sampling, then the penalty counts of the sampled tokens. `reset_rows`
    (EXTEND) clears the counts rows of requests that start here. Depends on S and V only, so
    every step bucket of the same S shares one compiled sampler."""
    with jax.named_scope("sampler"):
        counts = jnp.where(cols["counts_reset"][:, None], 0,
                           token_counts[cols["counts_rows"]])  # [S, V]
        out = sample(logits, cols["sampling"], counts, cols["vocab_bitmask"],
                     num_top_logprobs=num_top)
    with jax.named_scope("penalty_counts"):
        rows = cols["counts_rows"]
        if reset_rows:
            keep = (~cols["counts_reset"]).astype(token_counts.dtype)[:, None]
            token_counts = token_counts.at[rows].multiply(keep)
        token_counts = token_counts.at[rows, out.token_ids].add(
            cols["sample_valid"].astype(token_counts.dtype))
    last_token_ids = jnp.zeros_like(prev_token_ids).at[: out.token_ids.shape[0]].set(
        out.token_ids.astype(prev_token_ids.dtype))  # [L]
    if mesh is not None:
        token_counts, last_token_ids = (lax.with_sharding_constraint(a, replicated(mesh))
                                        for a in (token_counts, last_token_ids))
    return out, token_counts, last_token_ids


def _state_step_impl(params, kv_pools, token_counts, prev_token_ids, state, bitmask, *,
                     num_rows: int, num_pages: int, page_size: int, num_top: int,
                     mesh: Mesh | None, **step_kw):
    """`_step_impl` (DECODE) and `_sample_impl` in one program, over the device-resident state;
    bitmask i32[S, W]."""
    fb = jds.state_forward_batch(state, bitmask, num_rows=num_rows, num_pages=num_pages,
                                 page_size=page_size)
    logits, _, kv_pools = _step_impl(params, kv_pools, prev_token_ids, fb,
                                     mode=ForwardMode.DECODE, mesh=mesh, **step_kw)
    out, token_counts, last_token_ids = _sample_impl(
        logits, token_counts, prev_token_ids, sample_inputs(fb), num_top=num_top,
        reset_rows=False, mesh=mesh)
    state = jds.advance_state(state, out.token_ids, num_rows)
    if mesh is not None:
        state = jax.tree.map(lambda a: lax.with_sharding_constraint(a, replicated(mesh)), state)
    return out, kv_pools, token_counts, last_token_ids, state


def _scatter_rows_impl(buf, idx, rows, *, mesh: Mesh | None):
    buf = jds.scatter_rows(buf, idx, rows)
    return buf if mesh is None else lax.with_sharding_constraint(buf, replicated(mesh))


def _token_logprobs_impl(params, hidden, target_ids, *, cfg: ModelConfig, num_top: int,
                         vocab_size: int, mesh: Mesh | None):
    """hidden [T, D], target_ids [T] -> logprob of each target [T], top-K ids/logprobs [T, K]."""
    logits = _logits(params, hidden, cfg, vocab_size, mesh)
    logp = jax.nn.log_softmax(logits, axis=-1)  # [T, V]
    chosen = jnp.take_along_axis(logp, target_ids[:, None], axis=-1)[:, 0]
    top_lp, top_ids = lax.top_k(logp, num_top) if num_top else (
        jnp.zeros((logp.shape[0], 0), logp.dtype), jnp.zeros((logp.shape[0], 0), jnp.int32))
    return chosen, top_ids.astype(jnp.int32), top_lp


def _row_logits_impl(params, hidden, rows, *, cfg: ModelConfig, vocab_size: int,
                     mesh: Mesh | None):
    """hidden [T, D], rows i32[R] -> float32 logits [R, V] of those rows."""
    return _logits(params, hidden[rows], cfg, vocab_size, mesh)


ROW_LOGITS_BUCKET = 64  # rows per `row_logits` call (one compiled shape per token bucket)


_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def params_to_device(params: dict, dtype, quantization: str = "none",
                     mesh: Mesh | None = None) -> dict:
    """numpy params -> device arrays; norms stay float32, matrices take the compute dtype.
    With `quantization` "int8" the layers' projections become {"q": i8[in, out], "scale":
    f32[out]} (weight-only, one scale per output feature; see backends/jax/models/llama.py
    `matmul`). With a tensor-parallel `mesh` each device receives only its slice
    (backends/jax/mesh.py)."""
    place = tp_mesh.place_param(mesh) if mesh is not None else None

    def put(name: str, a: np.ndarray, dt, spec=None) -> jax.Array:
        if place is None:
            return jnp.asarray(a, dt)
        return place(name, np.asarray(a, dt), spec)

    def conv(name: str, a: np.ndarray):
        if quantization == "int8" and name in _PROJECTIONS:
            m = quantize_int8(np.ascontiguousarray(np.asarray(a, np.float32).T))  # [out, in]
            return {"q": put(name, m.q.T, m.q.dtype),
                    "scale": put(name, m.scale, m.scale.dtype,
                                 tp_mesh.scale_spec(name) if place else None)}
        keep_f32 = name.endswith("norm") or a.ndim == 1
        return put(name, a, jnp.float32 if keep_f32 else dtype)

    return {
        k: ([{n: conv(n, a) for n, a in layer.items()} for layer in v] if k == "layers"
            else conv(k, v))
        for k, v in params.items()
    }


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """The runner's jitted entry points (module docstring), built by `step_functions`; the
    lowering checks (lowering.py) lower these same objects for TPU and CUDA."""

    step: Callable
    sample: Callable
    token_logprobs: Callable
    row_logits: Callable
    state_step: Callable | None  # config.jax_decode_state only
    scatter_rows: Callable | None


def step_functions(shard_config: ModelConfig, vocab_size: int, config: RunnerConfig,
                   mesh: Any) -> StepFunctions:
    """Jit every entry point of a runner of `config` over `mesh` (a Mesh, an AbstractMesh when
    lowering without devices, or None); `shard_config`: the model's sizes as padded for TP."""
    num_top = config.max_top_logprobs
    shared = dict(cfg=shard_config, vocab_size=vocab_size, mesh=mesh)
    step_kw = dict(kv_tile=config.kv_tile, attention_backend=config.attention_backend,
                   **shared)
    step = jax.jit(partial(_step_impl, **step_kw), static_argnames=("mode",),
                   donate_argnames=("kv_pools",))
    # The sampler is its own program: it depends on (S, V) only, so the step buckets of one
    # S share it (XLA:CPU spends ~2 s compiling it, as long as a tiny model's step).
    sample_fn = jax.jit(partial(_sample_impl, num_top=num_top, mesh=mesh),
                        static_argnames=("reset_rows",), donate_argnames=("token_counts",))
    state_step = scatter_rows = None
    if config.jax_decode_state:
        state_step = jax.jit(
            partial(_state_step_impl, page_size=config.page_size, num_top=num_top, **step_kw),
            static_argnames=("num_rows", "num_pages"),
            donate_argnames=("kv_pools", "token_counts", "state"))
        scatter_rows = jax.jit(partial(_scatter_rows_impl, mesh=mesh), donate_argnums=0)
    return StepFunctions(
        step=step, sample=sample_fn,
        token_logprobs=jax.jit(partial(_token_logprobs_impl, num_top=num_top, **shared)),
        row_logits=jax.jit(partial(_row_logits_impl, **shared)),
        state_step=state_step, scatter_rows=scatter_rows)


@dataclasses.dataclass(frozen=True)
class _PendingJaxStep:
    """A dispatched step's device outputs; `result()` copies them to the host."""

    out: object  # sampler.SampleOutput of device arrays, S rows
    hidden: jax.Array | None  # [T, D] (EXTEND)
    num_seqs: int  # n real sequences
    on_tokens: Callable[[np.ndarray], None] | None = None  # told the host's token ids i32[n]

    def result(self) -> StepResult:
        n = self.num_seqs
        token_ids, logprobs, top_ids, top_lp = jax.device_get(
            (self.out.token_ids, self.out.logprobs, self.out.top_ids, self.out.top_logprobs))
        if self.on_tokens is not None:
            self.on_tokens(np.asarray(token_ids[:n]))
        return StepResult(
            token_ids=np.asarray(token_ids[:n]),
            logprobs=np.asarray(logprobs[:n], np.float32),
            top_ids=np.asarray(top_ids[:n]),
            top_logprobs=np.asarray(top_lp[:n], np.float32),
            hidden=self.hidden,
        )


class JaxModelRunner:
    backend = "jax"

    def __init__(self, model_config: ModelConfig, params: dict, config: RunnerConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        self.vocab_size = model_config.vocab_size
        self.vocab_words = mask_words(self.vocab_size)
        # Tensor parallelism: the head rule and the device count are checked before any weight
        # reaches a device; `shard_config` carries the padded sizes the sharded step computes.
        self.mesh, self.shard_config = None, model_config
        if config.tp_size > 1:
            split = check_tp_size(model_config, config.tp_size)
            self.mesh = tp_mesh.make_mesh(config.tp_size)
            params = tp_mesh.pad_params(params, split, model_config.head_dim)
            self.shard_config = dataclasses.replace(
                model_config, num_kv_heads=split.num_kv_heads_padded,
                intermediate_size=split.intermediate_size_padded,
                vocab_size=split.vocab_size_padded)
        self.params = params_to_device(params, self.dtype, config.quantization, self.mesh)
        self.kv_pools = self._alloc_kv_pools()
        # Row 0 is a scratch row for padding sequences; request rows are 1..max_running.
        self.token_counts = self._zeros((config.max_running_requests + 1, self.vocab_size),
                                        jnp.int32, replicated=True)
        # Page-table widths the steps are cut to: one (the full width) unless the attention
        # backend's cost grows with the width (attention.py `bucket_page_table`).
        pages_per_tile = config.kv_tile // config.page_size
        self.page_widths = (page_buckets(config.max_pages_per_seq, pages_per_tile)
                            if get_attention_backend(config.attention_backend).bucket_page_table
                            else (config.max_pages_per_seq,))
        self.buckets = ShapeBuckets(
            token_buckets=tuple(config.token_buckets), seq_buckets=tuple(config.seq_buckets),
            max_extend_seqs=config.max_extend_seqs, max_pages=config.max_pages_per_seq,
            block_q=config.block_q, vocab_words=self.vocab_words, pages_per_tile=pages_per_tile,
            page_widths=self.page_widths)
        # The last step's sampled ids, padded to the widest step (placeholders read them).
        width = max(*config.seq_buckets, config.max_extend_seqs)
        self._last_token_ids = self._zeros((width,), jnp.int32, replicated=True)
        jits = step_functions(self.shard_config, self.vocab_size, config, self.mesh)
        self._step, self._sample = jits.step, jits.sample
        self._token_logprobs, self._row_logits = jits.token_logprobs, jits.row_logits
        self.h2d_bytes = 0  # batch inputs copied host -> device by the steps so far
        self.decode_state: jds.DeviceDecodeState | None = None
        self._state_step, self._scatter_rows = jits.state_step, jits.scatter_rows
        if config.jax_decode_state:
            self.decode_state = jds.DeviceDecodeState(
                max(config.seq_buckets), config.max_pages_per_seq, config.page_size,
                config.seq_buckets, partial(self._zeros, replicated=True), self._scatter_rows)
        self._no_masks: dict[int, jax.Array] = {}  # S -> i32[S, W] of -1 (state steps)

    # ---- device state -------------------------------------------------------------------
    def _zeros(self, shape: tuple[int, ...], dtype, replicated: bool = False) -> jax.Array:
        """Zeros made on the device(s): under TP split like a KV pool, or replicated."""
        if self.mesh is None:
            return jnp.zeros(shape, dtype)
        spec = P() if replicated else tp_mesh.KV_POOL_SPEC
        return jax.jit(partial(jnp.zeros, shape, dtype),
                       out_shardings=NamedSharding(self.mesh, spec))()

    def _alloc_kv_pools(self) -> list:
        c, m = self.config, self.shard_config
        shape = (m.num_kv_heads, c.num_pages, c.page_size, m.head_dim)
        return [(self._zeros(shape, self.dtype), self._zeros(shape, self.dtype))
                for _ in range(m.num_layers)]

    def compute_info(self) -> dict[str, Any]:
        """What `/server_info` reports this runner computes with (XLA picks its own kernels)."""
        return {"backend": "jax", "device": jax.devices()[0].platform,
                "dtype": self.config.dtype, "gemm": "xla"}

    @property
    def kv_bytes(self) -> int:
        """KV pool bytes of the whole model (summed over the TP devices; with replicated KV
        heads each copy counts)."""
        k, _ = self.kv_pools[0]
        return 2 * k.size * k.dtype.itemsize * len(self.kv_pools)

    # ---- KV pages to and from host memory (the lower cache tiers) ------------------------
    def kv_page_layout(self) -> str:
        return kv_pages.page_layout(self.kv_pools)

    def read_kv_pages(self, pages: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return kv_pages.read_pages(self.kv_pools, pages, out)

    def write_kv_pages(self, pages: np.ndarray, rows: np.ndarray) -> None:
        self.kv_pools = kv_pages.write_pages(self.kv_pools, pages, rows)

    def num_compilations(self) -> int:
        """Compiled variants of the jitted entry points so far."""
        return (self._step._cache_size() + self._sample._cache_size()
                + self._token_logprobs._cache_size()
                + self._row_logits._cache_size()
                + sum(f._cache_size() for f in (self._state_step, self._scatter_rows)
                      if f is not None))

    # ---- steps -------------------------------------------------------------------------
    def batch_shape(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> BatchShape:
        return self.buckets.shape_for(mode, steps)

    def _run(self, mode: ForwardMode, steps: Sequence[SeqStep], shape: BatchShape):
        """Pack `steps` to `shape` and dispatch the jitted step; (SampleOutput, hidden) stay on
        the device (JAX dispatch is asynchronous), and so do the step's token ids that the next
        step's placeholders read. DECODE steps the device-resident state accepts run over it
        (`_run_state`). Returns (SampleOutput, hidden, on_tokens for the pending step)."""
        state = self.decode_state
        if state is not None and mode == ForwardMode.DECODE and state.accepts(steps):
            return self._run_state(steps, shape)
        fb = to_forward_batch(shape.host_batch(steps, self.config.page_size), shape,
                              self.config.page_size)
        self.h2d_bytes += sum(np.asarray(a).nbytes for a in jax.tree.leaves(fb))
        logits, hidden, self.kv_pools = self._step(self.params, self.kv_pools,
                                                   self._last_token_ids, fb, mode=mode)
        out, self.token_counts, self._last_token_ids = self._sample(
            logits, self.token_counts, self._last_token_ids, sample_inputs(fb),
            reset_rows=mode == ForwardMode.EXTEND)
        if state is not None:
            state.mirror.dispatched(None)
        return out, hidden, None

    def _run_state(self, steps: Sequence[SeqStep], shape: BatchShape):
        """A DECODE step over the device-resident state: changed rows copied, the jitted step
        reads the rest where it already is (decode_state.py)."""
        state = self.decode_state
        S, P = shape.num_seqs, shape.max_pages
        self.h2d_bytes += state.sync(steps, S, P)
        bitmask = pack_bitmask(steps, S, self.vocab_words)
        if bitmask is not None:
            self.h2d_bytes += bitmask.nbytes
            if self.mesh is not None:  # placed as the maskless steps' mask is (replicated):
                # a host array would key a second compilation of the whole step under a mesh
                bitmask = jax.make_array_from_callback(bitmask.shape, replicated(self.mesh),
                                                       lambda idx, m=bitmask: m[idx])
        else:
            if S not in self._no_masks:
                self._no_masks[S] = self._zeros((S, self.vocab_words), jnp.int32,
                                                replicated=True) - 1
            bitmask = self._no_masks[S]
        out, self.kv_pools, self.token_counts, self._last_token_ids, state.arrays = (
            self._state_step(self.params, self.kv_pools, self.token_counts,
                             self._last_token_ids, state.arrays, bitmask, num_rows=S,
                             num_pages=P))
        serial = state.mirror.dispatched(len(steps))
        if self.config.check_decode_state:
            token_ids = np.asarray(jax.device_get(out.token_ids))[: len(steps)]
            state.check(steps, token_ids, S, P)
        return out, None, partial(state.mirror.resolve, serial)

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        return self.dispatch(mode, steps).result()

    def dispatch(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> _PendingJaxStep:
        """Enqueue the jitted step without waiting for it."""
        out, hidden, on_tokens = self._run(mode, steps, self.batch_shape(mode, steps))
        return _PendingJaxStep(out, hidden if mode == ForwardMode.EXTEND else None, len(steps),
                               on_tokens)

    def token_logprobs(self, hidden: jax.Array, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probs of `target_ids[t]` under the prediction at row t of an EXTEND step's hidden
        states (padded to the step's bucket; callers slice the rows they need)."""
        targets = np.zeros(hidden.shape[0], np.int32)
        targets[: len(target_ids)] = target_ids
        lp, ids, top = jax.device_get(self._token_logprobs(self.params, hidden, targets))
        return np.asarray(lp, np.float32), np.asarray(ids), np.asarray(top, np.float32)

    def row_logits(self, hidden: jax.Array, rows: np.ndarray) -> np.ndarray:
        """Full logits [len(rows), V] at selected rows of an EXTEND step's hidden states."""
        out = []
        for start in range(0, len(rows), ROW_LOGITS_BUCKET):
            chunk = rows[start : start + ROW_LOGITS_BUCKET]
            padded = np.zeros(ROW_LOGITS_BUCKET, np.int32)
            padded[: len(chunk)] = chunk
            out.append(np.asarray(self._row_logits(self.params, hidden, padded))[: len(chunk)])
        return np.concatenate(out)

    def hidden_rows(self, hidden: jax.Array, rows: np.ndarray) -> np.ndarray:
        """Float32 hidden states [len(rows), D] at selected rows of an EXTEND step's hidden
        states: a host copy of this process's replica (nothing compiled; under tensor
        parallelism the hidden states are replicated)."""
        local = np.asarray(hidden.addressable_data(0))  # [T, D]
        return local[np.asarray(rows, np.int64)].astype(np.float32)

    # ---- warm-up -----------------------------------------------------------------------
    def _warmup_scatters(self) -> None:
        """Compile the state's row scatters: every row bucket K for ints and floats, every
        (K, page width) for pages; their rows all padding, so the state is unchanged."""
        state = self.decode_state
        arrays = dataclasses.asdict(state.arrays)
        for k in state.row_buckets:
            idx = np.full(k, state.max_rows, np.int32)
            widths = {"ints": [arrays["ints"].shape[1]], "floats": [arrays["floats"].shape[1]],
                      "pages": sorted({min(w, self.config.max_pages_per_seq)
                                       for w in self.page_widths})}
            for name, ws in widths.items():
                for w in ws:
                    rows = np.zeros((k, w), arrays[name].dtype)
                    arrays[name] = self._scatter_rows(arrays[name], idx, rows)
        state.arrays = jds.DecodeStateArrays(**arrays)

    def warmup(self) -> float:
        """Compile every shape the scheduler can send (`warmup_shapes`: each EXTEND token bucket
        and DECODE sequence bucket at each page-table width), plus the log-prob entry points per
        token bucket, by running a dummy sequence that writes only into page 0."""
        t0 = time.perf_counter()
        steps = [warmup_step()]  # one sequence fits every shape; the rest is padding
        logprob_buckets = set()
        for shape in self.buckets.warmup_shapes():
            _, hidden, _ = self._run(shape.mode, steps, shape)
            if shape.mode == ForwardMode.EXTEND and shape.num_tokens not in logprob_buckets:
                logprob_buckets.add(shape.num_tokens)
                self._token_logprobs(self.params, hidden, np.zeros(shape.num_tokens, np.int32))
                self.row_logits(hidden, np.zeros(1, np.int32))
        if self.decode_state is not None:
            self._warmup_scatters()
        jax.block_until_ready(self.kv_pools)
        elapsed = time.perf_counter() - t0
        logger.info("warm-up compiled %d step variants (%d page-table widths) in %.1f s",
                    self.num_compilations(), len(self.page_widths), elapsed)
        return elapsed
