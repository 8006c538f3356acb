"""The compiled Q4 / Q8 block GEMM with float32 activations
(backends/torch/kernels/quant_gemm_cpu.py): against a float64 reference of the dequantized weights,
the stored weights bit for bit, rows independent of the batch, the default model's greedy tokens
against the dense float32 path, and what `--quantization auto` picks. The int8-activation kernels
(`gguf-a8`): the activations quantized exactly as a numpy reference does (llama.cpp's Q8_0 rule),
the GEMM against a float64 reference of the integer block dots, the mode's validation, and the
default model's greedy tokens against gguf. On an AVX-512 machine the float32 kernels are also
tested as built for AVX2 (`build`). Skipped when the extension is not built.

Tolerance: float32 accumulation only (the weights are the stored ones; for a8 the integer block
dots are exact): 1e-5 of the largest |output| against the float64 reference.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from sgl_tpu.backends.torch.kernels import quant_gemm_cpu  # noqa: E402
from sgl_tpu.backends.torch.quant_linear import (  # noqa: E402
    Q4A8Kernel,
    Q4F32Kernel,
    Q8A8Kernel,
    Q8F32Kernel,
    make_kernel,
)
from sgl_tpu.quantization import resolve_quantization  # noqa: E402
from sgl_tpu.quantization.blocks import Int4Groups, Int8Groups, decode_gguf_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not quant_gemm_cpu.available(),
                                reason=f"not built: {quant_gemm_cpu.why_unavailable()}")

# (N, K): the default model's fused qkv, down, a ragged N (not a multiple of 8 or 16), and
# an odd number of blocks per row (K / 32 = 3)
SHAPES = ((960, 576), (576, 1536), (77, 64), (40, 96))


@pytest.fixture(scope="module")
def avx2_module(tmp_path_factory):
    """This source built with -mno-avx512f: the 8-lane float32 kernels CPUs with AVX2 only run
    (their activations in another nibble order than the 16-lane ones)."""
    from sgl_tpu.backends.torch.kernels import cpu_extension

    module = cpu_extension.build_copy(cpu_extension.QUANT_GEMM.source, "sgl_tpu_qgemm_avx2_test",
                                      str(tmp_path_factory.mktemp("qgemm_avx2")),
                                      extra_flags=("-mno-avx512f",))
    assert module.simd == "avx2-fma" and not module.vnni
    return module


@pytest.fixture(params=("native", "avx2"))
def build(request, monkeypatch):
    """The kernels of the native build, and on an AVX-512 machine (whose native build runs the
    16-lane code) also those of the AVX2 build, so both vector paths are tested there."""
    if request.param == "avx2":
        if quant_gemm_cpu.kernel_module().simd != "avx512f":
            pytest.skip("the native build is the AVX2 (or scalar) one")
        module = request.getfixturevalue("avx2_module")
        monkeypatch.setattr(quant_gemm_cpu, "kernel_module", lambda: module)
    return request.param


def _int4(n: int, k: int, rng: np.random.Generator) -> Int4Groups:
    return Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8),
                      (rng.random((n, k // 32)) * 0.02).astype(np.float32),
                      (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32))


def _int8(n: int, k: int, rng: np.random.Generator) -> Int8Groups:
    return Int8Groups(rng.integers(-128, 128, (n, k)).astype(np.int8),
                      (rng.random((n, k // 32)) * 0.002).astype(np.float32))


@pytest.mark.parametrize("fmt", ("q4", "q8"))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64_reference(fmt, shape, build):
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
def test_kernel_weights_bit_exact_to_gguf(type_name, build):
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


@pytest.mark.parametrize("int8_activations", (False, True))
@pytest.mark.parametrize("fmt", ("q4", "q8"))
def test_kernel_rejects_bad_input(fmt, int8_activations):
    rng = np.random.default_rng(2)
    m = _int4(16, 64, rng) if fmt == "q4" else _int8(16, 64, rng)
    kernel = make_kernel(m, torch.float32, int8_activations=int8_activations)
    block = 16 if fmt == "q4" else 32
    layout = rf"codes must be contiguous \[N, K/32, {block}\]"
    if int8_activations and quant_gemm_cpu.tiles_for(16):  # 16 features: one tile
        layout = rf"tiles must be contiguous uint8 \[N/16, K/32, {16 * block}\]"
    with pytest.raises(RuntimeError, match="K = 80 is not a multiple of 32"):
        kernel(torch.zeros(1, 80))
    with pytest.raises(RuntimeError, match=layout):
        kernel(torch.zeros(1, 96))
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(RuntimeError, match="float32"):
            kernel(torch.zeros(1, 64, dtype=dtype))


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
    dense float32 path's tokens; gguf-a8 (the int8-activation kernels) gives their first ones."""
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
        quant = engine("gguf")
    report = quant.scheduler.runner.quantization
    assert report.method == "gguf" and report.kernels == ("q4-f32",)
    assert report.quantized == 4 * 30 and report.head == "q8-f32"
    assert "vocabulary head on q8-f32" in caplog.text
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompts = ("The capital of France is", "def fibonacci(n):")
    gens = [quant.generate(p, params, return_logprob=True) for p in prompts]
    out = [g["output_ids"] for g in gens]
    quant.shutdown()
    dense = engine("none")
    assert dense.scheduler.runner.quantization is None
    assert out == [dense.generate(p, params)["output_ids"] for p in prompts]
    dense.shutdown()
    # gguf-a8 (int8 activations; `auto` on VNNI builds) is not exact: its greedy tokens have
    # followed gguf's
    # for 1 to all 16 tokens on these prompts as float32-level details elsewhere changed (the
    # attention's and the SiLU's rounding); assert the first token and that the first token's
    # log-probability moved (the activations are rounded)
    a8 = engine("gguf-a8")
    report = a8.scheduler.runner.quantization
    # AVX512-VNNI builds take 16-feature tiles at every row count and keep no dense copy;
    # others keep one for steps above the kernels' rows, bf16 where oneDNN computes bf16
    from sgl_tpu.backends.torch import quant_linear

    tiled = quant_gemm_cpu.tiles_for(576)
    suffix = "-t16" if tiled else ""
    assert report.method == "gguf-a8" and report.kernels == ("q4-a8" + suffix,)
    assert report.quantized == 4 * 30 and report.head == "q8-a8" + suffix
    assert report.dense == ("none" if tiled else "bfloat16"
                            if quant_linear.bf16_dense_available() else "activation dtype")
    info = a8.scheduler.runner.compute_info()["quantization"]
    assert info["dense"] == report.dense
    assert info["max_kernel_rows"]["q4-a8" + suffix] == (
        None if tiled else quant_linear.max_kernel_rows("q4-a8", report.dense == "bfloat16"))
    gens_a8 = [a8.generate(p, params, return_logprob=True) for p in prompts]
    a8.shutdown()
    assert [g["output_ids"][:1] for g in gens_a8] == [o[:1] for o in out]

    def first_logprob(g):
        return g["meta_info"]["output_token_logprobs"][0][0]

    for g, g_a8 in zip(gens, gens_a8, strict=True):
        assert first_logprob(g) < 0 and abs(first_logprob(g_a8) - first_logprob(g)) > 1e-6


