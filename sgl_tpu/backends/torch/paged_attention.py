"""Paged attention for the PyTorch backend, over a token-major KV pool: the implementations of
the registry's torch names, over one pool layout and one step description (`ExtendSeq`,
`DecodeBatch`, `context_slots`, `write_kv`). sgl_tpu/backends/torch/attention.py bundles each
name's functions into the `AttentionBackend` the runner calls.

    torch-sdpa       gathered pages into `scaled_dot_product_attention` / batched GEMMs (any
                     device): `extend_attention`, `decode_attention`
    torch-cpu-fused  one compiled kernel per step and layer (CPU; kernels/csrc/
                     paged_attention_cpu.cpp, built at install time by
                     backends/torch/kernels/cpu_extension.py), torch-sdpa for the shapes it does
                     not take: `fused_extend_attention`, `fused_decode_attention`
    torch-invariant  batch-invariant attention (`--enable-deterministic-inference`): one tiled
                     path for EXTEND and DECODE: `invariant_extend_attention`,
                     `invariant_decode_attention`

Pool layout (one per layer, K and V separately):

    pool [num_slots, kv_heads, head_dim]     slot = page * page_size + offset; page 0 is reserved

Token-major rows make both the step's KV write (`index_copy_` of T rows) and the gather of a
sequence's context (`index_select` of its slots) contiguous row copies, which is what a CPU
wants; the JAX backend keeps a head-major layout for TPU tiles (see kernels/paged_attention_ref.py).

torch-sdpa, attention over the gathered context:

    EXTEND  `scaled_dot_product_attention` (flash kernel; grouped-query heads via `enable_gqa`)
            per sequence: q [1, H, n, d] against its prefix + new keys [1, kvh, L, d], causal
            with the query block offset by the cached prefix (explicit mask when the prefix is
            not empty, `is_causal` otherwise)
    DECODE  matmuls against the context as it lies in the pool, rows of [kvh * d] (no
            transpose copy): each query head is placed in the block of its KV head of a zero
            [kvh * d] row, so q' [B, H, kvh * d] @ K^T gives exactly the per-head scores
            (kvh x the FLOPs of a grouped matmul, which are tiny, for no K/V copies), and
            P @ V gives [B, H, kvh * d] whose diagonal blocks are the outputs. Softmax in
            float32 over both parts of the context:
              shared  the pages every sequence of the batch has in common (the radix cache
                      gives agents of one system prompt the same pages): gathered once, one
                      GEMM for all B*H query rows; their K/V are read once per step, not B times
              own     the rest of each sequence, gathered to [B, Lown, kvh * d], masked by length
            Decode attention is bound by K/V bytes read; for 8 agents with a 1,200-token shared
            prompt and ~300 own tokens each this reads ~4x fewer. On CPU the matmul form was
            ~6x faster than SDPA in bfloat16 (whose flash kernel tiles the query axis, 1 here)
            and ~2x faster than a grouped matmul over transposed K.

The pool may be narrower than the queries (`--kv-cache-dtype`): `write_kv` stores the new rows
in the pool's element type and the gathered K/V are widened to the query's dtype before the
GEMMs (kv_pool.py's `store_rows` / `load_rows`).

Shapes vary with the context, so attention runs eagerly between the compiled dense parts of a
layer (see sgl_tpu/backends/torch/models/llama.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sgl_tpu.backends.torch.kernels import cpu_extension, invariant_gemm_cpu
from sgl_tpu.backends.torch.kv_pool import head_row, load_rows, store_rows


@dataclass(frozen=True)
class ExtendSeq:
    """One sequence of an EXTEND step, as host ints plus its context's slot ids."""

    start: int  # first row of its new tokens in the packed token axis
    num_new: int  # n new tokens this step
    prefix_len: int  # tokens already in the pool before this step
    slots: torch.Tensor  # i64[prefix_len + n] pool slots of positions 0 .. prefix_len + n - 1


@dataclass(frozen=True)
class DecodeBatch:
    """Gather indices of a DECODE step: one query per sequence."""

    shared_slots: torch.Tensor  # i64[Ls] context every sequence has, positions 0 .. Ls-1
    slots: torch.Tensor  # i64[B, Lown] the rest of each context; padding points at slot 0
    # [B, 1, Lown] in the queries' (compute) dtype: 0 where the key is part of the context,
    # -inf elsewhere (added to the scores by the score GEMM itself)
    bias: torch.Tensor


