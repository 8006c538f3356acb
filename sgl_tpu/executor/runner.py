"""The model-runner interface both executor backends implement, and the backend choice.

    Scheduler ──(ForwardMode, list[SeqStep])──► ModelRunner.forward ──► StepResult (numpy)
                                       │
                  --backend jax  ──────┤ executor/model_runner.py  (XLA: TPU, GPU, CPU)
                  --backend torch ─────┘ executor/torch_runner.py  (PyTorch: tpu, cuda, cpu)

Everything above the runner (scheduler, radix cache, grammar, detokenizer, servers) is shared.
A runner owns the device state (weights, paged KV pool, penalty counts), pads steps to the same
shape buckets (`RunnerConfig.token_buckets` / `seq_buckets`) and samples with the same rules.
`StepResult.hidden` is backend-owned: the scheduler only hands it back to `token_logprobs` /
`row_logits` of the runner that produced it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sgl_tpu.config import BACKENDS, RunnerConfig
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.scheduler.schedule_batch import ForwardMode, SeqStep

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class StepResult:
    """Host copies of one step's outputs, one row per real sequence."""

    token_ids: np.ndarray  # i32[n]
    logprobs: np.ndarray  # f32[n]
    top_ids: np.ndarray  # i32[n, K]
    top_logprobs: np.ndarray  # f32[n, K]
    hidden: Any  # [T, D] device array of the backend (EXTEND only), for input log-probs


class ModelRunner(Protocol):
    config: RunnerConfig
    model_config: ModelConfig
    backend: str  # "jax" or "torch"

    @property
    def kv_bytes(self) -> int: ...

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        """Run one step (write K/V, attend, sample one token per sequence)."""

    def token_logprobs(self, hidden: Any, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probs of target_ids[t] under row t of an EXTEND step's hidden states, with the
        top-K ids/log-probs of each row (rows padded to the step's bucket)."""

    def row_logits(self, hidden: Any, rows: np.ndarray) -> np.ndarray:
        """Float32 logits [len(rows), V] at the given rows of an EXTEND step's hidden states."""

    def warmup(self) -> float:
        """Compile every shape bucket; returns seconds spent."""

    def num_compilations(self) -> int:
        """Compiled step variants so far (tests assert it stays fixed after warm-up)."""


def resolve_backend(backend: str) -> str:
    """`auto` -> the backend measured faster here: torch on CPU when it is installed (bf16
    matmuls on AVX-512/AMX; XLA:CPU is several times slower), jax on TPU and GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    import jax

    if jax.default_backend() == "cpu" and importlib.util.find_spec("torch") is not None:
        return "torch"
    return "jax"


def create_model_runner(backend: str, model_config: ModelConfig, params: dict,
                        config: RunnerConfig) -> ModelRunner:
    """Build the runner of a resolved backend ("jax" or "torch")."""
    if backend == "torch":
        if importlib.util.find_spec("torch") is None:
            raise ValueError("--backend torch needs PyTorch: pip install 'sgl-tpu[torch]'")
        from sgl_tpu.executor.torch_runner import TorchModelRunner

        return TorchModelRunner(model_config, params, config)
    if backend == "jax":
        from sgl_tpu.executor.model_runner import JaxModelRunner

        return JaxModelRunner(model_config, params, config)
    raise ValueError(f"unknown backend {backend!r}")
