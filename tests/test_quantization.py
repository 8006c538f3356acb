"""`--quantization`: GGUF blocks decoded exactly, the int kernels against a dequantized
reference, the tiny-checkpoint runner with quantized projections against the dense path, and
the flag's validation.

Tolerances: float32 kernels within 1e-5 relative to the largest output (accumulation order
only); bfloat16 kernels within 2% of the largest output (activations, scales and outputs round
to bf16); quantizing float weights at load (int8/int4) moves float32 logits by < 25% of the
largest |logit| on the random tiny model (a coarse check that the mapping is right; the real
model's agreement and perplexity are measured by `tools/quant_quality.py`).
"""

from __future__ import annotations

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu import Engine
from sgl_tpu.choices import check_registry_names
from sgl_tpu.cli import build_parser
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.quantization.blocks import (
    Int4Groups,
    Int8Groups,
    decode_gguf_blocks,
    quantize_int4,
    quantize_int8,
)

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from sgl_tpu.backends.torch.quant_linear import (  # noqa: E402
    Int4Kernel,
    Int8Kernel,
    QuantizedLinear,
    dispatching_linear,
    make_kernel,
)
from sgl_tpu.quantization.gguf_tensors import read_gguf_tensors  # noqa: E402
from sgl_tpu.quantization.gguf_weights import read_gguf_quantized  # noqa: E402

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")


