"""The JAX device mesh of tensor parallelism (`--tp-size`), and how the weights lie on it.

    --tp-size N ──make_mesh──► Mesh(devices[:N], ("tp",))   (every process's devices, in
                                                              jax.devices() order)
    numpy params ──pad_params (host; head_split rule)──► padded numpy params
                 ──params_to_device(place=place_param(mesh))──► arrays sharded by PARAM_SPECS

One mesh axis, `tp`. Weights follow Megatron-style 1-D tensor parallelism:

    column-parallel  wq wk wv w_gate w_up [in, out]  split on out  -> heads / MLP columns
                     bq bk bv [out]                  split with their matrix
    row-parallel     wo w_down [in, out]             split on in   -> partial sums, all-reduced
    vocab-parallel   embed [V, D] on V, lm_head [D, V] on V        -> logits gathered before
                                                                    the sampler
    replicated       norms (attn_norm, mlp_norm, final_norm, q_norm, k_norm)

so a layer costs two all-reduces of its [T, D] activations (after wo and after w_down). The
KV pools [kvh, pages, page_size, d] are split on kvh (`KV_POOL_SPEC`), one slice per device,
allocated there (never gathered on a host). Int8 weights ({"q": [in, out], "scale": [out]})
split `q` like the float matrix and `scale` with its out axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_tpu.parallel.head_split import HeadSplit

TP_AXIS = "tp"

_COLUMN = P(None, TP_AXIS)
_ROW = P(TP_AXIS, None)
PARAM_SPECS: dict[str, P] = {
    "embed": _ROW,  # [V, D] vocab-parallel
    "lm_head": _COLUMN,  # [D, V] vocab-parallel
    "final_norm": P(),
    "attn_norm": P(),
    "mlp_norm": P(),
    "q_norm": P(),  # [d], shared by every head
    "k_norm": P(),
    "wq": _COLUMN,
    "wk": _COLUMN,
    "wv": _COLUMN,
    "bq": P(TP_AXIS),
    "bk": P(TP_AXIS),
    "bv": P(TP_AXIS),
    "w_gate": _COLUMN,
    "w_up": _COLUMN,
    "wo": _ROW,
    "w_down": _ROW,
}
# [kvh, num_pages, page_size, d] split on kvh. Written without trailing Nones: that is how a
# jitted step reports its outputs' sharding, and a pool allocated as P("tp", None, None, None)
# would differ from the step's returned one in the jit cache key (one more compilation).
KV_POOL_SPEC = P(TP_AXIS)
HEADS_SPEC = P(None, TP_AXIS, None)  # [T, heads, d]


def make_mesh(tp: int) -> Mesh:
    """A one-axis mesh over the first `tp` devices JAX sees (all processes' devices after
    `jax.distributed.initialize`); ValueError when there are fewer."""
    devices = jax.devices()
    if tp > len(devices):
        platform = devices[0].platform
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
                if platform == "cpu" else "")
        raise ValueError(f"--tp-size {tp} needs {tp} devices, but JAX sees {len(devices)} "
                         f"{platform} device(s){hint}")
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(f"--tp-size {tp} with --nnodes {jax.process_count()} must span every "
                         f"device of every host ({len(devices)})")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def param_spec(name: str) -> P:
    spec = PARAM_SPECS.get(name)
    if spec is None:
        raise ValueError(f"no tensor-parallel sharding is defined for weight {name!r}")
    return spec


def place_param(mesh: Mesh) -> Callable[[str, np.ndarray], jax.Array]:
    """A `place(name, host_array)` for `params_to_device`: each device receives only its slice
    (`make_array_from_callback` reads the slices from the host copy every process holds)."""

    def place(name: str, a: np.ndarray, spec: P | None = None) -> jax.Array:
        sharding = NamedSharding(mesh, spec if spec is not None else param_spec(name))
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    return place


def scale_spec(name: str) -> P:
    """Spec of an int8 weight's per-output-feature scale: its matrix's out axis."""
    return P(param_spec(name)[1])


def _pad_axis(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths)


def _repeat_heads(a: np.ndarray, head_dim: int, copies: int) -> np.ndarray:
    """[..., kvh * d] -> [..., kvh * copies * d], each head repeated in place ([h0 h0 h1 h1])."""
    lead = a.shape[:-1]
    heads = a.reshape(*lead, -1, head_dim)
    return np.repeat(heads, copies, axis=-2).reshape(*lead, -1)


def pad_params(params: dict, split: HeadSplit, head_dim: int) -> dict:
    """Host params padded to the split's stored sizes (see head_split): KV projections with each
    head repeated `kv_replication` times, MLP and vocabulary with zero columns/rows."""
    inter, vocab, copies = (split.intermediate_size_padded, split.vocab_size_padded,
                            split.kv_replication)

    def layer(lp: dict) -> dict:
        out = dict(lp)
        for name in ("wk", "wv", "bk", "bv"):
            if name in out and copies > 1:
                out[name] = _repeat_heads(out[name], head_dim, copies)
        out["w_gate"] = _pad_axis(lp["w_gate"], 1, inter)
        out["w_up"] = _pad_axis(lp["w_up"], 1, inter)
        out["w_down"] = _pad_axis(lp["w_down"], 0, inter)
        return out

    padded = {k: v for k, v in params.items() if k != "layers"}
    padded["embed"] = _pad_axis(params["embed"], 0, vocab)
    if "lm_head" in params:
        padded["lm_head"] = _pad_axis(params["lm_head"], 1, vocab)
    padded["layers"] = [layer(lp) for lp in params["layers"]]
    return padded