# Keys per DECODE chunk of the compiled kernel (kChunk in kernels/csrc/paged_attention_cpu.cpp,
# its `decode_chunk_keys`). A decode step's shared prefix is a whole number of them, so a row's
# context is read in the same chunks whether or not it is shared (the kernel's batch invariance).
DECODE_CHUNK_KEYS = 256


def shared_align_pages(page_size: int) -> int:
    """Pages per step of a decode batch's shared prefix: whole DECODE_CHUNK_KEYS chunks."""
    return math.lcm(DECODE_CHUNK_KEYS, page_size) // page_size


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out_slots: torch.Tensor) -> None:
    """Write the step's K/V rows ([T, kvh, d]) into their slots, in place, in the pool's
    element type (kv_pool.store_rows)."""
    store_rows(k_pool, out_slots, k)
    store_rows(v_pool, out_slots, v)


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     seqs: list[ExtendSeq], scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> attention output [T, H, d] (padding rows zero).

    `sliding_window` W: a query at position p sees keys p - W + 1 .. p (a local layer);
    `logit_cap` c: scores become c * tanh(scores / c) before the mask (Gemma 2)."""
    out = torch.zeros_like(q)
    for s in seqs:
        qs = q[s.start : s.start + s.num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        ks = load_rows(k_pool, s.slots, q.dtype).transpose(0, 1).unsqueeze(0)
        vs = load_rows(v_pool, s.slots, q.dtype).transpose(0, 1).unsqueeze(0)
        # ks, vs: [1, kvh, L, d] in q's dtype
        if sliding_window is not None or logit_cap is not None:
            o = _masked_attention(qs, ks, vs, s.prefix_len, scale, sliding_window, logit_cap)
        elif s.prefix_len == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            q_pos = torch.arange(s.prefix_len, s.prefix_len + s.num_new, device=q.device)
            k_pos = torch.arange(s.prefix_len + s.num_new, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [n, L]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[s.start : s.start + s.num_new] = o[0].transpose(0, 1)
    return out


def _masked_attention(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, prefix_len: int,
                      scale: float, sliding_window: int | None, logit_cap: float | None
                      ) -> torch.Tensor:
    """Causal attention of one sequence's new tokens with a sliding window and/or soft-capped
    scores. qs [1, H, n, d], ks/vs [1, kvh, L, d] -> [1, H, n, d].

    With a window only, SDPA takes the boolean mask; soft-capping needs the scores, so that
    path writes the attention out (GQA by repeating K/V heads)."""
    n, length = qs.shape[2], ks.shape[2]
    q_pos = torch.arange(prefix_len, prefix_len + n, device=qs.device)[:, None]  # [n, 1]
    k_pos = torch.arange(length, device=qs.device)[None, :]  # [1, L]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if logit_cap is None:
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = qs.shape[1] // ks.shape[1]
    ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
    s = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale  # [1, H, n, L]
    s = torch.tanh(s / logit_cap) * logit_cap
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(p.to(vs.dtype), vs)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     batch: DecodeBatch, scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None) -> torch.Tensor:
    """q [B, H, d], one token per sequence -> [B, H, d].

    A sliding window masks the keys more than W - 1 positions behind each query (their K/V
    stay in the pool and are still gathered); `logit_cap` soft-caps the scaled scores before
    the context mask is applied."""
    b, l_own = batch.slots.shape
    l_shared = batch.shared_slots.shape[0]
    _, h, d = q.shape
    kvh = k_pool.shape[1]
    eye = _block_eye(kvh, q.dtype, q.device)  # [1, kvh, 1, kvh, 1]
    q_blocks = (q.view(b, kvh, h // kvh, 1, d) * eye).reshape(b, h, -1)
    flat = batch.slots.reshape(-1)
    k = load_rows(k_pool, flat, q.dtype).view(b, l_own, kvh * d)
    v = load_rows(v_pool, flat, q.dtype).view(b, l_own, kvh * d)
    plain = sliding_window is None and logit_cap is None
    if plain:
        s = torch.baddbmm(batch.bias, q_blocks, k.transpose(1, 2))  # [B, H, Lown]
    else:
        s = torch.bmm(q_blocks, k.transpose(1, 2))
    if l_shared:
        k_s = load_rows(k_pool, batch.shared_slots, q.dtype).view(l_shared, kvh * d)
        v_s = load_rows(v_pool, batch.shared_slots, q.dtype).view(l_shared, kvh * d)
        s_shared = torch.mm(q_blocks.view(b * h, -1), k_s.t()).view(b, h, l_shared)
        s = torch.cat([s_shared, s], dim=-1)  # [B, H, Ls + Lown]
    if plain:
        p = torch.softmax(s.float() * scale, dim=-1).to(v.dtype)
    else:
        p = torch.softmax(_windowed_scores(s.float() * scale, batch, l_shared, sliding_window,
                                           logit_cap), dim=-1).to(v.dtype)
    r = torch.bmm(p[:, :, l_shared:], v)  # [B, H, kvh * d]
    if l_shared:
        r = r + torch.mm(p[:, :, :l_shared].reshape(b * h, l_shared), v_s).view(b, h, -1)
    r = r.view(b, kvh, h // kvh, kvh, d)  # the diagonal blocks are the outputs
    return torch.diagonal(r, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, h, d)


def _windowed_scores(s: torch.Tensor, batch: DecodeBatch, l_shared: int,
                     sliding_window: int | None, logit_cap: float | None) -> torch.Tensor:
    """Scaled scores s f32[B, H, Ls + Lown] -> soft-capped and masked (context length and
    sliding window). Key j lies at position j; the query at the context's last position."""
    if logit_cap is not None:
        s = torch.tanh(s / logit_cap) * logit_cap
    own_ok = batch.bias[:, 0, :] == 0  # [B, Lown]
    ok = torch.cat([own_ok.new_ones(own_ok.shape[0], l_shared), own_ok], dim=-1)
    if sliding_window is not None:
        k_pos = torch.arange(ok.shape[1], device=s.device)[None, :]  # [1, L]
        q_pos = l_shared + own_ok.sum(-1, keepdim=True) - 1  # [B, 1]
        ok &= k_pos > q_pos - sliding_window
    return s.masked_fill(~ok[:, None, :], float("-inf"))