def _weights(n: int = 48, k: int = 96, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    w[:, :32] += 0.3  # a block with an offset: Q4_1's m matters
    return w


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_gguf_blocks_decode_bit_exact(type_name):
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = gguf.quants.quantize(_weights(), qtype)  # u8[N, K/32 * block bytes]
    m = decode_gguf_blocks(type_name, raw, 96)
    np.testing.assert_array_equal(m.dequantize(), gguf.quants.dequantize(raw, qtype))
    if isinstance(m, Int4Groups):
        assert m.q.max() <= 15


def _q4_k_blocks(rng: np.random.Generator, n: int, k: int, d: float, dmin: float) -> np.ndarray:
    """Random Q4_K super-blocks u8[n, k/256 * 144]: every scale, minimum and code byte random,
    d and dmin float16 around the given sizes (gguf-py cannot quantize K-quants)."""
    nb = k // 256
    blocks = rng.integers(0, 256, size=(n, nb, 144), dtype=np.uint8)
    for at, size in ((0, d), (2, dmin)):
        halves = (size * rng.uniform(0.5, 1.0, (n, nb))).astype(np.float16)
        blocks[..., at:at + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def test_q4_k_decodes_bit_exact_or_refuses():
    """Q4_K as int4 groups of 32: bit for bit ggml's (gguf-py's) dequantization for blocks whose
    step and minimum are of one size; a block whose zero point would round is refused."""
    rng = np.random.default_rng(0)
    q4_k = gguf.GGMLQuantizationType.Q4_K
    raw = _q4_k_blocks(rng, 16, 512, d=0.01, dmin=0.02)
    m = decode_gguf_blocks("Q4_K", raw, 512)
    assert isinstance(m, Int4Groups) and m.scale.shape == (16, 16) and m.q.max() <= 15
    np.testing.assert_array_equal(m.dequantize(),
                                  gguf.quants.dequantize(raw, q4_k).reshape(16, 512))
    # d = 1 against dmin = 3 * 2^-24 (a float16 subnormal): 8 d sc - dmin mn does not fit
    # float32's 24 bits
    skewed = _q4_k_blocks(rng, 16, 256, d=1.0, dmin=0.0)
    skewed[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    skewed[:, 2:4] = np.array([3 * 2.0**-24], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="no exact int4 form"):
        decode_gguf_blocks("Q4_K", skewed, 256)


@pytest.mark.parametrize("type_name", ("Q4_0", "Q4_1"))
def test_int4pack_kernel_float32_bit_exact_to_gguf(type_name):
    """The int4 kernel's own dequantization (it applied to the identity) in float32 equals
    gguf's, bit for bit: the zero-point convention (q - 8) * scale + zero is the op's."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    raw = gguf.quants.quantize(_weights(), qtype)
    kernel = Int4Kernel(decode_gguf_blocks(type_name, raw, 96), torch.float32)
    w = kernel(torch.eye(96)).T.numpy()  # [N, K]
    np.testing.assert_array_equal(w, gguf.quants.dequantize(raw, qtype))


def test_q8_0_nibble_planes_exact_and_no_kernel():
    raw = gguf.quants.quantize(_weights(), gguf.GGMLQuantizationType.Q8_0)
    m = decode_gguf_blocks("Q8_0", raw, 96)
    assert isinstance(m, Int8Groups)
    hi, lo = m.split_nibbles()
    np.testing.assert_array_equal(hi.dequantize() + lo.dequantize(), m.dequantize())
    assert make_kernel(m, torch.bfloat16) is None  # Q8_0 stays dense (see quant_linear.py)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kind", ("int4", "int8"))
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 8, 17))
def test_kernels_match_dequantized_reference(kind, rows, dtype, rtol):
    w = _weights(n=64, k=128)
    m = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    kernel = Int4Kernel(m, dtype) if kind == "int4" else Int8Kernel(m, dtype)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ torch.from_numpy(m.dequantize()).double().T  # [rows, N]
    out = kernel(x.to(dtype)).double()
    assert out.shape == (rows, 64)
    assert (out - ref).abs().max() <= rtol * ref.abs().max()


def test_quantize_at_load_error_bounds():
    w = _weights()
    q4, q8 = quantize_int4(w), quantize_int8(w)
    step4 = np.repeat(q4.scale, 32, axis=1)
    assert (np.abs(q4.dequantize() - w) <= 0.5 * step4 + 1e-6).all()
    assert (np.abs(q8.dequantize() - w) <= 0.5 * q8.scale[:, None] + 1e-6).all()


def test_dispatch_by_rows():
    """The kernel serves up to max_rows rows, the dense weight above; the dense copy of a
    deliberately different matrix shows which one ran."""
    w = _weights(n=64, k=128)
    kernel = Int4Kernel(quantize_int4(w), torch.float32)
    other = torch.zeros(64, 128)
    linear = dispatching_linear(torch.nn.functional.linear)
    ql = QuantizedLinear(kernel, other, max_rows=3)
    bias = torch.ones(64)
    assert linear(torch.randn(3, 128), ql, bias).abs().sub(1).abs().max() > 0  # kernel
    torch.testing.assert_close(linear(torch.randn(4, 128), ql, bias), torch.ones(4, 64))
    only_kernel = QuantizedLinear(kernel, None, max_rows=3)
    x = torch.randn(9, 128)
    torch.testing.assert_close(linear(x, only_kernel, None), kernel(x))


# ---------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    return ck.make_tiny_gguf(tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf", "llama",
                             projection_type="Q4_1")


def test_tensor_directory_matches_gguf_reader(q4_gguf):
    ours = read_gguf_tensors(q4_gguf)
    reader = gguf.GGUFReader(q4_gguf)
    assert set(ours) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = ours[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.dims == tuple(int(d) for d in t.shape)
        np.testing.assert_array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8))


def test_gguf_projections_equal_loader_weights(q4_gguf):
    """Fused, un-permuted quantized projections dequantize to exactly the dense loader's
    weights; layer 0's gate/up mixes Q8_0 and Q4_1, so it stays dense."""
    from sgl_tpu.loader import load_model

    loaded = load_model(q4_gguf)
    mats = read_gguf_quantized(q4_gguf, loaded.config)
    assert "layers.0.w_gate_up" not in mats
    assert "lm_head" not in mats  # a float head
    assert len(mats) == 4 * loaded.config.num_layers - 1
    for i, lw in enumerate(loaded.params["layers"]):
        for fused, parts in {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",),
                             "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}.items():
            if f"layers.{i}.{fused}" in mats:
                dense = np.concatenate([lw[p] for p in parts], axis=1).T
                np.testing.assert_array_equal(mats[f"layers.{i}.{fused}"].dequantize(), dense)


PROMPTS = ("The quick brown fox", "def add(a, b):", "JSON looks like {")


def _greedy(engine: Engine, n: int = 12) -> list[list[int]]:
    """One prompt at a time: every decode step has one row, which the kernels serve."""
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return [engine.generate(p, params)["output_ids"] for p in PROMPTS]


def _engine(path, quantization, dtype="float32"):
    return Engine(path, backend="torch", quantization=quantization, dtype=dtype,
                  skip_warmup=True, page_size=4, max_total_tokens=1024, kv_tile=8,
                  min_token_bucket=16, chunked_prefill_size=64, max_running_requests=4,
                  grammar_backend="none")


def test_gguf_greedy_equals_dense_path(q4_gguf):
    """float32: the file's Q4_1 blocks on the int4 kernel give the dense path's tokens (decode
    on the kernel, prefill on the dense copy)."""
    quant = _engine(q4_gguf, "gguf")
    assert quant.scheduler.runner.quantization.quantized == 7  # 2 layers x 4 - mixed gate/up
    assert _greedy(quant) == _greedy(_engine(q4_gguf, "none"))


@pytest.mark.parametrize("method", ("int8", "int4"))
def test_quantize_at_load_runs_close_to_dense(tmp_path, method):
    from sgl_tpu.loader import load_model

    hf = ck.make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2")
    dense, quant = _engine(hf, "none"), _engine(hf, method)
    assert quant.scheduler.runner.quantization.quantized == 8
    ids = load_model(hf).tokenizer.encode("The quick brown fox jumps")[:2]
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    def logits(engine):
        runner = engine.scheduler.runner
        step = SeqStep(token_ids=np.asarray(ids), prefix_len=0,
                       pages=np.arange(1, 1 + -(-len(ids) // 4), dtype=np.int32),
                       sampling=SamplingParams(temperature=0.0), seed=0, num_output_tokens=0)
        res = runner.forward(ForwardMode.EXTEND, [step])  # 2 rows: on the kernels
        return runner.row_logits(res.hidden, np.arange(len(ids)))

    ref, out = logits(dense), logits(quant)
    assert np.abs(out - ref).max() < 0.25 * np.abs(ref).max()
    assert len(_greedy(quant, 4)[0]) == 4


# ---------------------------------------------------------------- the flag


def test_cli_choices_come_from_registry():
    parser = build_parser()
    assert parser.parse_args(["--quantization", "gguf"]).quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        check_registry_names(ServerArgs(quantization="fp8"))


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "jax", "quantization": "gguf"}, "implemented for --backend torch"),
    ({"backend": "torch", "torch_compile": "on", "quantization": "int4"}, "runs eagerly"),
])
def test_unsupported_combinations_fail_at_start(q4_gguf, kwargs, match):
    with pytest.raises(ValueError, match=match):
        runner_config(ServerArgs(model_path=q4_gguf, **kwargs), 512)


def test_gguf_needs_a_gguf_and_auto_resolves(tmp_path, q4_gguf):
    """auto stays a candidate ("auto") only where gguf can run on a GGUF; the runner then
    decides from the weights it is given (next test)."""
    hf = ck.make_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        runner_config(ServerArgs(model_path=hf, backend="torch", quantization="gguf"), 512)
    auto = {"backend": "torch", "quantization": "auto", "dtype": "bfloat16"}
    assert runner_config(ServerArgs(model_path=hf, **auto), 512).quantization == "none"
    assert runner_config(ServerArgs(model_path=q4_gguf, **auto), 512).quantization == "auto"
    # float32 activations: torch's int kernels lose to a dense float32 GEMV, so auto serves the
    # blocks only on the compiled float32 kernels (tests/test_quant_gemm_cpu.py)
    from sgl_tpu.backends.torch.quant_linear import f32_kernels_available

    f32 = {**auto, "dtype": "float32"}
    assert runner_config(ServerArgs(model_path=q4_gguf, **f32), 512).quantization == (
        "auto" if f32_kernels_available() else "none")
    assert runner_config(ServerArgs(model_path=q4_gguf, backend="jax"), 512).quantization \
        == "none"
    compiled = runner_config(ServerArgs(model_path=q4_gguf, torch_compile="on", **auto), 512)
    assert compiled.quantization == "none"


# ---------------------------------------------------------------- JAX int8


def test_jax_int8_equals_dequantized_reference(tmp_path):
    """The JAX runner's weight-only int8 projections give the logits of the dense model whose
    weights are the dequantized int8 values (float32: rounding differences only)."""
    pytest.importorskip("jax")
    from sgl_tpu.executor.registry import create_model_runner
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.loader import load_model
    from sgl_tpu.sampling_params import SamplingParams

    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "hf", "qwen2"))
    projections = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    dequantized = {**loaded.params, "layers": [
        {k: (quantize_int8(np.ascontiguousarray(v.T)).dequantize().T if k in projections else v)
         for k, v in lw.items()} for lw in loaded.params["layers"]]}
    ids = np.asarray(loaded.tokenizer.encode("The quick brown fox jumps over"), np.int32)

    def logits(params, quantization):
        args = ServerArgs(backend="jax", dtype="float32", quantization=quantization,
                          skip_warmup=True, page_size=4, max_total_tokens=256, kv_tile=8,
                          min_token_bucket=16, chunked_prefill_size=16,
                          max_running_requests=2, max_extend_seqs=2)
        runner = create_model_runner(loaded.config, params, runner_config(args, 512))
        step = SeqStep(token_ids=ids, prefix_len=0, pages=np.arange(1, 4, dtype=np.int32),
                       sampling=SamplingParams(temperature=0.0), seed=0, num_output_tokens=0)
        res = runner.forward(ForwardMode.EXTEND, [step])
        return runner.row_logits(res.hidden, np.arange(len(ids)))

    w, w8 = loaded.params["layers"][0]["w_up"], dequantized["layers"][0]["w_up"]
    assert np.abs(w8 - w).max() > 1e-5  # the int8 weights really differ from the floats
    ref = logits(dequantized, "none")
    out = logits(loaded.params, "int8")
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


