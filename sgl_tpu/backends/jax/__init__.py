"""The JAX executor backend: runner, ForwardBatch packing, the in-jit sampler, decode state,
models, the device mesh and its sharded ops, multi-host launch (XLA: TPU, GPU, CPU)."""
