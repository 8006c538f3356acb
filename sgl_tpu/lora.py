"""LoRA adapters: reading a PEFT adapter folder, checked against the served model (numpy only,
no torch or JAX). The torch backend applies them (backends/torch/lora.py); the scheduler keeps
the registry of loaded ones (scheduler/lora_registry.py). docs/lora.md describes the feature.

    folder/adapter_config.json        r, lora_alpha, target_modules, use_rslora, ...
    folder/adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{m}
                                      .lora_A.weight [r, in], .lora_B.weight [out, r]

An adapter's delta on projection m of layer i is  y += (x @ A.T) @ B.T * scaling  with
scaling = lora_alpha / r (lora_alpha / sqrt(r) under use_rslora). Reading folds `scaling` into
B, so a backend adds (x @ A.T) @ B.T.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# PEFT's module names of the Llama family, in the order of the fused projections they feed
# (wqkv = q|k|v, wo, w_gate_up = gate|up, w_down)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoraError(ValueError):
    """An adapter that cannot be served (the API answers 400 with the message)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights: per layer, per module, (A f32[r, in], B f32[out, r] * scaling)."""

    name: str
    path: str
    rank: int
    digest: str  # sha256 of the folder's two files: the adapter's radix-cache namespace
    modules: tuple[str, ...]  # the LORA_MODULES it adapts
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]


def module_shapes(hidden_size: int, intermediate_size: int, q_size: int, kv_size: int
                  ) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LORA_MODULES projection of a model."""
    d, f = hidden_size, intermediate_size
    return {"q_proj": (d, q_size), "k_proj": (d, kv_size), "v_proj": (d, kv_size),
            "o_proj": (q_size, d), "gate_proj": (d, f), "up_proj": (d, f),
            "down_proj": (f, d)}


def parse_lora_paths(entries: tuple[str, ...]) -> list[tuple[str, str]]:
    """--lora-paths entries in SGLang's forms, `NAME=PATH`, a bare `PATH` (named by itself) or
    `{"lora_name": ..., "lora_path": ...}` (its `pinned` accepted: every adapter stays until
    unloaded) -> [(name, path)]; ValueError on an empty name or a name given twice."""
    out: dict[str, str] = {}
    for entry in entries:
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path = spec["lora_name"], spec["lora_path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-paths: {entry!r} is not a JSON object with lora_name "
                                 f"and lora_path") from None
            if not isinstance(name, str) or not isinstance(path, str):
                raise ValueError(f"--lora-paths: {entry!r}: lora_name and lora_path must be "
                                 f"strings")
        else:
            name, sep, path = entry.partition("=")
            name, path = (name, path) if sep else (entry, entry)
        if not name or not path:
            raise ValueError(f"--lora-paths: {entry!r} is not NAME=PATH or PATH")
        if name in out:
            raise ValueError(f"--lora-paths: adapter name {name!r} is given twice")
        out[name] = path
    return list(out.items())


def read_config(path: str | Path) -> dict:
    """The folder's adapter_config.json (LoraError when missing or not an object)."""
    file = Path(path) / "adapter_config.json"
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"{path}: not a PEFT adapter folder (no adapter_config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{path}: adapter_config.json cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: adapter_config.json is not a JSON object")
    return cfg


def read_adapter(name: str, path: str | Path, *, num_layers: int,
                 shapes: dict[str, tuple[int, int]], max_rank: int,
                 target_modules: tuple[str, ...]) -> LoraAdapter:
    """Read and check a PEFT LoRA folder for a model of `num_layers` layers whose projections
    have `shapes` (module_shapes); `target_modules`: the modules the server adapts. LoraError
    naming the problem: no such folder, not LoRA, rank above `max_rank`, a module or layer the
    model lacks, a tensor of the wrong shape."""
    from sgl_tpu.loader.hf_loader import read_safetensors

    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"{path}: no such adapter folder")
    cfg = read_config(folder)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters load")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas"), ("modules_to_save", "saved modules"),
                      ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(key):
            raise LoraError(f"{path}: {what} ({key}) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{path}: bias {cfg['bias']!r} is not supported (only 'none')")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{path}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoraError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraError(f"{path}: no adapter_model.safetensors")
    try:
        tensors = read_safetensors(file)
    except Exception as e:  # a truncated or foreign file
        raise LoraError(f"{path}: adapter_model.safetensors cannot be read: {e}") from None

    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(num_layers)]
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, w in tensors.items():
        # base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
        parts = key.split(".")
        if (len(parts) < 6 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B")
                or "layers" not in parts):
            raise LoraError(f"{path}: unexpected tensor {key!r}")
        i = parts.index("layers")
        module = parts[-3]
        if not parts[i + 1].isdigit() or module not in _PARENT or parts[-4] != _PARENT[module]:
            raise LoraError(f"{path}: tensor {key!r} adapts no projection this model has")
        layer = int(parts[i + 1])
        if layer >= num_layers:
            raise LoraError(f"{path}: tensor {key!r} is past the model's {num_layers} layers")
        pairs.setdefault((layer, module), {})[parts[-2]] = w
    modules = sorted({m for _, m in pairs}, key=LORA_MODULES.index)
    if not modules:
        raise LoraError(f"{path}: adapter_model.safetensors holds no LoRA weights")
    if outside := [m for m in modules if m not in target_modules]:
        raise LoraError(f"{path}: adapts {outside}, outside --lora-target-modules "
                        f"{list(target_modules)}")
    for (layer, module), ab in pairs.items():
        a, b = ab.get("lora_A"), ab.get("lora_B")
        n_in, n_out = shapes[module]
        if a is None or b is None:
            raise LoraError(f"{path}: layer {layer} {module} lacks lora_A or lora_B")
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoraError(f"{path}: layer {layer} {module}: lora_A {list(a.shape)}, lora_B "
                            f"{list(b.shape)}; this model needs [{rank}, {n_in}] and "
                            f"[{n_out}, {rank}]")
        layers[layer][module] = (np.ascontiguousarray(a, np.float32),
                                 np.ascontiguousarray(b * np.float32(scaling), np.float32))
    digest = hashlib.sha256()
    for part in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((folder / part).read_bytes())
    return LoraAdapter(name=name, path=str(path), rank=rank, digest=digest.hexdigest(),
                       modules=tuple(modules), layers=layers)
