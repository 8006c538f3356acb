"""Ragged paged attention as a Pallas TPU kernel, with the reference's call signatures.

`extend_attention` and `decode_attention` take exactly the arguments of their counterparts in
`paged_attention_ref` (plus `interpret`), so the model switches implementation by name only
(see sgl_tpu/executor/attention_registry.py). Both run one kernel, `_attention_kernel`, over a
flat list of work items, each a (query block, KV tile) pair:

    grid = (num_kv_heads, num_items)        num_items is dynamic: no empty grid steps

    item w:  block b = item_block[w]  ──► q block  [G * block_q, d]   (BlockSpec, VMEM)
             tile  j = item_tile[w]   ──► pages page_table[seq(b), j*ppt : (j+1)*ppt]
                                          DMA'd page by page from HBM into a VMEM tile
                                          [kv_tile, d]; item w+1's pages are fetched while
                                          item w computes (two buffers)

Items of one block are consecutive, so the block's online-softmax state (m, l, acc in VMEM
scratch) starts at its first item and is normalised into the output at its last; the output
block stays resident in VMEM while its index does not change, and Pallas writes it back once.

* EXTEND: the host lists the items (`extend_work_items`: each block visits the tiles from its
  sliding-window start to its causal horizon only). Queries are gathered into sequence-aligned
  blocks in the wrapper (`block_rows`, as in the reference) and the output scattered back.
* DECODE: one query per sequence is a block with `block_q = 1`; the items (each sequence's
  tiles up to its length) are listed on the device, so the signature needs no host work.

Rows of a q block are group-major: row `g * block_q + r` is query head `g` of the block's
r-th token, so the GQA group shares each K/V tile and the MXU sees M = G * block_q rows.

Block sizes (all static):

    block_q   query tokens per block (from `block_rows.shape[1]`; ServerArgs `--block-q`).
    kv_tile   KV tokens per DMA'd tile, a multiple of page_size (ServerArgs `--kv-tile`).

Defaults (not measured here: no TPU was available): v5e (4x 128x128 MXUs, 16 MiB scoped VMEM):
block_q = 128, kv_tile = 256. v6e (256x256 MXUs, 32 MiB scoped VMEM): block_q = 128-256,
kv_tile = 512. Per grid step the kernel holds 2 x 2 x kv_tile x d K/V buffers, the q and out
blocks (double-buffered), f32 acc [G*block_q, d] and f32 scores [G*block_q, kv_tile]; with
G = 8, block_q = 256, kv_tile = 512, d = 128 that is about 8 MiB. A smaller kv_tile wastes less
of the last, partly filled tile of every sequence (all pages of a tile are fetched).

KV update (`write_kv`): a second small kernel DMAs each new token's K/V row into its slot; the
pools are aliased input->output (`input_output_aliases`), so under the model step's donation
the pool is updated in place, never copied. (The reference's scatter is also in place under
donation on XLA; the kernel keeps the whole step inside Pallas on TPU.)
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30  # the reference's mask value: identical numerics for fully masked rows
_LANES = 128  # m and l are kept lane-replicated, [M, 128], the layout TPU vregs want


Interpret = Literal["tpu", "hlo"] | None


def interpret_params(interpret: Interpret) -> pltpu.InterpretParams | bool:
    """How `pallas_call` runs the kernel.

    None: compiled by Mosaic (TPU only). "tpu": TPU interpret mode, which simulates HBM, VMEM,
    DMAs and semaphores on CPU and raises on out-of-bounds reads (faithful, slow; the kernel
    tests use it). "hlo": the kernel body discharged into plain XLA ops (DMAs become copies;
    much faster on CPU, less faithful).
    """
    if interpret is None:
        return False
    if interpret == "tpu":
        return pltpu.InterpretParams()
    if interpret == "hlo":
        return True
    raise ValueError(f"interpret must be None, 'tpu' or 'hlo', got {interpret!r}")


# ---- attention kernel ----------------------------------------------------------------------

def _attention_kernel(
    # scalar prefetch (SMEM)
    page_table_ref,  # i32[S * P] flattened page table
    block_seq_ref,  # i32[NB] page-table row of each block
    block_q_start_ref,  # i32[NB] position of each block's first query
    seq_lens_ref,  # i32[S]
    item_block_ref,  # i32[W]
    item_tile_ref,  # i32[W]
    # inputs
    q_ref,  # VMEM [1, 1, M, d] one block of one KV head's query group, M = G * block_q
    k_hbm,  # ANY [kvh, num_pages, page_size, d]
    v_hbm,
    # outputs
    o_ref,  # VMEM [1, 1, M, d]
    # scratch
    k_buf,  # VMEM [2, kv_tile, d] two tiles: the current item's and the next one's
    v_buf,
    sems,  # DMA semaphores [2 (k, v), 2 (buffer)]
    m_ref,  # VMEM f32 [M, 128] running max (lane-replicated)
    l_ref,  # VMEM f32 [M, 128] running sum
    acc_ref,  # VMEM f32 [M, d]
    *,
    block_q: int,
    group: int,
    page_size: int,
    pages_per_tile: int,
    max_pages: int,
    sliding_window: int | None,
    logit_cap: float | None,
):
    h, w = pl.program_id(0), pl.program_id(1)
    num_items = pl.num_programs(1)
    kv_tile = pages_per_tile * page_size

    def tile_copies(item, buf):
        """The DMAs that bring work item `item`'s K/V pages into buffer `buf`."""
        seq = block_seq_ref[item_block_ref[item]]
        first_page = seq * max_pages + item_tile_ref[item] * pages_per_tile
        copies = []
        for i in range(pages_per_tile):
            page = page_table_ref[first_page + i]
            dst = pl.ds(i * page_size, page_size)
            copies.append(pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[buf, dst],
                                                sems.at[0, buf]))
            copies.append(pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[buf, dst],
                                                sems.at[1, buf]))
        return copies

    buf = lax.rem(w, 2)

    @pl.when(w == 0)
    def _():
        for c in tile_copies(w, buf):
            c.start()

    @pl.when(w + 1 < num_items)
    def _():
        for c in tile_copies(w + 1, 1 - buf):
            c.start()

    b = item_block_ref[w]
    j = item_tile_ref[w]
    is_first = (w == 0) | (item_block_ref[jnp.maximum(w - 1, 0)] != b)
    is_last = (w == num_items - 1) | (item_block_ref[jnp.minimum(w + 1, num_items - 1)] != b)

    @pl.when(is_first)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for c in tile_copies(w, buf):
        c.wait()

    q = q_ref[0, 0]  # [M, d], pre-scaled
    k = k_buf[buf]  # [KT, d]
    v = v_buf[buf]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [M, KT]
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)

    kv_len = seq_lens_ref[block_seq_ref[b]]
    q_start = block_q_start_ref[b]
    k_pos = j * kv_tile + lax.broadcasted_iota(jnp.int32, (block_q, kv_tile), 1)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (block_q, kv_tile), 0)
    ok = (k_pos <= q_pos) & (k_pos < kv_len)  # [BQ, KT]
    if sliding_window is not None:
        ok &= k_pos > q_pos - sliding_window
    if block_q == 1:
        s = jnp.where(ok, s, NEG_INF)  # one mask row serves the whole group
    else:
        s = jnp.where(ok[None], s.reshape(group, block_q, kv_tile), NEG_INF)
        s = s.reshape(group * block_q, kv_tile)

    m_prev = m_ref[...]  # [M, 128]
    m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, :1])  # [M, KT]
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
    m_ref[...] = m_next
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [M, d]
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

    @pl.when(is_last)
    def _():
        l_sum = l_ref[...][:, :1]
        safe = jnp.where(l_sum > 0, l_sum, 1.0)
        o_ref[0, 0] = (acc_ref[...] / safe).astype(o_ref.dtype)