def test_auto_takes_int8_activations_where_the_tiles_are_built():
    """`auto` serves a GGUF with float32 activations on the int8-activation kernels exactly
    where the build has their tiles (AVX512-VNNI, AVX-VNNI or AVX2: llama.cpp's math, measured
    faster on each), else on the exact float32 kernels; bfloat16 activations keep torch's int4
    op."""
    from sgl_tpu.backends.torch.quantize import auto_method

    assert auto_method(torch.float32) == ("gguf-a8" if quant_gemm_cpu.tile_dot() else "gguf")
    assert auto_method(torch.bfloat16) == "gguf"


def test_bf16_dense_copy_takes_the_large_steps():
    """Above the kernels' rows a bf16 dense copy computes the step: the float32 activations are
    cast to bf16, the result is float32, the bias is added in float32, and it is within bf16's
    rounding of the float32 product."""
    from sgl_tpu.backends.torch import quant_linear

    if not quant_linear.bf16_dense_available():
        pytest.skip("oneDNN does not compute bf16 natively on this CPU")
    torch.manual_seed(0)
    w, x, b = torch.randn(64, 96), torch.randn(40, 96), torch.randn(64)
    y = quant_linear.bf16_dense_linear(x, quant_linear.bf16_dense(w), b)
    assert y.dtype == torch.float32 and y.shape == (40, 64)
    exact = x @ w.T + b
    assert torch.allclose(y, exact, atol=0.25, rtol=0.02)
    assert not torch.equal(y, exact)  # bf16 rounding, not a float32 GEMM


