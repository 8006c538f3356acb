"""The tests that compare tokens across batches, chunking, cache hits or backends (marker
`isa_invariance`, `make test-isa`) run again as a CPU of a lower ISA would run them:

    ONEDNN_MAX_CPU_ISA=<isa>          oneDNN's kernels capped at that ISA (its environment
                                      knob, read once per process)
    SGL_TPU_CPU_KERNELS=avx2          for the AVX2 case, the AVX2 build of the compiled
                                      kernels (backends/torch/kernels/cpu_extension.py), not the
                                      native one; a second AVX2 case takes avx2-vnni (the
                                      AVX2 + AVX-VNNI host class's quantized GEMM) with drafts
                                      off

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
the CPU's best one, which the main run covers (it runs the same tests uncapped). The marked
set includes `test_the_process_runs_the_isa_it_is_set_to`, so a case whose knobs did not take
effect fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import REPO_ROOT

from sgl_tpu.backends.torch.kernels.cpu_extension import (
    KERNELS_ENV,
    cpu_flags,
    has_avx2_vnni_build,
)

# oneDNN's name for each ISA, the /proc/cpuinfo flag it needs, lowest first
ISAS = (("AVX2", "avx2"), ("AVX512_CORE", "avx512f"), ("AVX512_CORE_BF16", "avx512_bf16"),
        ("AVX512_CORE_AMX", "amx_bf16"))
# the servers' --speculative-algorithm in each ISA's case: drafts forced on, then off, in turn
DRAFTS = {"AVX2": "SUFFIX", "AVX512_CORE": "none", "AVX512_CORE_BF16": "SUFFIX",
          "AVX512_CORE_AMX": "none"}


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
    if isa == _best_isa(flags):
        pytest.skip(f"{isa} is this CPU's best ISA: the main run covers it uncapped")
    _run_case(isa, "avx2" if isa == "AVX2" else None, DRAFTS[isa])


@pytest.mark.slow
def test_token_comparisons_hold_with_the_avx2_vnni_kernels():
    """The AVX2 + AVX-VNNI host class: oneDNN capped at AVX2, the quantized GEMM's avx2-vnni
    build (`vpdpbusd` on 256-bit vectors; on a CPU with AVX512-VNNI + VL but no AVX-VNNI the
    instruction's EVEX encoding), drafts off (the AVX2 case forces them on)."""
    if not has_avx2_vnni_build():
        pytest.skip("this CPU has no avx2-vnni build (AVX-512 with AVX-VNNI or AVX512-VNNI+VL)")
    _run_case("AVX2", "avx2-vnni", "none")


def _run_case(isa: str, kernels: str | None, drafts: str) -> None:
    """The marked tests in a subprocess with oneDNN capped at `isa`, SGL_TPU_CPU_KERNELS =
    `kernels` (None: unset) and the servers' drafts `drafts`."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "JAX_PLATFORMS": "cpu",
           "SGL_TPU_TEST_SPECULATIVE": drafts}
    env.pop(KERNELS_ENV, None)
    if kernels:
        env[KERNELS_ENV] = kernels
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "isa_invariance", *_marked_files()], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    case = f"{isa}, kernels {kernels or 'native'}, drafts {drafts}"
    assert proc.returncode == 0, f"under {case}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    print(f"{case}: {proc.stdout.strip().splitlines()[-1]}")
