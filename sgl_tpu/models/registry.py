"""Registry of model architectures: name -> where each backend's implementation lives and what
the loaders must know. Import-light (module names only): nothing here loads JAX or torch.

    ModelConfig.arch ──MODELS[arch]──► jax_module   forward(params, kv_pools, fb, cfg, mode, *,
                                                     kv_tile, attention_backend) -> (hidden,
                                                     pools); compute_logits(params, hidden, cfg)
                                      torch_module  build_model(params, cfg, dtype, device,
                                                     prepack, compile_fn, quantize) -> model with
                                                     forward(...), logits(hidden), scale
                                      loader hooks  HF `architectures` entry, GGUF Q/K row
                                                     permutation, fixed per-family flags

Adding an architecture: its JAX and torch modules (or an existing pair reading new ModelConfig
flags) and one entry here; loaders, runners and the CLI read the registry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class ModelSpec:
    hf_architecture: str  # config.json "architectures" entry for this model_type
    jax_module: str
    torch_module: str
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows (undo on load)
    qkv_bias: bool = False  # bias on q/k/v projections whatever config.json says (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    hf_model_type: str | None = None  # config.json "model_type" when it differs from the arch
    # a module with the family's own config parsing and tensor names (see loader/gemma.py)
    loader_hooks: str | None = None
    moe: bool = False  # mixture-of-experts MLPs (backends/jax/models/moe.py)
    gguf_arch: str | None = None  # general.architecture in GGUF files, if not the name here


_JAX, _TORCH = "sgl_tpu.backends.jax.models", "sgl_tpu.backends.torch.models"
_LLAMA_JAX, _LLAMA_TORCH = f"{_JAX}.llama", f"{_TORCH}.llama"
_GEMMA_JAX, _GEMMA_TORCH = f"{_JAX}.gemma", f"{_TORCH}.gemma"
_GEMMA_HOOKS = "sgl_tpu.loader.gemma"
_MOE_JAX, _MOE_TORCH = f"{_JAX}.moe", f"{_TORCH}.moe"

MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec("LlamaForCausalLM", _LLAMA_JAX, _LLAMA_TORCH, gguf_permuted_qk=True),
    "qwen2": ModelSpec("Qwen2ForCausalLM", _LLAMA_JAX, _LLAMA_TORCH, qkv_bias=True),
    "qwen3": ModelSpec("Qwen3ForCausalLM", _LLAMA_JAX, _LLAMA_TORCH, qk_norm=True),
    "gemma2": ModelSpec("Gemma2ForCausalLM", _GEMMA_JAX, _GEMMA_TORCH, loader_hooks=_GEMMA_HOOKS),
    "gemma3": ModelSpec("Gemma3ForCausalLM", _GEMMA_JAX, _GEMMA_TORCH, qk_norm=True,
                        hf_model_type="gemma3_text", loader_hooks=_GEMMA_HOOKS),
    # sliding-window attention (ModelConfig.sliding_window); llama.cpp writes it as "llama"
    "mistral": ModelSpec("MistralForCausalLM", _LLAMA_JAX, _LLAMA_TORCH, gguf_permuted_qk=True,
                         gguf_arch="llama"),
    # fused qkv / gate-up tensors split by the HF loader; LongRoPE (ModelConfig.long_rope)
    "phi3": ModelSpec("Phi3ForCausalLM", _LLAMA_JAX, _LLAMA_TORCH),
    # routed experts plus a gated shared expert (ModelConfig.shared_expert_intermediate_size)
    "qwen2_moe": ModelSpec("Qwen2MoeForCausalLM", _MOE_JAX, _MOE_TORCH, qkv_bias=True, moe=True,
                           gguf_arch="qwen2moe"),
    "qwen3_moe": ModelSpec("Qwen3MoeForCausalLM", _MOE_JAX, _MOE_TORCH, qk_norm=True, moe=True,
                           gguf_arch="qwen3moe"),
    # llama.cpp writes Mixtral as a "llama" file with expert tensors
    "mixtral": ModelSpec("MixtralForCausalLM", _MOE_JAX, _MOE_TORCH, gguf_permuted_qk=True,
                         moe=True, gguf_arch="llama"),
}


def get_model_spec(arch: str) -> ModelSpec:
    spec = MODELS.get(arch)
    if spec is None:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(MODELS)}")
    return spec


def arch_for_gguf(gguf_arch: str, has_experts: bool) -> str | None:
    """Registry name of a GGUF file's `general.architecture` (None if unsupported); a "llama"
    file with expert tensors is Mixtral, without them Llama (Mistral files read as Llama)."""
    for name, spec in MODELS.items():
        if (spec.gguf_arch or name) == gguf_arch and spec.moe == has_experts:
            return name
    return None


def jax_model(arch: str) -> ModuleType:
    return importlib.import_module(get_model_spec(arch).jax_module)


def loader_hooks(arch: str) -> ModuleType | None:
    """The family's loader module (`ModelSpec.loader_hooks`), or None for Llama-shaped ones."""
    name = get_model_spec(arch).loader_hooks
    return None if name is None else importlib.import_module(name)


def torch_model(arch: str) -> ModuleType:
    return importlib.import_module(get_model_spec(arch).torch_module)
