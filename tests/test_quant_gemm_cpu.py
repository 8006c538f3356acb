"""The compiled Q4 / Q8 block GEMM with float32 activations (kernels/quant_gemm_cpu.py): against
a float64 reference of the dequantized weights, the stored weights bit for bit, rows independent
of the batch, the default model's greedy tokens against the dense float32 path, and what
`--quantization auto` picks. Skipped when the extension is not built.

Tolerance: float32 accumulation only (the weights are the stored ones): 1e-5 of the largest
|output| against the float64 reference.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from sgl_tpu.executor.torch.quant_linear import (  # noqa: E402
    Q4F32Kernel,
    Q8F32Kernel,
    make_kernel,
)
from sgl_tpu.kernels import quant_gemm_cpu  # noqa: E402
from sgl_tpu.quantization import resolve_quantization  # noqa: E402
from sgl_tpu.quantization.blocks import Int4Groups, Int8Groups, decode_gguf_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not quant_gemm_cpu.available(),
                                reason=f"not built: {quant_gemm_cpu.why_unavailable()}")

# (N, K): the default model's fused qkv, down, and a ragged N (not a multiple of 8 or 16)
SHAPES = ((960, 576), (576, 1536), (77, 64))


def _int4(n: int, k: int, rng: np.random.Generator) -> Int4Groups:
    return Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8),
                      (rng.random((n, k // 32)) * 0.02).astype(np.float32),
                      (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32))


def _int8(n: int, k: int, rng: np.random.Generator) -> Int8Groups:
    return Int8Groups(rng.integers(-128, 128, (n, k)).astype(np.int8),
                      (rng.random((n, k // 32)) * 0.002).astype(np.float32))


@pytest.mark.parametrize("fmt", ("q4", "q8"))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64_reference(fmt, shape):
    rng = np.random.default_rng(sum(shape))
    n, k = shape
    m = _int4(n, k, rng) if fmt == "q4" else _int8(n, k, rng)
    kernel = make_kernel(m, torch.float32)
    assert isinstance(kernel, Q4F32Kernel if fmt == "q4" else Q8F32Kernel)
    w = torch.from_numpy(m.dequantize()).double()  # [N, K]
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for rows in (1, 3, 8):
        ref = x[:rows] @ w.T  # [rows, N]
        out = kernel(x[:rows].float())
        assert out.shape == (rows, n) and out.dtype == torch.float32
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # each row's result is independent of the rows beside it (same order of operations)
    full = kernel(x.float())
    assert torch.equal(full[5:6], kernel(x[5:6].float()))


@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_1", "Q8_0"))
def test_kernel_weights_bit_exact_to_gguf(type_name):
    """The kernel applied to the identity returns gguf's own dequantization, bit for bit: the
    packed nibbles, scales and zeros are the stored weights."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((40, 96)) * 0.1).astype(np.float32)
    w[:, :32] += 0.3  # an offset block: Q4_1's m matters
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = gguf.quants.quantize(w, qtype)
    kernel = make_kernel(decode_gguf_blocks(type_name, raw, 96), torch.float32)
    np.testing.assert_array_equal(kernel(torch.eye(96)).T.numpy(),
                                  gguf.quants.dequantize(raw, qtype))


def test_kernel_rejects_bad_input():
    kernel = make_kernel(_int8(16, 64, np.random.default_rng(2)), torch.float32)
    with pytest.raises(RuntimeError, match="K = 80 is not a multiple of 32"):
        kernel(torch.zeros(1, 80))
    with pytest.raises(RuntimeError, match=r"codes must be contiguous \[N, K/32, 32\]"):
        kernel(torch.zeros(1, 96))
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(1, 64, dtype=torch.float64))


def test_auto_picks_gguf_on_float32_only_with_the_kernels():
    common = {"backend": "torch", "device_type": "cpu", "compile": False, "is_gguf": True}
    assert resolve_quantization("auto", dtype="float32", f32_kernels=True, **common) == "auto"
    assert resolve_quantization("auto", dtype="float32", f32_kernels=False, **common) == "none"
    assert resolve_quantization("auto", dtype="bfloat16", **common) == "auto"
    assert resolve_quantization("gguf", dtype="float32", **common) == "gguf"
    assert resolve_quantization("none", dtype="float32", f32_kernels=True, **common) == "none"
    assert resolve_quantization("auto", dtype="float32", f32_kernels=True,
                                **{**common, "is_gguf": False}) == "none"


def test_default_model_greedy_equals_dense_float32(caplog):
    """The default model (Q4_1 projections, tied Q8_0 head) on the float32 block kernels: every
    decode step of one sequence runs on them (head included), and greedy decoding gives the
    dense float32 path's tokens."""
    from sgl_tpu import Engine
    from sgl_tpu.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))

    def engine(quantization):
        return Engine(None, backend="torch", quantization=quantization, dtype="float32",
                      skip_warmup=True, max_total_tokens=512, chunked_prefill_size=64,
                      max_running_requests=2, grammar_backend="none")

    with caplog.at_level(logging.INFO):
        quant = engine("auto")
    report = quant.scheduler.runner.quantization
    assert report.method == "gguf" and report.kernels == ("q4-f32",)
    assert report.quantized == 4 * 30 and report.head == "q8-f32"
    assert "vocabulary head on q8-f32" in caplog.text
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = ("The capital of France is", "def fibonacci(n):")
    out = [quant.generate(p, params)["output_ids"] for p in prompts]
    quant.shutdown()
    dense = engine("none")
    assert dense.scheduler.runner.quantization is None
    assert out == [dense.generate(p, params)["output_ids"] for p in prompts]
    dense.shutdown()
