"""Fused paged attention for CPUs (`--attention-backend torch-cpu-fused`): the torch backend's
attention as one compiled kernel per step and layer (csrc/paged_attention_cpu.cpp, built at
install time by cpu_extension.py).

Same pool, step description and call signatures as paged_attention_torch (the runner builds
`ExtendSeq` / `DecodeBatch` through whichever module it was given), but no gathered copies of
the context, no zero-padded block matrices and no per-head identity trick: for each KV head the
kernel walks the context's slots, reads each K/V row once for every query row that needs it and
keeps an online softmax in float32.

    EXTEND  per (sequence, KV head, block of <= 128 / G new tokens): all G query heads of the
            group and all tokens of the block against the causal (and windowed) keys
    DECODE  per (KV head, chunk of the shared prefix): the query rows of every sequence, so the
            radix cache's shared pages are read once per step; per (sequence, KV head, chunk
            of its own keys): its G query rows. Chunk partials (max, sum, acc) are merged
            per (sequence, head) in the kernel.

The decode step's own-key range of each row comes from the `bias` the runner builds (0 where a
key is in the context): `own_lo .. own_hi` per sequence, computed once per step in
`DecodeBatch.__post_init__`, not per layer. Sliding windows (Gemma's local layers, Mistral's
window) and Gemma 2's soft-cap are applied inside the kernel. Shapes the kernel does not take
(head_dim not a multiple of 16, other dtypes or devices) run paged_attention_torch instead.
The pools hold q's dtype, or bfloat16 under float32 queries (`--kv-cache-dtype bfloat16`), or
fp8 e5m2 under either (`--kv-cache-dtype fp8_e5m2`): rows are widened to float32 as they are
read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_tpu.backends.torch.kernels import cpu_extension
from sgl_tpu.kernels import paged_attention_torch as sdpa
from sgl_tpu.kernels.paged_attention_torch import (  # noqa: F401  (the backend's interface)
    ExtendSeq,
    context_slots,
    write_kv,
)


@dataclass(frozen=True)
class DecodeBatch(sdpa.DecodeBatch):
    """paged_attention_torch's decode description plus each row's own-key range."""

    own_lo: torch.Tensor = field(init=False)  # i64[B] first own key in the context
    own_hi: torch.Tensor = field(init=False)  # i64[B] one past the last (the query's key)

    def __post_init__(self) -> None:
        valid = self.bias[:, 0, :] == 0  # [B, Lown], a contiguous run of True per row
        idx = torch.arange(1, valid.shape[1] + 1, device=valid.device)
        hi = (valid * idx).amax(-1) if valid.shape[1] else valid.new_zeros(valid.shape[0])
        lo = hi - valid.sum(-1)
        object.__setattr__(self, "own_lo", lo.to(torch.int64).contiguous())
        object.__setattr__(self, "own_hi", hi.to(torch.int64).contiguous())


def _fused(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the compiled kernel takes these shapes (else paged_attention_torch runs)."""
    d, kvh = k_pool.shape[2], k_pool.shape[1]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_pool.dtype in (q.dtype, torch.bfloat16, torch.float8_e5m2)
            and d % 16 == 0 and d <= 512
            and q.shape[1] // kvh <= 128 and q.stride(2) == 1)


def _kernel():
    ext = cpu_extension.load()
    if ext is None:
        raise RuntimeError(f"torch-cpu-fused attention: {cpu_extension.why_unavailable()}")
    return ext


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     seqs: list[ExtendSeq], scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None) -> torch.Tensor:
    """q [T, H, d] packed new tokens -> attention output [T, H, d] (padding rows zero)."""
    if not _fused(q, k_pool):
        return sdpa.extend_attention(q, k_pool, v_pool, seqs, scale, sliding_window, logit_cap)
    return _kernel().extend(
        q, k_pool, v_pool, [s.slots for s in seqs], [s.start for s in seqs],
        [s.num_new for s in seqs], [s.prefix_len for s in seqs], float(scale),
        int(sliding_window or 0), float(logit_cap or 0.0))


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     batch: DecodeBatch, scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None) -> torch.Tensor:
    """q [B, H, d], one token per sequence -> [B, H, d]."""
    if not _fused(q, k_pool):
        return sdpa.decode_attention(q, k_pool, v_pool, batch, scale, sliding_window,
                                     logit_cap)
    return _kernel().decode(q, k_pool, v_pool, batch.shared_slots, batch.slots, batch.own_lo,
                            batch.own_hi, float(scale), int(sliding_window or 0),
                            float(logit_cap or 0.0))
