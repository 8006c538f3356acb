"""The tests that compare tokens across batches, chunking, cache hits or backends (marker
`isa_invariance`, `make test-isa`) run again as a CPU of a lower ISA would run them:

    ONEDNN_MAX_CPU_ISA=<isa>          oneDNN's kernels capped at that ISA (its environment
                                      knob, read once per process)
    SGL_TPU_CPU_KERNELS=avx2          for the AVX2 case, the AVX2 build of the compiled
                                      kernels (backends/torch/kernels/cpu_extension.py), not the
                                      native one (its quantized GEMM: the vpmaddubsw tiles; the
                                      avx2-vnni build's vpdpbusd tiles give the same bits,
                                      tests/test_quant_gemm_cpu.py, so they need no case here)

    SGL_TPU_TEST_SPECULATIVE=<drafts> the servers' drafts (tests/server_harness.py): forced on
                                      (`SUFFIX`, the drafter `auto` picks, by name: no timing
                                      gate) in the AVX2 and AVX512_CORE_BF16 cases, off (`none`)
                                      in the others. Speculation is lossless, so every token
                                      comparison holds both ways; whether `auto` lets drafts
                                      through depends on the host, so the main run alone would
                                      cover one way only.

Each case is a pytest run in a subprocess (the knobs must be set before torch starts) over the
test files that mention the marker (collecting the whole suite would cost a case ~20 s). One case
per ISA the CPU backend can pick; an ISA this CPU lacks is skipped with the reason, and so is
the CPU's best one, which the main run covers (it runs the same tests uncapped). Every case runs
`test_the_process_runs_the_isa_it_is_set_to`, so a case whose knobs did not take effect fails.

A case runs only the marked tests its knobs can change (`-k`, `_case_tests`):

- never the JAX backend's: no knob reaches XLA:CPU, which compiles for the host's ISA and runs
  its dots without oneDNN (with ONEDNN_VERBOSE=1 a jitted matmul prints no oneDNN line), so
  they would repeat the main run bit for bit;
- AVX512_CORE on a CPU whose best ISA is AVX512_CORE_BF16 (AVX512-BF16, no AMX): only the
  tests that ask for bfloat16. There the cap changes oneDNN's bfloat16 linears alone
  (`brg_matmul:avx512_core_bf16` -> `x64:gemm:jit`, the kernel an AVX-512 CPU without BF16
  runs); its float32 linears stay `brg_matmul:avx512_core` (backends/torch/device.onednn_info
  reports the same kernel capped and not), the compiled kernels stay the native build, and
  `--dtype auto` serves float32 on CPUs without AMX, so the float32 tests would run the main
  run's kernels again. The AVX2 case cannot stand in for it: its bfloat16 linears are torch's
  own, not oneDNN's. What the full AVX512_CORE case would add on such a CPU is the float32
  comparisons with drafts forced off, on the main run's kernels; the main run's servers start
  every batch-size bucket with plain steps (`auto`: drafting must earn its place,
  scheduler/speculative.py). An AVX-512 CPU without BF16 runs AVX512_CORE natively, as its
  best ISA, in its main run; one with AMX (where `auto` serves bfloat16) runs the whole case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import REPO_ROOT

from sgl_tpu.backends.torch.kernels.cpu_extension import KERNELS_ENV, cpu_flags

# oneDNN's name for each ISA, the /proc/cpuinfo flag it needs, lowest first
ISAS = (("AVX2", "avx2"), ("AVX512_CORE", "avx512f"), ("AVX512_CORE_BF16", "avx512_bf16"),
        ("AVX512_CORE_AMX", "amx_bf16"))
# the servers' --speculative-algorithm in each ISA's case: drafts forced on, then off, in turn
DRAFTS = {"AVX2": "SUFFIX", "AVX512_CORE": "none", "AVX512_CORE_BF16": "SUFFIX",
          "AVX512_CORE_AMX": "none"}


def _case_tests(isa: str, best_isa: str | None) -> str:
    """The `-k` expression of the marked tests `isa`'s case runs on a CPU whose best is
    `best_isa` (see the module docstring)."""
    if isa == "AVX512_CORE" and best_isa == "AVX512_CORE_BF16":
        return "not jax and (bfloat16 or the_process_runs_the_isa_it_is_set_to)"
    return "not jax"


def _marked_files() -> list[str]:
    """The test files that mark tests `isa_invariance` (this one only runs them)."""
    here = Path(__file__)
    return sorted(str(f.relative_to(REPO_ROOT)) for f in here.parent.glob("test_*.py")
                  if f != here and "mark.isa_invariance" in f.read_text())


def _best_isa(flags: list[str]) -> str | None:
    return next((isa for isa, flag in reversed(ISAS) if flag in flags), None)


@pytest.mark.slow
@pytest.mark.parametrize("isa, flag", ISAS, ids=[isa for isa, _ in ISAS])
def test_token_comparisons_hold_with_the_cpu_capped_at(isa, flag):
    flags = cpu_flags().split()
    if flag not in flags:
        pytest.skip(f"this CPU lacks {flag}: it cannot run {isa} (best: {_best_isa(flags)})")
    best_isa = _best_isa(flags)
    if isa == best_isa:
        pytest.skip(f"{isa} is this CPU's best ISA: the main run covers it uncapped")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "JAX_PLATFORMS": "cpu",
           "SGL_TPU_TEST_SPECULATIVE": DRAFTS[isa]}
    env.pop(KERNELS_ENV, None)
    if isa == "AVX2":
        env[KERNELS_ENV] = "avx2"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "isa_invariance", "-k", _case_tests(isa, best_isa),
                           *_marked_files()], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    # (no test selected exits 5: a renamed test fails here rather than dropping out)
    assert proc.returncode == 0, (f"under {isa}, drafts {DRAFTS[isa]}:\n{proc.stdout[-6000:]}"
                                  f"\n{proc.stderr[-2000:]}")
    print(f"{isa}, drafts {DRAFTS[isa]}: {proc.stdout.strip().splitlines()[-1]}")
