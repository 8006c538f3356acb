"""Registry of weight quantization methods (`--quantization`, SGLang's flag) and the resolution
of `auto`. Import-light: numpy-free, no torch, no JAX.

    none  every weight dequantized to --dtype at load (GGUF blocks included): today's path
    gguf  a GGUF's Q4_0 / Q4_1 / Q4_K projection blocks served as stored by an int4 group-32
          kernel, an exact re-encoding (quantization/blocks.py). With float32 activations the
          compiled block kernels (backends/torch/kernels/quant_gemm_cpu.py) also serve Q5_0 and
          Q8_0 blocks (as int8 codes) and a Q8_0 vocabulary head; with bfloat16 (torch's int4
          op) the 8-bit formats and float tensors are dequantized
    gguf-a8  float32 activations only (CPUs without AMX): the same GGUF blocks as stored,
          the activations quantized to int8 per 32 values (llama.cpp's CPU math: integer block
          dots), opt-in: faster than gguf, not exact (a new activation rounding error)
    int8  weight-only int8, one symmetric scale per output feature, quantized at load from the
          float weights of any checkpoint (new quantization error); torch and jax
    int4  weight-only int4, asymmetric groups of 32 (Q4_1's scheme), quantized at load (new
          quantization error)
    auto  gguf where the method runs (torch backend, CPU, eager), wins (bfloat16 activations, or
          float32 with the compiled block kernels built) and the loaded weights are a GGUF's
          blocks (the runner checks the file against the weights it was given), else
          none; the start-up log names the choice

Projections (q/k/v, o, gate/up, down) and, with float32 activations, a block-format vocabulary
head; embeddings and norms keep the dense path. The quantized kernels run for decode-sized
steps and the dense copy above `MAX_KERNEL_ROWS` rows (backends/torch/quant_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizationMethod:
    description: str
    backends: tuple[str, ...]  # executor backends that implement it
    needs_gguf: bool = False  # only meaningful for a GGUF checkpoint


QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {
    "none": QuantizationMethod("dense weights in --dtype", ("jax", "torch")),
    "gguf": QuantizationMethod("the GGUF's Q4_0/Q4_1/Q4_K (and, float32, Q5_0/Q8_0 and a Q8_0 "
                               "head) blocks as stored",
                               ("torch",), needs_gguf=True),
    "gguf-a8": QuantizationMethod("the GGUF's blocks as stored, activations quantized to int8 "
                                  "per 32 values (llama.cpp's CPU math), float32 only",
                                  ("torch",), needs_gguf=True),
    "int8": QuantizationMethod("weight-only int8, per-output-feature scales",
                               ("torch", "jax")),
    "int4": QuantizationMethod("weight-only int4, asymmetric groups of 32", ("torch",)),
}
QUANTIZATION_CHOICES = ("auto", *QUANTIZATION_METHODS)


def resolve_quantization(name: str, *, backend: str, device_type: str, compile: bool,
                         is_gguf: bool, dtype: str = "bfloat16",
                         f32_kernels: bool = False) -> str:
    """The runner's `quantization` for `--quantization name`: a method name, or "auto" when
    gguf can run and the runner is to use it if its weights are the file's blocks. ValueError
    naming the conflict when the combination cannot run.

    `auto` needs bfloat16 activations, or float32 ones with `f32_kernels` (the compiled block
    kernels load): with float32 activations (CPUs without AMX, where `--dtype auto` is
    float32) torch's int4 op measured ~8x slower than a float32 dense GEMV (AVX2, decode rows),
    the compiled kernels several times faster (docs/quantization.md). `gguf-a8` needs
    float32 activations and `f32_kernels`."""
    if name == "auto":
        fast = dtype == "bfloat16" or (dtype == "float32" and f32_kernels)
        ok = backend == "torch" and device_type == "cpu" and not compile and is_gguf and fast
        return "auto" if ok else "none"
    method = QUANTIZATION_METHODS.get(name)
    if method is None:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {name!r}")
    if name == "none":
        return name
    if backend not in method.backends:
        raise ValueError(f"--quantization {name} is implemented for --backend "
                         f"{'/'.join(method.backends)}, not {backend}")
    if backend == "torch" and device_type != "cpu":
        raise ValueError(f"--quantization {name} uses PyTorch CPU kernels; device is "
                         f"{device_type}")
    if backend == "torch" and compile:
        raise ValueError(f"--quantization {name} runs eagerly; use --torch-compile off")
    if method.needs_gguf and not is_gguf:
        raise ValueError(f"--quantization {name} needs a GGUF checkpoint (use int8 or int4 "
                         f"for other formats)")
    if name == "gguf-a8" and dtype != "float32":
        raise ValueError(f"--quantization gguf-a8 quantizes float32 activations; --dtype "
                         f"resolved to {dtype} (use --dtype float32, or gguf with bfloat16)")
    if name == "gguf-a8" and not f32_kernels:
        raise ValueError("--quantization gguf-a8 needs the compiled quantized CPU GEMM, which "
                         "is not built for this source and machine: build it with `make "
                         "install` (or `python -m sgl_tpu.backends.torch.kernels.cpu_extension`)")
    return name
