"""RoPE inverse frequencies, shared by the JAX and PyTorch models (numpy only)."""

from __future__ import annotations

import math

import numpy as np

from sgl_tpu.models.config import LongRope, ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [d/2], with Llama-3 scaling when configured (computed at trace time)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.long_rope is not None:  # the short-context frequencies; see `long_inv_freq`
        return (inv_freq / np.asarray(cfg.long_rope.short_factor)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def gemma_inv_freqs(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(global, local) inverse frequencies [d/2] of a Gemma model: global layers use
    `rope_theta` (with any Llama-3 scaling), local layers `gemma.rope_local_theta`, unscaled."""
    d = cfg.head_dim
    local = 1.0 / (cfg.gemma.rope_local_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    return rope_inv_freq(cfg), local.astype(np.float32)


def long_inv_freq(short_inv_freq: np.ndarray, long_rope: LongRope) -> np.ndarray:
    """LongRoPE frequencies for positions past the pretrained context, from the short ones.

    HF switches the whole sequence to the long factors once it is longer than the pretrained
    context; here the choice is per position, so a cached prefix's K never depends on what
    follows it (the radix cache reuses it under any continuation). Both agree within the
    pretrained context."""
    ratio = np.asarray(long_rope.short_factor, np.float64) / np.asarray(long_rope.long_factor)
    return (short_inv_freq * ratio).astype(np.float32)
