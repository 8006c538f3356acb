"""Paged attention for the PyTorch backend, over a token-major KV pool.

Pool layout (one per layer, K and V separately):

    pool [num_slots, kv_heads, head_dim]     slot = page * page_size + offset; page 0 is reserved

Token-major rows make both the step's KV write (`index_copy_` of T rows) and the gather of a
sequence's context (`index_select` of its slots) contiguous row copies, which is what a CPU
wants; the JAX backend keeps a head-major layout for TPU tiles (see paged_attention_ref.py).

Attention over the gathered context:

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

The pool may be narrower than the queries (bfloat16 under a float32 model,
`--kv-cache-dtype bfloat16`): `write_kv` rounds the new rows to the pool's dtype and the
gathered K/V are widened to the query's dtype before the GEMMs.

Shapes vary with the context, so attention runs eagerly between the compiled dense parts of a
layer (see sgl_tpu/backends/torch/models/llama.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


_E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344: larger values would round to inf


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out_slots: torch.Tensor) -> None:
    """Write the step's K/V rows ([T, kvh, d]) into their slots, in place (rounded to the
    pool's dtype when it is narrower)."""
    _store_rows(k_pool, out_slots, k)
    _store_rows(v_pool, out_slots, v)


def _store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[slots] = rows rounded to the pool's dtype. An fp8 pool (`--kv-cache-dtype
    fp8_e5m2`) saturates at its largest finite value (torch's conversion gives inf) and is
    written through a byte view: index_copy_ has no float8 kernel."""
    if pool.dtype != torch.float8_e5m2:
        pool.index_copy_(0, slots, rows.to(pool.dtype))
        return
    rows = rows.clamp(-_E5M2_MAX, _E5M2_MAX).to(torch.float8_e5m2)
    pool.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     seqs: list[ExtendSeq], scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> attention output [T, H, d] (padding rows zero).

    `sliding_window` W: a query at position p sees keys p - W + 1 .. p (a local layer);
    `logit_cap` c: scores become c * tanh(scores / c) before the mask (Gemma 2)."""
    out = torch.zeros_like(q)
    for s in seqs:
        qs = q[s.start : s.start + s.num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        ks = k_pool.index_select(0, s.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vs = v_pool.index_select(0, s.slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
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
    _, kvh, d = k_pool.shape
    h = q.shape[1]
    eye = _block_eye(kvh, q.dtype, q.device)  # [1, kvh, 1, kvh, 1]
    q_blocks = (q.view(b, kvh, h // kvh, 1, d) * eye).reshape(b, h, -1)
    flat = batch.slots.reshape(-1)
    k = k_pool.index_select(0, flat).to(q.dtype).view(b, l_own, kvh * d)
    v = v_pool.index_select(0, flat).to(q.dtype).view(b, l_own, kvh * d)
    plain = sliding_window is None and logit_cap is None
    if plain:
        s = torch.baddbmm(batch.bias, q_blocks, k.transpose(1, 2))  # [B, H, Lown]
    else:
        s = torch.bmm(q_blocks, k.transpose(1, 2))
    if l_shared:
        k_s = k_pool.index_select(0, batch.shared_slots).to(q.dtype).view(l_shared, kvh * d)
        v_s = v_pool.index_select(0, batch.shared_slots).to(q.dtype).view(l_shared, kvh * d)
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