def test_auto_uses_the_file_only_for_its_own_weights(tmp_path, q4_gguf):
    """auto serves the file's blocks when the runner's weights are the file's, and stays dense
    (no error) when they are not, e.g. another model's params under the default model path;
    an explicit gguf with foreign weights is an error naming the mismatch."""
    from sgl_tpu.executor.registry import create_model_runner
    from sgl_tpu.loader import load_model

    own = _engine(q4_gguf, "auto", dtype="bfloat16").scheduler.runner
    assert own.quantization is not None and own.quantization.method == "gguf"
    other = load_model(ck.make_tiny_gguf(tmp_path / "other.gguf", "llama", seed=1,
                                         projection_type="Q4_1"))
    args = dict(backend="torch", dtype="bfloat16", skip_warmup=True, page_size=4,
                max_total_tokens=256, kv_tile=8, min_token_bucket=16, chunked_prefill_size=16,
                max_running_requests=2, max_extend_seqs=2)
    cfg = runner_config(ServerArgs(model_path=q4_gguf, quantization="auto", **args), 512)
    assert create_model_runner(other.config, other.params, cfg).quantization is None
    cfg = runner_config(ServerArgs(model_path=q4_gguf, quantization="gguf", **args), 512)
    with pytest.raises(ValueError, match="differs from the loaded weights"):
        create_model_runner(other.config, other.params, cfg)
