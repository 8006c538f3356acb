"""The PyTorch executor backend: runner, sampler, decode state, device choices (TorchTPU, CUDA,
CPU), models, quantized linears, tensor parallelism and the compiled CPU kernels' Python side.

OpenMP threads' waiting is set here, before any module of the home imports torch: libgomp reads
it once, when torch first loads (sgl_tpu/executor/omp_wait.py).
"""

from sgl_tpu.executor.omp_wait import configure as _configure_omp_wait

_configure_omp_wait()
