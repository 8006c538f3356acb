"""RoPE inverse frequencies, shared by the JAX and PyTorch models (numpy only)."""

from __future__ import annotations

import math

import numpy as np

from sgl_tpu.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [d/2], with Llama-3 scaling when configured (computed at trace time)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
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
