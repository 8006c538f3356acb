"""`--enable-deterministic-inference`: what changes, on both executors, so that a request's
tokens depend only on the request (its prompt, sampling parameters and seed), never on its batch
mates, on how its prompt was chunked, or on whether its prefix came from the radix cache.

Why outputs moved without it (bfloat16, CPU): a token's hidden state is a chain of reductions,
and the order of each reduction was chosen per call from the shapes of the whole step:

    dense GEMMs       oneDNN / XLA pick another kernel for one row (a GEMV, K split over
                      threads) than for many, and oneDNN's AMX bf16 kernels reduce in an order
                      that depends on the row count; quantized linears switch kernel by row
                      count
    row sums          torch reduces a single row over both threads, many rows one per thread
    attention         EXTEND (flash SDPA, with or without a mask) and DECODE (bf16 GEMMs over
                      a shared + own split of the context) sum scores and values differently,
                      so a token's K/V after a cache hit or a chunk boundary differed from the
                      same token's K/V in one whole prefill; the first token after a cache hit
                      comes from an EXTEND of the suffix, a later one from DECODE

What the flag does (tests/test_determinism.py checks each piece on the machine that runs the
tests, and tests/test_isa.py again under every lower ISA it has):

    fixed-order GEMM  torch on a CPU: every projection, the vocabulary head and both attention
                      products on backends/torch/kernels/invariant_gemm_cpu.py (one FMA chain
                      per output: the same bits for any row count, thread count or x86 ISA),
                      never oneDNN
    rows >= MIN_ROWS  every step runs at least two token rows and two sampled rows (a padding
                      row that writes into reserved page 0), so no norm or row sum ever takes
                      its single-row path (nor, on JAX, a dot: XLA:CPU's per-row results were
                      bit-identical for every M tried above one)
    dense weights     `--quantization auto` resolves to none (the quantized kernels are chosen
                      per row count); an explicit quantization is refused
    one attention     EXTEND and DECODE share one kernel (`torch-invariant`, `ref-invariant`):
                      every query row attends its context in fixed `kv_tile` tiles from
                      position 0, softmax in float32; tiles past a row's causal horizon add
                      exact zeros, so the row's result does not depend on how many rows, tiles
                      or sequences share the step
    eager torch       torch.compile is off (inductor would fuse differently per bucket)

The cost is measured by `python -m sgl_tpu.bench.executor --deterministic`
(docs/determinism.md). Without the flag nothing here is used.

Import-light: no torch, no JAX (the CLI and the config resolution read it).
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_tpu.executor.step import ForwardMode, SeqStep, StepResult, warmup_step

MIN_ROWS = 2  # token rows and sampled rows of every step under the flag

# The attention implementation (executor/attention_registry.py) the flag selects on each executor.
INVARIANT_ATTENTION = {"jax": "ref-invariant", "torch": "torch-invariant"}


def resolve_attention(name: str, backend: str) -> str:
    """`--attention-backend` under the flag: auto -> the executor's invariant kernel; another
    explicit kernel is a ValueError (its EXTEND and DECODE paths differ)."""
    invariant = INVARIANT_ATTENTION[backend]
    if name not in ("auto", invariant):
        raise ValueError(f"--enable-deterministic-inference needs --attention-backend auto or "
                         f"{invariant} on the {backend} executor, got {name!r}")
    return invariant


def row_buckets(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Sequence buckets with every size below MIN_ROWS raised to it (deduplicated, sorted)."""
    return tuple(sorted({max(b, MIN_ROWS) for b in buckets}))


def pad_steps(mode: ForwardMode, steps: Sequence[SeqStep]) -> tuple[list[SeqStep], int]:
    """The step's sequences plus dummy one-token greedy sequences on reserved page 0 (their
    outputs are discarded) up to MIN_ROWS, and the token rows to pack them into (exact: the
    dummies may take an EXTEND one row past the largest token bucket), for runners that do
    not pad to buckets."""
    padded = [*steps, *(warmup_step() for _ in range(MIN_ROWS - len(steps)))]
    if mode == ForwardMode.DECODE:
        return padded, len(padded)
    return padded, sum(len(st.token_ids) for st in padded)


def trim_result(result: StepResult, num_seqs: int) -> StepResult:
    """The rows of the first `num_seqs` sequences (the real ones of a `pad_steps` step; their
    tokens come first in the packed hidden states, which stay whole)."""
    return StepResult(token_ids=result.token_ids[:num_seqs], logprobs=result.logprobs[:num_seqs],
                      top_ids=result.top_ids[:num_seqs],
                      top_logprobs=result.top_logprobs[:num_seqs], hidden=result.hidden)