def _quantize_a8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[M, K] -> (xq i8[M, K], d f32[M, K/32]): llama.cpp's Q8_0 rule in float32,
    round half to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    xq = np.rint(blocks * inv[..., None]).astype(np.int8)
    return xq.reshape(x.shape), d


def test_a8_activations_quantized_like_reference():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    x[1, 32:64] = 0  # an all-zero block: d = 0, codes 0
    x[2, :32] *= 1e4
    xq, d = quant_gemm_cpu.quantize_a8(x)
    ref_q, ref_d = _quantize_a8_reference(x.numpy())
    np.testing.assert_array_equal(xq.numpy(), ref_q)
    np.testing.assert_array_equal(d.numpy(), ref_d)
    assert d[1, 1] == 0 and not xq[1, 32:64].any() and xq.abs().max() == 127


def _half_scales(m: Int4Groups | Int8Groups) -> Int4Groups | Int8Groups:
    """m with float16 scales (and Q4 mins, zero - 8 scale), as a GGUF stores them."""
    scale = m.scale.astype(np.float16).astype(np.float32)
    if isinstance(m, Int8Groups):
        return Int8Groups(m.q, scale)
    mins = (m.zero - 8 * m.scale).astype(np.float16).astype(np.float32)
    return Int4Groups(m.q, scale, mins + 8 * scale)


@pytest.mark.parametrize("scales", ("float32", "float16"))
@pytest.mark.parametrize("fmt", ("q4", "q8"))
@pytest.mark.parametrize("shape", SHAPES)
def test_a8_kernel_matches_integer_reference(fmt, shape, scales, build):
    """y = sum_b scale d (integer dot of codes and quantized activations) [+ Q4 zero terms on
    the quantized block sums d * sum(codes), llama.cpp's Q8_1 s], in float64 from the reference
    quantization: the dot of the stored weights with the quantized activations. Where the
    weights take 16-feature tiles, their scales are float16 exactly when every value is one."""
    rng = np.random.default_rng(sum(shape) + 1)
    n, k = shape
    m = _int4(n, k, rng) if fmt == "q4" else _int8(n, k, rng)
    if scales == "float16":
        m = _half_scales(m)
    kernel = make_kernel(m, torch.float32, int8_activations=True)
    assert isinstance(kernel, Q4A8Kernel if fmt == "q4" else Q8A8Kernel)
    if quant_gemm_cpu.tiles_for(n):
        assert kernel.kind.endswith("-t16")
        assert kernel.blocks.st.dtype == getattr(torch, scales)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(n))
    xq, d = _quantize_a8_reference(x.numpy())
    codes = m.q.astype(np.int64).reshape(n, -1, 32)  # [N, nb, 32]
    dots = np.einsum("mbj,nbj->mnb", xq.astype(np.int64).reshape(8, -1, 32), codes)
    scaled = dots * m.scale.astype(np.float64)[None] * d.astype(np.float64)[:, None]
    ref = scaled.sum(-1)  # [M, N]
    if fmt == "q4":
        xsum = d.astype(np.float64) * xq.astype(np.int64).reshape(8, -1, 32).sum(-1)  # [M, nb]
        ref += xsum @ (m.zero.astype(np.float64) - 8 * m.scale.astype(np.float64)).T
    for rows in (1, 3, 8):
        out = kernel(x[:rows])
        assert out.shape == (rows, n) and out.dtype == torch.float32
        assert np.abs(out.numpy() - ref[:rows]).max() <= 1e-5 * np.abs(ref).max()
    full = kernel(x)
    assert torch.equal(full[5:6], kernel(x[5:6]))  # rows independent of the batch
    # the activation rounding is the only approximation: close to the exact kernel
    exact = make_kernel(m, torch.float32)(x)
    assert (full - exact).abs().max() <= 0.05 * exact.abs().max()


