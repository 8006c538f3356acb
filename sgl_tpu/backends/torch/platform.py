"""The torch backend's answers to every `auto` runner setting, from the server's arguments and
this machine; the registry asks them by module name while it builds the one RunnerConfig
(sgl_tpu/executor/registry.py `runner_config`), and nothing downstream changes it.

    device_type         --device auto: tpu (TorchTPU) > cuda > cpu (device.py)
    default_dtype       --dtype auto: bfloat16 on accelerators and CPUs with AMX, else float32
    compile_default     --torch-compile auto: eager on CPU (oneDNN-prepacked bf16 weights
                        measured faster than inductor's graphs), compiled on accelerators
    overlap_default     --overlap-schedule auto: on for accelerators
    f32_quant_kernels   whether float32 activations get the compiled block kernels
    cuda_graphs         whether the static decode step runs as CUDA graphs here
"""

from __future__ import annotations

from sgl_tpu.backends.torch import device
from sgl_tpu.config import ServerArgs


def device_type(args: ServerArgs) -> str:
    return device.resolve_device(args.device).type


def default_dtype(args: ServerArgs) -> str:
    return device.default_dtype(args.device)


def compile_default(args: ServerArgs) -> bool:
    return device_type(args) != "cpu"


def overlap_default(args: ServerArgs) -> bool:
    return device_type(args) != "cpu"


def f32_quant_kernels() -> bool:
    from sgl_tpu.backends.torch.quant_linear import f32_kernels_available

    return f32_kernels_available()


def cuda_graphs(args: ServerArgs) -> bool:
    return device_type(args) == "cuda"
