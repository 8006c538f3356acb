"""The executor backends, one home each; nothing outside a home imports its framework:

    jax/     JAX (XLA: TPU, GPU, CPU): runner, ForwardBatch packing, in-jit sampler, decode
             state, the models' forward functions, attention (attention.py over the kernels
             of sgl_tpu.kernels and the gathered GPU path), the device mesh and its sharded
             ops, multi-host launch
    torch/   PyTorch (TorchTPU, CUDA, CPU): runner, sampler, decode state and the static
             (CUDA-graph) step, the models' modules, attention (attention.py over
             paged_attention.py), quantized linears, tensor parallelism over
             torch.distributed, and the Python side of the compiled CPU kernels

The neutral core (scheduler, cache, `sgl_tpu.executor.step` contract, registries) reaches a
home only by module name, through `sgl_tpu.executor.registry`, `sgl_tpu.models.registry` and
`sgl_tpu.executor.attention_registry`; the homes never import each other, and `sgl_tpu.kernels`
never imports a home (tests/test_layering.py).
"""
