"""Device-resident batch state of the JAX runner's DECODE steps (`RunnerConfig.jax_decode_state`).

    SeqSteps (n) ──host_rows──► fresh rows ──RowMirror.diff──► changed rows, per matrix,
                                (executor/decode_rows.py)       padded to a row bucket K
                 ──_scatter_rows (jitted, donated)──► ints i32[Bmax, NI] floats f32[Bmax, NF]
                                                      pages i32[Bmax, Pmax]   (device)
    the jitted step (runner._state_step_impl) reads rows [0, S), page columns [0, P) of them
    (`state_forward_batch`), runs the usual step and advances its own rows (`advance_state`)

so an unchanged batch copies nothing host -> device but its grammar masks (when a row has one).

Overlap placeholders (the mirror's bookkeeping: executor/decode_rows.py): a row whose
placeholder names its own row matches the mirror and copies nothing; one that names another row
is copied as is and resolved on the device from the previous step's token ids, as in the
packing path.

Seeds are u32 and travel in the int32 matrix bit for bit (`to_i32`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sgl_tpu.backends.jax.forward_batch import ForwardBatch
from sgl_tpu.backends.jax.sampler import SamplingArrays
from sgl_tpu.executor import decode_rows as dr
from sgl_tpu.executor.step import SeqStep, pick_bucket


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStateArrays:
    ints: jax.Array  # i32[Bmax, NI] decode_rows.INT_COLUMNS
    floats: jax.Array  # f32[Bmax, NF] decode_rows.FLOAT_COLUMNS
    pages: jax.Array  # i32[Bmax, Pmax] page table


def to_i32(a: np.ndarray) -> np.ndarray:
    """int64 rows -> int32, wrapping (a u32 seed keeps its bits; small values are unchanged)."""
    return (np.asarray(a, np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


# ---- device side (traced inside the runner's jitted step) -------------------------------------
def state_forward_batch(state: DecodeStateArrays, bitmask: jax.Array, *, num_rows: int,
                        num_pages: int, page_size: int) -> ForwardBatch:
    """The DECODE ForwardBatch that build_forward_batch would pack, from rows [0, S) and page
    columns [0, P) of the state; bitmask i32[S, W] (all -1 when no row is constrained)."""
    S, ps = num_rows, page_size
    ints = state.ints[:S]  # [S, NI]
    floats = state.floats[:S]  # [S, NF]
    table = state.pages[:S, :num_pages]  # [S, P]
    pos = ints[:, dr.POS]  # [S] cached length = the new token's position
    rows = jnp.arange(S, dtype=jnp.int32)
    out_slots = table[rows, pos // ps] * ps + pos % ps  # padding: page 0, slot 0
    zero1 = jnp.zeros(1, jnp.int32)
    return ForwardBatch(
        input_ids=ints[:, dr.IN], positions=pos, out_slots=out_slots, page_table=table,
        seq_lens=(pos + 1) * ints[:, dr.ACTIVE], sample_idx=rows * ints[:, dr.ACTIVE],
        block_rows=jnp.full((1, 1), S, jnp.int32), block_seq=zero1, block_q_start=zero1,
        item_block=zero1, item_tile=zero1, num_items=jnp.int32(0),
        counts_rows=ints[:, dr.COUNTS_ROW], counts_reset=jnp.zeros(S, jnp.bool_),
        sample_valid=ints[:, dr.VALID] != 0,
        sampling=SamplingArrays(
            temperature=floats[:, dr.TEMP], top_p=floats[:, dr.TOP_P],
            top_k=ints[:, dr.TOP_K], min_p=floats[:, dr.MIN_P],
            frequency_penalty=floats[:, dr.FREQ], presence_penalty=floats[:, dr.PRES],
            repetition_penalty=floats[:, dr.REP],
            seed=lax.bitcast_convert_type(ints[:, dr.SEED], jnp.uint32),
            step=ints[:, dr.STEP], return_logprob=ints[:, dr.RET_LP] != 0),
        vocab_bitmask=bitmask,
    )


def advance_state(state: DecodeStateArrays, token_ids: jax.Array, num_rows: int
                  ) -> DecodeStateArrays:
    """After the step: active rows of [0, S) one token further, input id = token_ids i32[S]."""
    ints = state.ints[:num_rows]
    active = ints[:, dr.ACTIVE]
    ints = ints.at[:, dr.POS].add(active).at[:, dr.STEP].add(active)
    ints = ints.at[:, dr.IN].set(jnp.where(active != 0, token_ids.astype(jnp.int32),
                                           ints[:, dr.IN]))
    return dataclasses.replace(state, ints=state.ints.at[:num_rows].set(ints))


def scatter_rows(buf: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
    """buf[idx[k], :C] = rows[k] for every k (rows [K, C]); idx == len(buf) (padding) drops."""
    cols = jnp.arange(rows.shape[1], dtype=jnp.int32)
    return buf.at[idx[:, None], cols[None, :]].set(rows, mode="drop")


# ---- host side --------------------------------------------------------------------------------
class DeviceDecodeState:
    """The state's device arrays and their host mirror (see the module docstring).

    `scatter(buf, idx, rows) -> buf` is the runner's jitted, donating `scatter_rows`;
    `zeros(shape, dtype)` allocates like the runner's other replicated buffers."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int,
                 row_buckets: Sequence[int], zeros: Callable, scatter: Callable) -> None:
        self.page_size = page_size
        self.row_buckets = tuple(row_buckets)  # K: changed rows are padded to one of these
        self.max_rows = max_rows
        self.arrays = DecodeStateArrays(
            ints=zeros((max_rows, len(dr.INT_COLUMNS)), jnp.int32),
            floats=zeros((max_rows, len(dr.FLOAT_COLUMNS)), jnp.float32),
            pages=zeros((max_rows, max_pages), jnp.int32))
        self.mirror = dr.RowMirror(max_rows, max_pages)
        self._scatter = scatter

    def accepts(self, steps: Sequence[SeqStep]) -> bool:
        return (0 < len(steps) <= self.max_rows
                and all(len(st.token_ids) == 1 and not st.counts_reset for st in steps))

    def sync(self, steps: Sequence[SeqStep], num_rows: int, num_pages: int) -> int:
        """Make rows [0, S), page columns [0, P) hold `steps`: dispatch one scatter per matrix
        with changed rows. Returns the bytes copied host -> device."""
        fresh = dr.host_rows(steps, num_rows, num_pages, self.page_size)
        copied = 0
        new = {}
        for name, (changed, rows) in zip(dr.MATRICES, self.mirror.diff(fresh, num_rows,
                                                                      num_pages), strict=True):
            if changed.size == 0:
                continue
            k = pick_bucket(self.row_buckets, changed.size, "changed rows")
            idx = np.full(k, self.max_rows, np.int32)  # padding: out of range, dropped
            idx[: changed.size] = changed
            padded = np.zeros((k, rows.shape[1]), np.float32 if name == "floats" else np.int32)
            padded[: changed.size] = rows if name == "floats" else to_i32(rows)
            new[name] = self._scatter(getattr(self.arrays, name), idx, padded)
            copied += idx.nbytes + padded.nbytes
        if new:
            self.arrays = dataclasses.replace(self.arrays, **new)
        return copied

    def check(self, steps: Sequence[SeqStep], token_ids: np.ndarray, num_rows: int,
              num_pages: int) -> None:
        """Debug: rows [0, S) on the device after a step equal a recomputation from `steps`
        and the sampled `token_ids` i32[n], and the mirror (its placeholders read as the
        tokens they name); raises RuntimeError."""
        expected = dr.host_rows(steps, num_rows, num_pages, self.page_size)
        dr.advance_rows(expected[0], np.asarray(token_ids, np.int64))
        expected = (to_i32(expected[0]), expected[1], to_i32(expected[2]))
        ints, floats, pages = jax.device_get(
            (self.arrays.ints, self.arrays.floats, self.arrays.pages))
        device = (np.asarray(ints[:num_rows]), np.asarray(floats[:num_rows]),
                  np.asarray(pages[:num_rows, :num_pages]))
        m_ints, m_floats, m_pages = self.mirror.resolved_views(num_rows, num_pages, token_ids)
        dr.check_rows(device, expected, (to_i32(m_ints), m_floats, to_i32(m_pages)))
