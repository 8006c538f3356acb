"""The PyTorch executor backend: runner, sampler and device choices (TorchTPU, CUDA, CPU); never
imports JAX."""
