"""`SeqStep` <-> `messages.SeqStepMsg`, and numpy arrays <-> the bytes that carry them.

A follower rebuilds exactly the `SeqStep`s the leader's scheduler passed to its runner. The
runner reads only the sampling knobs in `RUNNER_SAMPLING_FIELDS` of a step's `SamplingParams`
(`step.sampling_columns`); stop strings, grammars and token limits stay with the scheduler, so
they do not travel and the follower's copies keep their defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from sgl_tpu.executor.step import SeqStep
from sgl_tpu.messages import SeqStepMsg
from sgl_tpu.sampling_params import SamplingParams

RUNNER_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                          "presence_penalty", "repetition_penalty")
_WIRE_INT = np.dtype("<i8")
_WIRE_MASK = np.dtype("<i4")


def ints_to_bytes(a: Sequence[int] | np.ndarray) -> bytes:
    return np.ascontiguousarray(a, _WIRE_INT).tobytes()


def ints_from_bytes(b: bytes) -> np.ndarray:
    """i64[n], writable (torch refuses to wrap read-only buffers)."""
    return np.frombuffer(b, _WIRE_INT).copy()


@lru_cache(maxsize=1024)
def _sampling(knobs: tuple[float, ...]) -> SamplingParams:
    values = dict(zip(RUNNER_SAMPLING_FIELDS, knobs, strict=True))
    values["top_k"] = int(values["top_k"])
    return SamplingParams(**values)


def step_to_msg(st: SeqStep) -> SeqStepMsg:
    sp = st.sampling
    return SeqStepMsg(
        token_ids=ints_to_bytes(st.token_ids), prefix_len=int(st.prefix_len),
        pages=ints_to_bytes(st.pages),
        sampling=[float(getattr(sp, f)) for f in RUNNER_SAMPLING_FIELDS],
        seed=int(st.seed), num_output_tokens=int(st.num_output_tokens),
        counts_row=int(st.counts_row), counts_reset=bool(st.counts_reset),
        sample_valid=bool(st.sample_valid),
        bitmask=None if st.bitmask is None
        else np.ascontiguousarray(st.bitmask, _WIRE_MASK).tobytes(),
        return_logprob=bool(st.return_logprob))


def step_from_msg(m: SeqStepMsg) -> SeqStep:
    return SeqStep(
        token_ids=ints_from_bytes(m.token_ids), prefix_len=m.prefix_len,
        pages=ints_from_bytes(m.pages), sampling=_sampling(tuple(m.sampling)), seed=m.seed,
        num_output_tokens=m.num_output_tokens, counts_row=m.counts_row,
        counts_reset=m.counts_reset, sample_valid=m.sample_valid,
        bitmask=None if m.bitmask is None else np.frombuffer(m.bitmask, _WIRE_MASK).copy(),
        return_logprob=m.return_logprob)
