"""Hugging Face directory -> (ModelConfig, canonical float32 params, Tokenizer).

    config.json (+ generation_config.json) --> ModelConfig
    *.safetensors --header + np.frombuffer on a memory map--> float32 --transpose--> canonical
    tokenizer.json + tokenizer_config.json (+ chat_template.jinja) --> Tokenizer

Safetensors are parsed here rather than with `safetensors.numpy` because numpy has no bfloat16;
`ml_dtypes.bfloat16` (shipped with jax) reads bf16 tensors without torch; it is imported only
for a file that holds them (its import costs about half a CPU second, and every server process
imports this module for the tokenizer). HF weights are (out, in) with Q/K already in
rotate-half order, so only a transpose is needed.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from sgl_tpu.loader.hf_families import STACKED_EXPERT_TENSORS, canonical_tensors, family_fields
from sgl_tpu.loader.loaded import Params, check_params
from sgl_tpu.loader.tokenizer import Tokenizer, load_hf_tokenizer
from sgl_tpu.models.config import ModelConfig, RopeScaling
from sgl_tpu.models.registry import MODELS, loader_hooks

# config.json model_type -> architectures entry we expect for it.
HF_ARCHS = {spec.hf_model_type or arch: spec.hf_architecture for arch, spec in MODELS.items()}
# config.json model_type -> our arch name (they differ for Gemma 3: "gemma3_text")
_ARCH_OF_MODEL_TYPE = {spec.hf_model_type or arch: arch for arch, spec in MODELS.items()}

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _safetensors_dtype(name: str) -> Any:
    """The numpy dtype of a safetensors dtype name; None if unsupported."""
    if name == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _SAFETENSORS_DTYPES.get(name)

# HF per-layer name (after "model.layers.{i}.") -> canonical per-layer param name.
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    **STACKED_EXPERT_TENSORS,  # MoE families, after hf_families.canonical_tensors
}
_TOP_TENSORS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
                "lm_head.weight": "lm_head"}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from `rope_theta`/`rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "longrope"):  # longrope: hf_families.long_rope_from_hf
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: unsupported rope scaling type {rope_type!r}; supported: llama3, "
            "longrope (phi3)"
        )
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from e


def config_from_hf(cfg: dict[str, Any], gen_cfg: dict[str, Any], tensor_names: set[str],
                   source: str) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHS:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(HF_ARCHS)}"
        )
    archs = cfg.get("architectures") or [HF_ARCHS[model_type]]
    if HF_ARCHS[model_type] not in archs:
        raise ValueError(f"{source}: unsupported architectures {archs}; "
                         f"expected {HF_ARCHS[model_type]} for model_type {model_type!r}")
    hooks = loader_hooks(_ARCH_OF_MODEL_TYPE[model_type])
    if hooks is not None:  # a family with its own config keys (Gemma)
        tied = cfg.get("tie_word_embeddings")
        eos = _as_id_list(gen_cfg.get("eos_token_id")) + _as_id_list(cfg.get("eos_token_id"))
        return hooks.config_from_hf(_ARCH_OF_MODEL_TYPE[model_type], cfg, eos,
                                    "lm_head.weight" not in tensor_names if tied is None
                                    else bool(tied), source)
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise ValueError(f"{source}: only silu MLPs without bias are supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{source}: sliding-window attention is not supported")
    theta, scaling = _rope(cfg, source)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    tied = cfg.get("tie_word_embeddings")
    if tied is None:  # absent: PretrainedConfig's default depends on the class; trust the file
        tied = "lm_head.weight" not in tensor_names
    eos = _as_id_list(gen_cfg.get("eos_token_id")) + _as_id_list(cfg.get("eos_token_id"))
    return ModelConfig(
        arch=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_len=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(tied),
        attention_bias=MODELS[model_type].qkv_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=MODELS[model_type].qk_norm,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        **family_fields(model_type, cfg, source),
    )


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 (bf16/f16 converted, f32 copied)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        (header_len,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8:8 + header_len])
        base = 8 + header_len
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _safetensors_dtype(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            arr = np.frombuffer(mm, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize,
                                offset=base + start)
            out[name] = arr.reshape(info["shape"]).astype(np.float32)  # copies out of the mmap
            del arr
    return out


def load_hf(model_dir: str | Path) -> tuple[ModelConfig, Params, Tokenizer]:
    model_dir = Path(model_dir)
    source = str(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    gen_cfg = _read_json(model_dir / "generation_config.json")
    config = config_from_hf(_read_json(model_dir / "config.json"), gen_cfg, set(tensors), source)
    tensors = canonical_tensors(tensors, config.arch, config.num_heads, config.num_kv_heads,
                                config.head_dim, source)

    hooks = loader_hooks(config.arch)
    layer_names = hooks.HF_LAYER_TENSORS if hooks is not None else _LAYER_TENSORS
    params: Params = {"layers": [{} for _ in range(config.num_layers)]}
    for name, w in tensors.items():
        if name in _TOP_TENSORS:
            target = _TOP_TENSORS[name]
            if target == "lm_head" and config.tie_word_embeddings:
                continue
            params[target] = w if target != "lm_head" else np.ascontiguousarray(w.T)
            continue
        parts = name.split(".", 3)  # model, layers, i, rest
        if (len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and parts[3] in layer_names and int(parts[2]) < config.num_layers):
            w = np.ascontiguousarray(w.T) if w.ndim == 2 else w
            params["layers"][int(parts[2])][layer_names[parts[3]]] = w
        elif "rotary_emb" not in name:
            raise ValueError(f"{source}: unexpected tensor {name!r}")
    check_params(config, params, source)

    tokenizer = load_hf_tokenizer(model_dir, bos_token_id=config.bos_token_id,
                                  eos_token_ids=config.eos_token_ids)
    eos_ids = tuple(dict.fromkeys(tokenizer.eos_token_ids + config.eos_token_ids))
    config = dataclasses.replace(config, eos_token_ids=eos_ids, bos_token_id=tokenizer.bos_token_id)
    return config, params, tokenizer
