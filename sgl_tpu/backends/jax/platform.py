"""The JAX backend's answers to every `auto` runner setting, from the server's arguments and the
platform JAX runs on; the registry asks them by module name while it builds the one
RunnerConfig (sgl_tpu/executor/registry.py `runner_config`), and nothing downstream changes it.

    device_type         JAX's default backend: tpu, gpu or cpu
    default_dtype       --dtype auto: float32 on XLA:CPU (its bf16 dots do not use the CPU's
                        bf16 units; measured slower), bfloat16 on TPUs and GPUs
    overlap_default     --overlap-schedule auto: on for accelerators
    decode_state_default  --jax-decode-state auto: on for accelerators, where a step's host ->
                        device copies cost latency; on CPU the packing path measured the same
"""

from __future__ import annotations

import jax

from sgl_tpu.config import ServerArgs


def device_type(args: ServerArgs) -> str:
    return jax.default_backend()


def default_dtype(args: ServerArgs) -> str:
    return "float32" if device_type(args) == "cpu" else "bfloat16"


def overlap_default(args: ServerArgs) -> bool:
    return device_type(args) != "cpu"


def decode_state_default(args: ServerArgs) -> bool:
    return device_type(args) != "cpu"
