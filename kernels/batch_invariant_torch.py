"""Batch-invariant paged attention for the torch backend (`torch-invariant`, selected by
`--enable-deterministic-inference`; see sgl_tpu/executor/batch_invariant.py).

EXTEND and DECODE run one kernel, so a query row's output is a function of its own query and
its context's K/V only: not of the other rows of its step, of how many new tokens its sequence
has this step (chunked prefill), or of whether the context came from the radix cache.

Each query row at position p attends to context positions 0 .. p (the context padded to whole
tiles of `KV_TILE` keys with slot 0, masked by position). Both products run on the
fixed-reduction-order GEMM (backends/torch/kernels/invariant_gemm_cpu.py) on CPUs: oneDNN's bf16
kernels (AMX above all) sum in an order that depends on the row count. Each score is then one
float32 chain over d, each output one chain over the context in position order:

    context   [ tile 0 | tile 1 | tile 2 | pad ]     tiles past a row's horizon are all masked
    scores    s = (q @ K^T) * scale                  float32 [R, L]
    max       m = max(s)                             exact in any order
    weights   p = exp(s - m), l = sum_j sum(p_j)     per tile, tiles summed in order; a masked
                                                     tile adds exactly 0
    output    o = (p @ V) / l                        a masked key adds fma(0, v, acc) = acc

Two passes instead of an online softmax: the running rescale exp(m_old - m_new) is taken on
[rows] tensors whose vector/scalar split depends on the row count, the tile tensors here are
whole multiples of the vector width. EXTEND attends once per sequence ([1, kvh, n * G, d]),
DECODE once for the batch ([B, kvh, G, d]). On other devices the products are torch.matmul in
float32.

The pool layout, K/V write, `ExtendSeq`, `DecodeBatch` and `context_slots` are those of
`paged_attention_torch` (the runner builds the same step description for both).
"""

from __future__ import annotations

import torch

from sgl_tpu.backends.torch.kernels import invariant_gemm_cpu
from sgl_tpu.kernels.paged_attention_torch import (  # noqa: F401  (the backend's interface)
    DecodeBatch,
    ExtendSeq,
    context_slots,
    write_kv,
)

KV_TILE = 128  # keys per tile: a multiple of every CPU vector width (16 floats on AVX-512);
# 128 measured faster than 256 for decode at batch 8-32 and a 512-token prefill (less padding:
# a 257-token context reads 384 keys, not 512), 64 slower at batch 1-8 (more tile passes)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> float32, one fixed-order chain per output on CPUs."""
    if a.device.type == "cpu":
        return invariant_gemm_cpu.matmul(a, b)
    return torch.matmul(a.float(), b.float())


def _attend(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, q_pos: torch.Tensor,
            scale: float, kv_tile: int) -> torch.Tensor:
    """q [B, kvh, R, d] (R = query rows x group heads), k_ctx/v_ctx [B, kvh, L, d] with L a
    multiple of kv_tile, q_pos i64[B, R] each row's position -> [B, kvh, R, d] in q's dtype."""
    length = k_ctx.shape[2]
    s = _matmul(q, k_ctx.transpose(-1, -2)) * scale  # [B, kvh, R, L]
    masked = torch.arange(length, device=q.device)[None, None, None, :] > q_pos[:, None, :, None]
    s.masked_fill_(masked, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [B, kvh, R, L]
    l_sum = None
    for j in range(length // kv_tile):
        tile_sum = p[..., j * kv_tile : (j + 1) * kv_tile].sum(-1)  # [B, kvh, R]
        l_sum = tile_sum if l_sum is None else l_sum + tile_sum
    return (_matmul(p, v_ctx) / l_sum[..., None]).to(q.dtype)


def _gather(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool [num_slots, kvh, d], slots i64[B, L] -> head-major [B, kvh, L, d] (contiguous, the
    same layout on both paths) in the queries' `dtype` (a bfloat16 pool of a float32 model is
    widened)."""
    b, length = slots.shape
    rows = pool.index_select(0, slots.reshape(-1)).view(b, length, *pool.shape[1:])
    return rows.permute(0, 2, 1, 3).to(dtype).contiguous()


def _pad_tiles(slots: torch.Tensor, kv_tile: int) -> torch.Tensor:
    """slots i64[B, L] -> [B, whole tiles], padded with slot 0 (masked by position)."""
    pad = -slots.shape[1] % kv_tile
    return torch.nn.functional.pad(slots, (0, pad)) if pad else slots


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     seqs: list[ExtendSeq], scale: float, kv_tile: int = KV_TILE
                     ) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> [T, H, d] (padding rows zero)."""
    out = torch.zeros_like(q)
    kvh, d = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // kvh
    for s in seqs:
        n = s.num_new
        qs = q[s.start : s.start + n].view(n, kvh, group, d).permute(1, 0, 2, 3)
        qs = qs.reshape(1, kvh, n * group, d).contiguous()  # rows: token-major, then group
        pos = torch.arange(s.prefix_len, s.prefix_len + n, device=q.device)
        q_pos = pos.repeat_interleave(group)[None, :]  # [1, n * G]
        slots = _pad_tiles(s.slots[None, :], kv_tile)
        o = _attend(qs, _gather(k_pool, slots, q.dtype), _gather(v_pool, slots, q.dtype), q_pos,
                    scale, kv_tile)
        out[s.start : s.start + n] = o[0].view(kvh, n, group, d).permute(1, 0, 2, 3).reshape(
            n, kvh * group, d)
    return out


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     batch: DecodeBatch, scale: float, kv_tile: int = KV_TILE
                     ) -> torch.Tensor:
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
    o = _attend(qb, _gather(k_pool, slots, q.dtype), _gather(v_pool, slots, q.dtype), q_pos,
                scale, kv_tile)
    return o.reshape(b, h, d)
