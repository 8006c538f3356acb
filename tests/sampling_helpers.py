"""Test-side helpers for the samplers: sampling arrays from parameter objects, packed masks.

(Production code packs sampling inputs with `sgl_tpu.executor.step.sampling_columns` and masks
come from the grammar backends; these build the same layouts directly for sampler tests.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from sgl_tpu.backends.jax.sampler import SamplingArrays
from sgl_tpu.executor.step import MASK_BITS_PER_WORD


class SamplingParamsLike(Protocol):
    """The host-side fields `build_sampling_arrays` reads (any object with these attributes)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    seed: int | None


def build_sampling_arrays(
    params: Sequence[SamplingParamsLike],
    padded_batch: int,
    steps: Sequence[int] | None = None,
) -> SamplingArrays:
    """Pack per-request parameters into a padded SamplingArrays (one `device_put`).

    `steps[i]` is the number of output tokens request i already has (default 0). Rows past
    `len(params)` are greedy padding. Seeds are taken modulo 2**32; the scheduler must give
    requests without a user seed a random one at admission, so `seed=None` is rejected.
    """
    n = len(params)
    if padded_batch < n:
        raise ValueError(f"padded_batch={padded_batch} < number of requests {n}")
    if steps is not None and len(steps) != n:
        raise ValueError(f"got {len(steps)} steps for {n} requests")
    temperature = np.zeros(padded_batch, np.float32)
    top_p = np.ones(padded_batch, np.float32)
    top_k = np.full(padded_batch, -1, np.int32)
    min_p = np.zeros(padded_batch, np.float32)
    frequency_penalty = np.zeros(padded_batch, np.float32)
    presence_penalty = np.zeros(padded_batch, np.float32)
    repetition_penalty = np.ones(padded_batch, np.float32)
    seed = np.zeros(padded_batch, np.uint32)
    step = np.zeros(padded_batch, np.int32)
    for i, p in enumerate(params):
        _validate(p, i)
        temperature[i] = p.temperature
        top_p[i] = p.top_p
        top_k[i] = p.top_k if p.top_k > 0 else -1
        min_p[i] = p.min_p
        frequency_penalty[i] = p.frequency_penalty
        presence_penalty[i] = p.presence_penalty
        repetition_penalty[i] = p.repetition_penalty
        seed[i] = p.seed % (1 << 32)
        step[i] = 0 if steps is None else steps[i]
    arrays = SamplingArrays(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        seed=seed,
        step=step,
    )
    return jax.device_put(arrays)


def _validate(p: SamplingParamsLike, i: int) -> None:
    if not p.temperature >= 0.0:
        raise ValueError(f"request {i}: temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"request {i}: top_p must be in (0, 1], got {p.top_p}")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"request {i}: min_p must be in [0, 1], got {p.min_p}")
    if not p.repetition_penalty > 0.0:
        raise ValueError(f"request {i}: repetition_penalty must be > 0, got {p.repetition_penalty}")
    if p.seed is None:
        raise ValueError(f"request {i}: seed is None; assign a random seed at admission")


def full_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """All-allowed packed vocab mask, i32[batch, ceil(vocab_size / 32)] of -1."""
    return np.full((batch, -(-vocab_size // MASK_BITS_PER_WORD)), -1, np.int32)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """Pack bool[B, V] into i32[B, ceil(V/32)]; bit j of word w is token 32*w + j.

    Bits past V are set, as xgrammar and llguidance leave them.
    """
    batch, vocab_size = allowed.shape
    num_words = -(-vocab_size // MASK_BITS_PER_WORD)
    bits = np.ones((batch, num_words * MASK_BITS_PER_WORD), np.uint64)
    bits[:, :vocab_size] = allowed
    bits = bits.reshape(batch, num_words, MASK_BITS_PER_WORD)  # [B, W, 32]
    words = (bits << np.arange(MASK_BITS_PER_WORD, dtype=np.uint64)).sum(-1)  # [B, W]
    return words.astype(np.uint32).view(np.int32)