def _ragged_attention(
    q_blocks: jax.Array,  # [kvh, NB, G * block_q, d] pre-scaled, group-major rows
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[S, P]
    block_seq: jax.Array,  # i32[NB]
    block_q_start: jax.Array,  # i32[NB]
    seq_lens: jax.Array,  # i32[S]
    item_block: jax.Array,  # i32[W]
    item_tile: jax.Array,  # i32[W]
    num_items: jax.Array,  # i32[]
    *,
    block_q: int,
    kv_tile: int,
    sliding_window: int | None,
    logit_cap: float | None,
    interpret: Interpret,
) -> jax.Array:
    """The pallas_call shared by extend and decode; returns [kvh, NB, G * block_q, d]."""
    kvh, num_blocks, rows, d = q_blocks.shape
    page_size = k_pool.shape[2]
    if kv_tile % page_size:
        raise ValueError(f"kv_tile ({kv_tile}) must be a multiple of page_size ({page_size})")
    max_pages = page_table.shape[1]
    kernel = functools.partial(
        _attention_kernel, block_q=block_q, group=rows // block_q, page_size=page_size,
        pages_per_tile=kv_tile // page_size, max_pages=max_pages,
        sliding_window=sliding_window, logit_cap=logit_cap)

    def q_map(h, w, pt, bseq, bstart, lens, iblock, itile):
        return h, iblock[w], 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(kvh, num_items),
        in_specs=[
            pl.BlockSpec((1, 1, rows, d), q_map),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((1, 1, rows, d), q_map),
        scratch_shapes=[
            pltpu.VMEM((2, kv_tile, d), k_pool.dtype),
            pltpu.VMEM((2, kv_tile, d), v_pool.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((rows, _LANES), jnp.float32),
            pltpu.VMEM((rows, _LANES), jnp.float32),
            pltpu.VMEM((rows, d), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_params(interpret),
        name="ragged_paged_attention",
    )(page_table.reshape(-1), block_seq, block_q_start, seq_lens, item_block, item_tile,
      q_blocks, k_pool, v_pool)


def _scale_and_group(q: jax.Array, kvh: int, scale: float) -> jax.Array:
    """[T, H, d] -> pre-scaled [kvh, G, T, d] (rounded like the reference)."""
    num_tokens, num_heads, d = q.shape
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return q.reshape(num_tokens, kvh, num_heads // kvh, d).transpose(1, 2, 0, 3)


@functools.partial(jax.jit, static_argnames=("kv_tile", "scale", "sliding_window", "logit_cap",
                                             "interpret"))
def extend_attention(
    q: jax.Array,  # [T, H, d] packed query tokens
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[S, P]
    block_rows: jax.Array,  # i32[NB, block_q] packed token of each aligned row; T = padding
    block_seq: jax.Array,  # i32[NB]
    block_q_start: jax.Array,  # i32[NB]
    seq_lens: jax.Array,  # i32[S]
    item_block: jax.Array,  # i32[W] (see `paged_attention_ref.extend_work_items`)
    item_tile: jax.Array,  # i32[W]
    num_items: jax.Array,  # i32[]
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    interpret: Interpret = None,
) -> jax.Array:
    """Causal attention of sequence-aligned query blocks over the paged KV; returns [T, H, d]."""
    num_tokens, num_heads, d = q.shape
    kvh = k_pool.shape[0]
    group = num_heads // kvh
    num_blocks, block_q = block_rows.shape
    qg = _scale_and_group(q, kvh, scale)  # [kvh, G, T, d]
    qg = jnp.concatenate([qg, jnp.zeros((kvh, group, 1, d), q.dtype)], axis=2)  # row T = pad
    q_blocks = qg[:, :, block_rows]  # [kvh, G, NB, BQ, d]
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(kvh, num_blocks, group * block_q, d)
    out = _ragged_attention(
        q_blocks, k_pool, v_pool, page_table, block_seq, block_q_start, seq_lens, item_block,
        item_tile, jnp.asarray(num_items, jnp.int32), block_q=block_q, kv_tile=kv_tile,
        sliding_window=sliding_window, logit_cap=logit_cap, interpret=interpret)
    out = out.reshape(kvh, num_blocks, group, block_q, d).transpose(1, 3, 0, 2, 4)
    out = out.reshape(num_blocks * block_q, num_heads, d)  # [NB * BQ, H, d]
    # Blocks never visited (padding) hold garbage; their rows all point at T and are dropped.
    packed = jnp.zeros((num_tokens + 1, num_heads, d), q.dtype)
    return packed.at[block_rows.reshape(-1)].set(out)[:num_tokens]


def decode_work_items(
    seq_lens: jax.Array,  # i32[B]
    *,
    kv_tile: int,
    max_tiles: int,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """On device: each sequence's KV tiles, sequence by sequence -> item_block, item_tile, n."""
    batch = seq_lens.shape[0]
    last = (seq_lens + kv_tile - 1) // kv_tile  # exclusive; 0 for padding rows
    first = jnp.zeros_like(seq_lens)
    if sliding_window is not None:
        first = jnp.minimum(jnp.maximum(seq_lens - sliding_window, 0) // kv_tile, last)
    count = last - first
    ends = jnp.cumsum(count)
    w = jnp.arange(batch * max_tiles, dtype=jnp.int32)
    item_block = jnp.minimum(jnp.searchsorted(ends, w, side="right"), batch - 1)
    item_block = item_block.astype(jnp.int32)
    item_tile = first[item_block] + w - (ends - count)[item_block]
    return item_block, item_tile.astype(jnp.int32), ends[-1].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("kv_tile", "scale", "sliding_window", "logit_cap",
                                             "interpret"))
def decode_attention(
    q: jax.Array,  # [B, H, d] one query per sequence, at position seq_lens - 1
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,  # i32[B, P]
    seq_lens: jax.Array,  # i32[B]; 0 for padding rows
    *,
    kv_tile: int,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    interpret: Interpret = None,
) -> jax.Array:
    """Attention of each sequence's newest token over its paged KV; returns [B, H, d]."""
    batch, num_heads, d = q.shape
    kvh, page_size = k_pool.shape[0], k_pool.shape[2]
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    q_blocks = _scale_and_group(q, kvh, scale).transpose(0, 2, 1, 3)  # [kvh, B, G, d]
    item_block, item_tile, num_items = decode_work_items(
        seq_lens, kv_tile=kv_tile, max_tiles=page_table.shape[1] * page_size // kv_tile,
        sliding_window=sliding_window)
    out = _ragged_attention(
        q_blocks, k_pool, v_pool, page_table, jnp.arange(batch, dtype=jnp.int32),
        seq_lens - 1, seq_lens, item_block, item_tile, num_items, block_q=1, kv_tile=kv_tile,
        sliding_window=sliding_window, logit_cap=logit_cap, interpret=interpret)
    out = out.transpose(1, 0, 2, 3).reshape(batch, num_heads, d)
    return jnp.where((seq_lens > 0)[:, None, None], out, 0)  # padding rows were never visited


# ---- KV update kernel ----------------------------------------------------------------------

def _write_kv_kernel(slots_ref, k_ref, v_ref, k_pool_in, v_pool_in, k_pool, v_pool, sems, *,
                     page_size: int, block_tokens: int):
    """Copy one block of tokens' K/V rows (all heads) into their slots, in the aliased pools."""
    del k_pool_in, v_pool_in  # the same buffers as k_pool / v_pool (input_output_aliases)
    t0 = pl.program_id(0) * block_tokens

    def copies(t):
        slot = slots_ref[t0 + t]
        page, offset = lax.div(slot, page_size), lax.rem(slot, page_size)  # slots >= 0
        return (
            pltpu.make_async_copy(k_ref.at[:, pl.ds(t, 1)],
                                  k_pool.at[:, page, pl.ds(offset, 1)], sems.at[0]),
            pltpu.make_async_copy(v_ref.at[:, pl.ds(t, 1)],
                                  v_pool.at[:, page, pl.ds(offset, 1)], sems.at[1]),
        )

    def start(t, carry):
        for c in copies(t):
            c.start()
        return carry

    def wait(t, carry):
        for c in copies(t):
            c.wait()
        return carry

    lax.fori_loop(0, block_tokens, start, 0)
    lax.fori_loop(0, block_tokens, wait, 0)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def write_kv(
    k_pool: jax.Array,  # [kvh, num_pages, page_size, d]
    v_pool: jax.Array,
    k: jax.Array,  # [T, kvh, d]
    v: jax.Array,
    slots: jax.Array,  # i32[T]; padding tokens point into reserved page 0
    *,
    block_tokens: int = 64,
    interpret: Interpret = None,
) -> tuple[jax.Array, jax.Array]:
    """Write the step's new K/V rows into their slots; the pools are aliased, never copied.

    `block_tokens` new tokens per grid step (their rows arrive in VMEM by BlockSpec, then each
    token's [kvh, 1, d] row is DMA'd to its page); T is padded up to a multiple of it with
    extra writes of the last token's row to its own slot, so the result is unchanged.
    """
    num_tokens, kvh, d = k.shape
    page_size = k_pool.shape[2]
    block_tokens = min(block_tokens, num_tokens)
    padded = -(-num_tokens // block_tokens) * block_tokens
    idx = jnp.minimum(jnp.arange(padded), num_tokens - 1)
    k_new = k.astype(k_pool.dtype)[idx].transpose(1, 0, 2)  # [kvh, T', d]
    v_new = v.astype(v_pool.dtype)[idx].transpose(1, 0, 2)
    slots = jnp.asarray(slots, jnp.int32)[idx]
    row_spec = pl.BlockSpec((kvh, block_tokens, d), lambda i, slots: (0, i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, page_size=page_size, block_tokens=block_tokens),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // block_tokens,),
            in_specs=[row_spec, row_spec, any_spec, any_spec],
            out_specs=[any_spec, any_spec],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        # operand indices count the scalar-prefetch slots: 0 slots, 1 k, 2 v, 3/4 pools
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
        name="write_kv",
    )(slots, k_new, v_new, k_pool, v_pool)
