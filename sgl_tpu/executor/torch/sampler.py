"""Token sampler of the PyTorch backend: the semantics of `sgl_tpu.executor.jax.sampler` in torch.

    logits f32[B, V] ──┬─> raw log-softmax ─> chosen log-prob, top-K log-probs
                       └─> penalties (counts) -> vocab bitmask -> greedy argmax
                           -> temperature -> top-k -> top-p -> min-p -> inverse-CDF draw

Same rules as the JAX sampler: a row is greedy when its temperature is below
`GREEDY_TEMPERATURE_EPS`, its top_k is 1 or its mask leaves nothing; truncation keeps every
token whose scaled logit reaches the row's threshold (top-k, then top-p over the renormalized
top-k set, then min-p relative to the top token); the draw uses one uniform per row that depends
only on (seed, step) (`row_uniforms`), so a seeded request reproduces in any batch. The uniform
comes from a different generator than JAX's, so the two backends draw different (equally
distributed) samples for the same seed.

Thresholds come from the top `num_candidates` logits of each row; rows whose top-k or nucleus
does not fit in them are redone over a full sort.
"""

from __future__ import annotations

import numpy as np
import torch

from sgl_tpu.executor.step import GREEDY_TEMPERATURE_EPS

DEFAULT_NUM_CANDIDATES = 128
_BITS_PER_WORD = 32
_MASK64 = (1 << 64) - 1


def row_uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """f32[B] in [0, 1): a splitmix64 hash of (seed, step), so row i depends only on its own."""
    z = (seeds.astype(np.uint64) << np.uint64(32)) | steps.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """i32[B, W] packed allowed tokens (bit j of word w = token 32w + j) -> bool[B, V]."""
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def sample(
    logits: torch.Tensor,  # f32[B, V]
    *,
    temperature: torch.Tensor,  # f32[B]
    top_p: torch.Tensor,  # f32[B]
    top_k: torch.Tensor,  # i64[B]; <= 0 off
    min_p: torch.Tensor,  # f32[B]
    uniforms: torch.Tensor,  # f32[B]
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    bitmask: torch.Tensor | None,  # i32[B, W]
    num_top_logprobs: int,
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> token_ids i64[B], logprobs f32[B], top_ids i64[B, K], top_logprobs f32[B, K].

    `penalties` = (counts i32[B, V], frequency f32[B], presence f32[B], repetition f32[B]).
    Log-probs are of the raw logits.
    """
    raw = logits.float()
    lse = torch.logsumexp(raw, dim=-1)  # [B]
    x, fully_masked = raw, torch.zeros_like(lse, dtype=torch.bool)
    if penalties is not None:
        counts, freq, pres, rep = penalties
        c = counts.float()
        seen = c > 0
        x = torch.where(seen, torch.where(x > 0, x / rep[:, None], x * rep[:, None]), x)
        x = x - freq[:, None] * c - pres[:, None] * seen.float()
    if bitmask is not None:
        masked = x.masked_fill(~unpack_bitmask(bitmask, raw.shape[1]), -torch.inf)
        fully_masked = torch.isneginf(masked.max(dim=-1).values)
        x = torch.where(fully_masked[:, None], raw, masked)

    greedy = (temperature < GREEDY_TEMPERATURE_EPS) | (top_k == 1) | fully_masked
    token_ids = x.argmax(dim=-1)
    rows = (~greedy).nonzero().flatten()
    if rows.numel():
        token_ids[rows] = _sample_rows(x[rows], temperature[rows], top_p[rows], top_k[rows],
                                       min_p[rows], uniforms[rows], num_candidates)

    logprobs = raw.gather(1, token_ids[:, None])[:, 0] - lse
    top_lp, top_ids = torch.topk(raw, num_top_logprobs, dim=-1)
    return token_ids, logprobs, top_ids, top_lp - lse[:, None]


def _sample_rows(x, temperature, top_p, top_k, min_p, u, num_candidates: int) -> torch.Tensor:
    """Draw one token per row of x [R, V] (all rows sample); i64[R]."""
    vocab_size = x.shape[1]
    scaled = x / temperature[:, None]  # [R, V]
    row_max = scaled.max(dim=-1).values  # [R]
    weights = (scaled - row_max[:, None]).exp()  # [R, V]; the top token weighs 1
    threshold = torch.full_like(row_max, -torch.inf)

    k_on = (top_k > 0) & (top_k < vocab_size)
    p_on = top_p < 1.0
    if bool((k_on | p_on).any()):
        thr, ok = _top_k_top_p_threshold(scaled, weights, row_max, top_k, top_p, k_on, p_on,
                                         min(num_candidates, vocab_size))
        if not bool(ok.all()):
            full, _ = _top_k_top_p_threshold(scaled, weights, row_max, top_k, top_p, k_on, p_on,
                                             vocab_size)
            thr = torch.where(ok, thr, full)
        threshold = thr
    min_p_thr = torch.where(min_p > 0, row_max + torch.log(min_p.clamp_min(1e-30)), -torch.inf)
    threshold = torch.maximum(threshold, min_p_thr)

    kept = torch.where(scaled >= threshold[:, None], weights, 0.0)  # [R, V]
    cum = kept.cumsum(dim=-1)
    target = u * cum[:, -1]
    idx = torch.searchsorted(cum, target[:, None], right=True)[:, 0]  # first cum > target
    iota = torch.arange(vocab_size, device=x.device)
    last_positive = torch.where(kept > 0, iota, 0).max(dim=-1).values
    return torch.minimum(idx, last_positive)


def _top_k_top_p_threshold(scaled, weights, row_max, top_k, top_p, k_on, p_on,
                           num_cand: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept scaled logit per row from the top `num_cand` candidates, and whether the
    candidates sufficed (top-k within them, nucleus reached within them)."""
    cand = torch.topk(scaled, num_cand, dim=-1).values  # [R, C] descending
    cand_w = (cand - row_max[:, None]).exp()
    k_fits = k_on & (top_k <= num_cand)
    k_idx = (top_k - 1).clamp(0, num_cand - 1)
    top_k_thr = torch.where(k_fits, cand.gather(1, k_idx[:, None])[:, 0], -torch.inf)
    cum = torch.where(cand >= top_k_thr[:, None], cand_w, 0.0).cumsum(dim=-1)  # [R, C]
    mass = torch.where(k_fits, cum[:, -1], weights.sum(dim=-1))
    reached = cum >= (top_p * mass)[:, None]
    found = reached.any(dim=-1)
    first = reached.int().argmax(dim=-1)
    top_p_thr = torch.where(p_on & found, cand.gather(1, first[:, None])[:, 0], -torch.inf)
    ok = (~k_on | k_fits) & (~p_on | found)
    return torch.maximum(top_k_thr, top_p_thr), ok