def test_a8_quantization_and_mode_reject_bad_input():
    rng = np.random.default_rng(4)
    with pytest.raises(RuntimeError, match="K = 40 is not a multiple of 32"):
        quant_gemm_cpu.quantize_a8(torch.zeros(2, 40))
    with pytest.raises(RuntimeError, match="quantize_a8: x must be a contiguous float32"):
        quant_gemm_cpu.quantize_a8(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="int8 activations need float32"):
        make_kernel(_int4(16, 64, rng), torch.bfloat16, int8_activations=True)


def test_gguf_a8_validation():
    common = {"backend": "torch", "device_type": "cpu", "compile": False, "is_gguf": True}
    assert resolve_quantization("gguf-a8", dtype="float32", f32_kernels=True,
                                **common) == "gguf-a8"
    with pytest.raises(ValueError, match="use --dtype float32"):
        resolve_quantization("gguf-a8", dtype="bfloat16", f32_kernels=True, **common)
    with pytest.raises(ValueError, match="needs the compiled quantized CPU GEMM"):
        resolve_quantization("gguf-a8", dtype="float32", f32_kernels=False, **common)
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        resolve_quantization("gguf-a8", dtype="float32", f32_kernels=True,
                             **{**common, "is_gguf": False})
    with pytest.raises(ValueError, match="implemented for --backend torch"):
        resolve_quantization("gguf-a8", dtype="float32", f32_kernels=True,
                             **{**common, "backend": "jax"})
    # auto stays auto: the runner picks gguf or gguf-a8 (quantize.auto_method)
    assert resolve_quantization("auto", dtype="float32", f32_kernels=True, **common) == "auto"


def test_float32_kernel_row_limit_follows_the_build(monkeypatch):
    """Steps of more rows than the crossover go to the dense weight: 32 for the AVX2 (and
    scalar) build of the float32 kernels, 20 for the AVX-512 one (dense float32 overtakes it
    sooner); the int8-activation kernels keep 64."""
    from sgl_tpu.backends.torch import quant_linear

    for simd, rows in (("avx512f", 20), ("avx2-fma", 32), ("scalar", 32)):
        monkeypatch.setattr(quant_gemm_cpu, "simd", lambda s=simd: s)
        assert quant_linear.max_kernel_rows("q4-f32") == rows
        assert quant_linear.max_kernel_rows("q8-f32") == rows
        assert quant_linear.max_kernel_rows("q4-a8") == 64
        # below a bf16 dense copy, which overtakes them sooner
        assert quant_linear.max_kernel_rows("q4-a8", dense_bf16=True) == 8