@functools.cache
def _block_eye(kvh: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The identity that places each query head in its KV head's block, [1, kvh, 1, kvh, 1];
    made once per (kvh, dtype, device), not per layer and step."""
    return torch.eye(kvh, dtype=dtype, device=device).view(1, kvh, 1, kvh, 1)


def context_slots(pages, page_size: int, length: int) -> torch.Tensor:
    """Slots of positions 0 .. length-1 of a sequence whose page ids are `pages`; i64[length]."""
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:length]


# torch-cpu-fused: the attention as one compiled kernel per step and layer.
#
# Same pool, step description and call signatures as torch-sdpa (the runner builds `ExtendSeq`
# / `FusedDecodeBatch` through the AttentionBackend it was given), but no gathered copies of
# the context, no zero-padded block matrices and no per-head identity trick: for each KV head the
# kernel walks the context's slots, reads each K/V row once for every query row that needs it and
# keeps an online softmax in float32.
#
#     EXTEND  per (sequence, KV head, block of <= 128 / G new tokens): all G query heads of the
#             group and all tokens of the block against the causal (and windowed) keys
#     DECODE  per (KV head, chunk of the shared prefix): the query rows of every sequence, so the
#             radix cache's shared pages are read once per step; per (sequence, KV head, chunk
#             of its own keys): its G query rows. Chunk partials (max, sum, acc) are merged
#             per (sequence, head) in the kernel.
#
# The decode step's own-key range of each row comes from the `bias` the runner builds (0 where a
# key is in the context): `own_lo .. own_hi` per sequence, computed once per step in
# `FusedDecodeBatch.__post_init__`, not per layer. Sliding windows (Gemma's local layers, Mistral's
# window) and Gemma 2's soft-cap are applied inside the kernel. Shapes the kernel does not take
# (head_dim not a multiple of 16, other dtypes or devices) run torch-sdpa instead.
# The pools hold q's dtype, or bfloat16 under float32 queries (`--kv-cache-dtype bfloat16`), or
# fp8 e5m2 or int8 head rows under either (`--kv-cache-dtype fp8_e5m2` / `int8`): rows are
# widened to float32 (int8 ones times their scale) as they are read.


@dataclass(frozen=True)
class FusedDecodeBatch(DecodeBatch):
    """The decode description plus each row's own-key range."""

    own_lo: torch.Tensor = field(init=False)  # i64[B] first own key in the context
    own_hi: torch.Tensor = field(init=False)  # i64[B] one past the last (the query's key)

    def __post_init__(self) -> None:
        valid = self.bias[:, 0, :] == 0  # [B, Lown], a contiguous run of True per row
        idx = torch.arange(1, valid.shape[1] + 1, device=valid.device)
        hi = (valid * idx).amax(-1) if valid.shape[1] else valid.new_zeros(valid.shape[0])
        lo = hi - valid.sum(-1)
        object.__setattr__(self, "own_lo", lo.to(torch.int64).contiguous())
        object.__setattr__(self, "own_hi", hi.to(torch.int64).contiguous())


def fused_takes(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these shapes (else torch-sdpa runs)."""
    d, kvh = q.shape[2], k_pool.shape[1]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_pool.dtype in (q.dtype, torch.bfloat16, torch.float8_e5m2, torch.int8)
            and k_pool.shape[2] == head_row(k_pool, d) and d % 16 == 0 and d <= 512
            and q.shape[1] // kvh <= 128 and q.stride(2) == 1)


def _fused_kernel():
    ext = cpu_extension.load()
    if ext is None:
        raise RuntimeError(f"torch-cpu-fused attention: {cpu_extension.why_unavailable()}")
    return ext


def fused_extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           seqs: list[ExtendSeq], scale: float,
                           sliding_window: int | None = None,
                           logit_cap: float | None = None, bf16_dots: bool = False
                           ) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> attention output [T, H, d] (padding rows zero).
    `bf16_dots`: over a bfloat16 pool, on a CPU with AVX512-BF16, the row-tiled items take
    their products in bfloat16 pairs (queries and probabilities rounded; sums in float32)."""
    if not fused_takes(q, k_pool):
        return extend_attention(q, k_pool, v_pool, seqs, scale, sliding_window, logit_cap)
    return _fused_kernel().extend(
        q, k_pool, v_pool, [s.slots for s in seqs], [s.start for s in seqs],
        [s.num_new for s in seqs], [s.prefix_len for s in seqs], float(scale),
        int(sliding_window or 0), float(logit_cap or 0.0), bf16_dots)


def fused_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           batch: FusedDecodeBatch, scale: float,
                           sliding_window: int | None = None,
                           logit_cap: float | None = None, bf16_dots: bool = False
                           ) -> torch.Tensor:
    """q [B, H, d], one token per sequence -> [B, H, d] (`bf16_dots` as for EXTEND)."""
    if not fused_takes(q, k_pool):
        return decode_attention(q, k_pool, v_pool, batch, scale, sliding_window, logit_cap)
    return _fused_kernel().decode(q, k_pool, v_pool, batch.shared_slots, batch.slots,
                                  batch.own_lo, batch.own_hi, float(scale),
                                  int(sliding_window or 0), float(logit_cap or 0.0), bf16_dots)


# torch-invariant: batch-invariant attention (`--enable-deterministic-inference`; see
# sgl_tpu/executor/batch_invariant.py).
#
# EXTEND and DECODE run one kernel, so a query row's output is a function of its own query and
# its context's K/V only: not of the other rows of its step, of how many new tokens its sequence
# has this step (chunked prefill), or of whether the context came from the radix cache.
#
# Each query row at position p attends to context positions 0 .. p (the context padded to whole
# tiles of `INVARIANT_KV_TILE` keys with slot 0, masked by position). Both products run on the
# fixed-reduction-order GEMM (backends/torch/kernels/invariant_gemm_cpu.py) on CPUs: oneDNN's bf16
# kernels (AMX above all) sum in an order that depends on the row count. Each score is then one
# float32 chain over d, each output one chain over the context in position order:
#
#     context   [ tile 0 | tile 1 | tile 2 | pad ]     tiles past a row's horizon are all masked
#     scores    s = (q @ K^T) * scale                  float32 [R, L]
#     max       m = max(s)                             exact in any order
#     weights   p = exp(s - m), l = sum_j sum(p_j)     per tile, tiles summed in order; a masked
#                                                      tile adds exactly 0
#     output    o = (p @ V) / l                        a masked key adds fma(0, v, acc) = acc
#
# Two passes instead of an online softmax: the running rescale exp(m_old - m_new) is taken on
# [rows] tensors whose vector/scalar split depends on the row count, the tile tensors here are
# whole multiples of the vector width. EXTEND attends once per sequence ([1, kvh, n * G, d]),
# DECODE once for the batch ([B, kvh, G, d]). On other devices the products are torch.matmul in
# float32.
#
# The pool layout, K/V write and step description are torch-sdpa's.

# keys per tile: a multiple of every CPU vector width (16 floats on AVX-512); 128 measured faster
# than 256 for decode at batch 8-32 and a 512-token prefill (less padding: a 257-token context
# reads 384 keys, not 512), 64 slower at batch 1-8 (more tile passes)
INVARIANT_KV_TILE = 128


def _invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> float32, one fixed-order chain per output on CPUs."""
    if a.device.type == "cpu":
        return invariant_gemm_cpu.matmul(a, b)
    return torch.matmul(a.float(), b.float())


def _invariant_attend(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                      q_pos: torch.Tensor, scale: float, kv_tile: int) -> torch.Tensor:
    """q [B, kvh, R, d] (R = query rows x group heads), k_ctx/v_ctx [B, kvh, L, d] with L a
    multiple of kv_tile, q_pos i64[B, R] each row's position -> [B, kvh, R, d] in q's dtype."""
    length = k_ctx.shape[2]
    s = _invariant_matmul(q, k_ctx.transpose(-1, -2)) * scale  # [B, kvh, R, L]
    masked = torch.arange(length, device=q.device)[None, None, None, :] > q_pos[:, None, :, None]
    s.masked_fill_(masked, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [B, kvh, R, L]
    l_sum = None
    for j in range(length // kv_tile):
        tile_sum = p[..., j * kv_tile : (j + 1) * kv_tile].sum(-1)  # [B, kvh, R]
        l_sum = tile_sum if l_sum is None else l_sum + tile_sum
    return (_invariant_matmul(p, v_ctx) / l_sum[..., None]).to(q.dtype)


def _gather_heads(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool [num_slots, kvh, d], slots i64[B, L] -> head-major [B, kvh, L, d] (contiguous, the
    same layout on both paths) in the queries' `dtype` (a bfloat16 pool of a float32 model is
    widened)."""
    b, length = slots.shape
    rows = load_rows(pool, slots.reshape(-1), dtype)
    rows = rows.view(b, length, *rows.shape[1:])
    return rows.permute(0, 2, 1, 3).contiguous()


def _pad_tiles(slots: torch.Tensor, kv_tile: int) -> torch.Tensor:
    """slots i64[B, L] -> [B, whole tiles], padded with slot 0 (masked by position)."""
    pad = -slots.shape[1] % kv_tile
    return torch.nn.functional.pad(slots, (0, pad)) if pad else slots


def invariant_extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               seqs: list[ExtendSeq], scale: float,
                               kv_tile: int = INVARIANT_KV_TILE) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> [T, H, d] (padding rows zero)."""
    out = torch.zeros_like(q)
    kvh, d = k_pool.shape[1], q.shape[2]
    group = q.shape[1] // kvh
    for s in seqs:
        n = s.num_new
        qs = q[s.start : s.start + n].view(n, kvh, group, d).permute(1, 0, 2, 3)
        qs = qs.reshape(1, kvh, n * group, d).contiguous()  # rows: token-major, then group
        pos = torch.arange(s.prefix_len, s.prefix_len + n, device=q.device)
        q_pos = pos.repeat_interleave(group)[None, :]  # [1, n * G]
        slots = _pad_tiles(s.slots[None, :], kv_tile)
        o = _invariant_attend(qs, _gather_heads(k_pool, slots, q.dtype),
                              _gather_heads(v_pool, slots, q.dtype), q_pos, scale, kv_tile)
        out[s.start : s.start + n] = o[0].view(kvh, n, group, d).permute(1, 0, 2, 3).reshape(
            n, kvh * group, d)
    return out


def invariant_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               batch: DecodeBatch, scale: float,
                               kv_tile: int = INVARIANT_KV_TILE) -> torch.Tensor:
    """q [B, H, d], one token per sequence -> [B, H, d]. The shared + own split of the
    runner's `DecodeBatch` is joined back into each row's whole context (positions 0 ..
    len - 1 in order), so the row attends exactly as in an EXTEND."""
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    group = h // kvh
    own_len = (batch.bias[:, 0, :] == 0).sum(-1)  # [B]
    l_shared = batch.shared_slots.shape[0]
    slots = torch.cat([batch.shared_slots.expand(b, l_shared), batch.slots], dim=1)
    slots = _pad_tiles(slots, kv_tile)
    q_pos = (l_shared + own_len - 1)[:, None].expand(b, group)  # [B, G]
    qb = q.view(b, kvh, group, d).contiguous()
    o = _invariant_attend(qb, _gather_heads(k_pool, slots, q.dtype),
                          _gather_heads(v_pool, slots, q.dtype), q_pos, scale, kv_tile)
    return o.reshape(b, h, d)
