"""The JAX executor backend: runner, ForwardBatch packing and the in-jit sampler (XLA: TPU, GPU,
CPU)."""