def test_native_build_takes_vnni_where_the_cpu_has_it():
    """The int8-activation kernels' AVX512-VNNI path is compiled in exactly where the CPU has
    AVX512-VNNI and AVX512BW (-march=native), so such machines run it and the tests above
    cover it there."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    native = quant_gemm_cpu.kernel_module()
    assert native.vnni == (native.simd == "avx512f" and {"avx512_vnni", "avx512bw"} <= flags)
    # the tile kernels' dot product: the CPU's best (an avx2 / avx2-vnni build: that class's)
    flavour = quant_gemm_cpu.flavour()
    expected = ("vpdpbusd-zmm" if native.vnni else "" if native.simd != "avx2-fma"
                else "vpmaddubsw-ymm" if flavour == "avx2"
                else "vpdpbusd-ymm-vex" if "avx_vnni" in flags
                else "vpdpbusd-ymm-evex" if flavour == "avx2-vnni" else "vpmaddubsw-ymm")
    assert native.tile_dot == expected


def _tile_flavours() -> dict:
    """The built flavours of this source that hold tile kernels: name -> module."""
    from sgl_tpu.backends.torch.kernels import cpu_extension

    flavours = {}
    for name in ("native", "avx2", "avx2vnni"):
        module = cpu_extension.load_flavour(cpu_extension.QUANT_GEMM, name)
        if module is not None and module.tile_dot:
            flavours[name] = module
    return flavours


def _tile_outputs(module, x, w4, w8):
    return (module.q4_gemm_a8_tiles(x, w4.qt, w4.st, w4.mt),
            module.q8_gemm_a8_tiles(x, w8.qt, w8.st))


def test_tile_kernels_give_the_same_bits_on_every_build():
    """The 256-bit tile kernels (AVX2 vpmaddubsw; vpdpbusd ymm in the avx2-vnni build) take the
    same exact integer dots and the same float operations per lane as the AVX512-VNNI ones: on
    a CPU that runs several builds, every build's results are the same bits, and a row's result
    does not depend on the rows beside it."""
    flavours = _tile_flavours()
    if len(flavours) < 2:
        pytest.skip(f"one build with tile kernels here ({sorted(flavours)}): nothing to compare")
    rng = np.random.default_rng(7)
    for n, k in ((16, 64), (960, 576), (48, 1536)):
        q4, q8 = _half_scales(_int4(n, k, rng)), _half_scales(_int8(n, k, rng))
        w4 = quant_gemm_cpu.pack_q4_tiles(q4.q, q4.scale, q4.zero)
        w8 = quant_gemm_cpu.pack_q8_tiles(q8.q, q8.scale)
        x = torch.randn(13, k, generator=torch.Generator().manual_seed(n))
        outs = {name: _tile_outputs(m, x, w4, w8) for name, m in flavours.items()}
        first = next(iter(outs.values()))
        for name, (y4, y8) in outs.items():
            assert torch.equal(y4, first[0]) and torch.equal(y8, first[1]), (name, n, k)
            for rows in (1, 4, 8):  # a row alone, in a short tile, in a full one
                one = _tile_outputs(flavours[name], x[5:5 + 1].contiguous(), w4, w8)
                part = _tile_outputs(flavours[name], x[:rows + 5].contiguous(), w4, w8)
                assert torch.equal(one[0][0], part[0][5]) and torch.equal(one[1][0], part[1][5])


@pytest.mark.parametrize("flavour", ("native", "avx2", "avx2vnni"))
def test_tile_kernels_exact_at_the_int16_bounds(flavour):
    """Adversarial codes: Q8 -128 and 127, Q4 15, activations +-127 with d = 1 (|x| = 127 in
    every block), so every output is an integer the float32 sums hold exactly. AVX2's
    vpmaddubsw saturates pairs at +-32767: the Q8 kernel multiplies |q| (<= 128) by the
    activation with q's sign, a pair at most 2 * 128 * 127 = 32512 (unsigned q + 128 = 255
    would reach 64770), and the Q4 kernel's int16 block sums reach 8 * 2 * 15 * 127 = 30480."""
    from sgl_tpu.backends.torch.kernels import cpu_extension

    module = cpu_extension.load_flavour(cpu_extension.QUANT_GEMM, flavour)
    if module is None or not module.tile_dot:
        pytest.skip(f"no {flavour} build with tile kernels here")
    n, k = 32, 256
    rng = np.random.default_rng(8)
    signs = np.where(rng.random((6, k)) < 0.5, -1, 1)
    signs[0], signs[1] = 1, -1  # all +127, all -127
    x = torch.from_numpy((127 * signs).astype(np.float32))
    q8 = np.where(rng.random((n, k)) < 0.5, -128, 127)
    q8[:8] = -128  # with row 1: every pair 2 * 128 * 127
    q8[8:16] = 127
    q4 = np.full((n, k), 15)
    ones = np.ones((n, k // 32), np.float32)
    w8 = quant_gemm_cpu.pack_q8_tiles(q8, ones)
    w4 = quant_gemm_cpu.pack_q4_tiles(q4, ones, 8 * ones)  # mins 0: y = the integer dots
    y4, y8 = _tile_outputs(module, x, w4, w8)
    np.testing.assert_array_equal(y8.numpy(), (127 * signs) @ q8.T)
    np.testing.assert_array_equal(y4.numpy(), (127 * signs) @ q4.T)


def test_avx2_vnni_kernels_select_their_builds(monkeypatch):
    """SGL_TPU_CPU_KERNELS=avx2-vnni loads the avx2vnni build of the quantized GEMM (the
    AVX2 + AVX-VNNI host class: vpdpbusd on 256-bit vectors, VEX-encoded where the CPU has
    AVX-VNNI, else the EVEX encoding of AVX512-VNNI + VL) and the avx2 builds of the sources
    without AVX-VNNI code; avx2 the avx2 builds (vpmaddubsw); unset, the native ones."""
    from sgl_tpu.backends.torch.kernels import cpu_extension as ce

    flags = set(ce.cpu_flags().split())
    if not ce.has_avx2_vnni_build():
        pytest.skip("this CPU has no AVX-512 build beside an avx2-vnni one")
    monkeypatch.setenv(ce.KERNELS_ENV, "avx2-vnni")
    assert ce.requested_flavours(ce.QUANT_GEMM) == ["avx2vnni"]
    assert ce.requested_flavours(ce.LAYER_OPS) == ["avx2"]
    assert "-mno-avx512f" in ce.flavour_flags("avx2vnni")
    monkeypatch.setenv(ce.KERNELS_ENV, "avx2")
    assert ce.requested_flavours(ce.QUANT_GEMM) == ["avx2"]
    monkeypatch.delenv(ce.KERNELS_ENV)
    assert ce.requested_flavours(ce.QUANT_GEMM) == list(ce.FLAVOURS)
    vnni256 = ce.load_flavour(ce.QUANT_GEMM, "avx2vnni")
    if vnni256 is None:
        pytest.skip("the avx2vnni build is not built here")
    assert vnni256.simd == "avx2-fma" and not vnni256.vnni
    assert vnni256.tile_dot == ("vpdpbusd-ymm-vex" if "avx_vnni" in flags
                                else "vpdpbusd-ymm-evex")
    avx2 = ce.load_flavour(ce.QUANT_GEMM, "avx2")
    assert avx2 is None or avx2.tile_dot == "vpmaddubsw-ymm"


@pytest.mark.slow
def test_avx_vnni_build_compiles_to_vex_vpdpbusd(tmp_path):
    """The AVX2 + AVX-VNNI host class's native build (-mavxvnni, no AVX-512): its tile kernels
    take VEX-encoded `vpdpbusd ymm`. Built and loaded here without running its kernels (a CPU
    without AVX-VNNI faults on the VEX form; the avx2-vnni build runs the EVEX one there)."""
    import shutil
    import subprocess

    from sgl_tpu.backends.torch.kernels import cpu_extension

    module = cpu_extension.build_copy(cpu_extension.QUANT_GEMM.source, "sgl_tpu_qgemm_vex_test",
                                      str(tmp_path), extra_flags=("-mno-avx512f", "-mavxvnni"))
    assert module.simd == "avx2-fma" and module.tile_dot == "vpdpbusd-ymm-vex"
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the instructions")
    text = subprocess.run(["objdump", "-d", module.__file__], capture_output=True, text=True,
                          check=True).stdout
    dots = [line for line in text.splitlines() if "vpdpbusd" in line]
    # VEX instructions start with c4 / c5, EVEX with 62
    assert dots and all(line.split("\t")[1].startswith(("c4", "c5")) for line in dots)
