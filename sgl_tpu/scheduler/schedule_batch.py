"""Host-side description of one scheduled step, handed from the scheduler to the model runner.

The scheduler (no JAX) produces `ForwardMode` + `list[SeqStep]`; `executor.forward_batch`
pads them into the device-side `ForwardBatch`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sgl_tpu.sampling_params import SamplingParams


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens (possibly after a cached prefix, possibly a chunk)
    DECODE = 2  # one new token per running sequence


@dataclass
class SeqStep:
    """One sequence's share of a step."""

    token_ids: Sequence[int] | np.ndarray  # tokens to run now
    prefix_len: int  # tokens of this sequence already in the KV pool
    pages: Sequence[int] | np.ndarray  # page ids covering [0, prefix_len + len(token_ids))
    sampling: SamplingParams
    seed: int  # resolved per-request seed
    num_output_tokens: int  # index of the token sampled this step (its `step` in the RNG)
    counts_row: int = 0
    counts_reset: bool = False
    sample_valid: bool = True  # False for a non-final prefill chunk
    bitmask: np.ndarray | None = None  # i32[ceil(V/32)]
