"""The fixed-reduction-order GEMM of deterministic inference
(backends/torch/kernels/invariant_gemm_cpu.py): against a float64 reference, and bit for bit the
same for any row count, thread count, strided or packed weight, and for the AVX2 build of the same
source (what an AVX2-only CPU runs) as for this machine's native build. Skipped when the extension
is not built.

Tolerance against float64: float32 accumulation of K products, 1e-5 of the largest |output|.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sgl_tpu.backends.torch.kernels import cpu_extension  # noqa: E402
from sgl_tpu.backends.torch.kernels import invariant_gemm_cpu as ig  # noqa: E402

pytestmark = pytest.mark.skipif(not ig.available(),
                                reason=f"not built: {ig.why_unavailable()}")

# (N, K): the default model's fused qkv and down projections, a ragged N (not a multiple of
# the 16-column block) and a tiny one
SHAPES = ((960, 576), (576, 1536), (77, 64), (5, 3))
ROW_COUNTS = (1, 2, 3, 5, 8, 9, 17, 64, 257)


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g).to(dtype),
            torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_linear_matches_float64_and_rows_do_not_depend_on_row_count(shape, dtype):
    n, k = shape
    w, x = _weights(n, k, dtype)
    packed = ig.pack(w, float_output=True)
    whole = ig.linear(x, packed)
    ref = x.double() @ w.double().T
    assert whole.dtype == torch.float32
    assert (whole.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for m in ROW_COUNTS:
        assert torch.equal(ig.linear(x[:m], packed), whole[:m]), m


def test_strided_matmul_equals_the_packed_linear_and_the_thread_count_does_not_matter():
    w, x = _weights(200, 96, torch.bfloat16)
    packed = ig.linear(x, ig.pack(w, float_output=True))
    assert torch.equal(ig.matmul(x, w.T), packed)  # b = w.T: strided rows, copied
    assert torch.equal(ig.matmul(x[None].expand(3, -1, -1), w.T.contiguous()[None].expand(
        3, -1, -1)), packed[None].expand(3, -1, -1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ig.linear(x, ig.pack(w, float_output=True)), packed)
    finally:
        torch.set_num_threads(threads)


def test_linear_rounds_once_to_the_activations_dtype_and_adds_the_bias_before():
    w, x = _weights(48, 32, torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    exact = ig.linear(x, ig.pack(w, float_output=True))
    y = ig.linear(x, ig.pack(w), bias)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (exact + bias.float()).to(torch.bfloat16))


def test_bad_operands_are_refused_with_the_kernels_message():
    k = ig._kernel()
    with pytest.raises(RuntimeError, match="float32"):
        k.gemm(torch.zeros(1, 2, 3, dtype=torch.float64), torch.zeros(1, 3, 4))
    with pytest.raises(RuntimeError, match=r"\[Bt, K, N\]"):
        k.gemm(torch.zeros(1, 2, 3), torch.zeros(1, 4, 4))
    with pytest.raises(RuntimeError, match="panels"):
        k.gemm_packed(torch.zeros(2, 5), k.pack(torch.zeros(16, 3)), 16)


@pytest.fixture(scope="module")
def avx2_module(tmp_path_factory):
    """This source built with -mno-avx512f: the 8-lane code CPUs with AVX2 only run."""
    if ig.simd() != "avx512f":
        pytest.skip(f"the native build is the {ig.simd()} one: it is the AVX2 code already")
    module = cpu_extension.build_copy(cpu_extension.INVARIANT_GEMM.source,
                                      "sgl_tpu_inv_gemm_avx2_test",
                                      str(tmp_path_factory.mktemp("inv_avx2")),
                                      extra_flags=("-mno-avx512f",))
    assert module.simd == "avx2-fma"
    return module


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_the_avx2_build_gives_the_native_builds_bits(avx2_module, dtype):
    native = ig._kernel()
    for n, k in SHAPES:
        w, x = _weights(n, k, dtype, seed=n)
        a = x.float()
        assert torch.equal(avx2_module.gemm_packed(a, avx2_module.pack(w), n),
                           native.gemm_packed(a, native.pack(w), n)), (n, k)
        b = w.T.contiguous()[None]
        assert torch.equal(avx2_module.gemm(a[None], b), native.gemm(a[None], b)), (n, k)
