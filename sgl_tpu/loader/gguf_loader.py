"""GGUF file -> (ModelConfig, canonical float32 params, Tokenizer), with an on-disk cache.

    file.gguf --GGUFReader (~4 s)--> metadata + quantized tensors
              --gguf.quants.dequantize (~1.5 s)--> float32 (out, in)
              --un-permute Q/K (llama arch only), transpose--> canonical (in, out)
              --write once--> $SGL_TPU_CACHE_DIR/gguf/<stem>-<key>/{meta.json, <name>.npy}

The cache key hashes the resolved path, size, mtime and LOADER_VERSION, so an edited file or a
loader change misses. A hit reads meta.json (config + tokenizer.json string) and memory-maps the
.npy files (read-only `np.memmap`), which takes well under a second. The cache is best effort:
an unwritable directory only logs a warning.

Q/K rows: llama.cpp's converter permutes the rows of Q and K (weights and biases) of llama-arch
models from HF's rotate-half order into interleaved-pair order; qwen2/qwen3 models are written
unpermuted (their converter classes derive from TextModel, not LlamaModel, and transformers'
GGUF loader un-permutes only "llama"). We undo the permutation so the model uses HF's RoPE.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from sgl_tpu.loader.loaded import Params, check_params
from sgl_tpu.loader.spm_tokenizer import build_spm_backend
from sgl_tpu.loader.tokenizer import Tokenizer, build_gguf_backend
from sgl_tpu.models.config import GemmaConfig, ModelConfig, RopeScaling
from sgl_tpu.models.registry import MODELS, arch_for_gguf, get_model_spec, loader_hooks

logger = logging.getLogger(__name__)

LOADER_VERSION = 1
GGUF_MAGIC = b"GGUF"

# GGUF per-layer tensor name (after "blk.{i}.") -> canonical per-layer param name.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    # mixture of experts: router [E, D] and experts stacked [E, out, in] (numpy order)
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "w_gate_exps",
    "ffn_up_exps.weight": "w_up_exps", "ffn_down_exps.weight": "w_down_exps",
    "ffn_gate_shexp.weight": "w_gate_shexp", "ffn_up_shexp.weight": "w_up_shexp",
    "ffn_down_shexp.weight": "w_down_shexp", "ffn_gate_inp_shexp.weight": "shexp_gate",
}
_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                "output.weight": "lm_head"}
_ROPE_FREQS = "rope_freqs.weight"

_MISSING = object()


def cache_root() -> Path:
    """Root of the weight cache: $SGL_TPU_CACHE_DIR, else ~/.cache/sgl_tpu."""
    env = os.environ.get("SGL_TPU_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sgl_tpu"


def cache_entry_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{LOADER_VERSION}"
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` on Q/K rows: interleaved pairs -> HF rotate-half halves.

    Row r = h * head_dim + 2 * i + j (llama.cpp) goes to h * head_dim + j * head_dim / 2 + i.
    """
    d_out = w.shape[0]
    return (w.reshape(n_heads, d_out // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def load_gguf(path: str | Path) -> tuple[ModelConfig, Params, Tokenizer]:
    """Load a GGUF of a registry architecture, from the cache when possible."""
    path = Path(path).resolve()
    if not is_gguf_file(path):
        raise ValueError(f"{path}: not a GGUF file (does not start with b'GGUF')")
    entry = cache_entry_dir(path)
    cached = _read_cache(entry)
    if cached is not None:
        return cached
    config, params, tokenizer = _load_uncached(path)
    _write_cache(entry, config, params, tokenizer, source=str(path))
    return config, params, tokenizer


# ---------------------------------------------------------------- reading the file


class _Fields:
    """Typed access to GGUF metadata with errors that name the file and key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"{self._path}: GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def scalar(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if isinstance(value, list):
            raise ValueError(f"{self._path}: per-layer {key!r} is not supported")
        return value


def _load_uncached(path: Path) -> tuple[ModelConfig, Params, Tokenizer]:
    import gguf  # imported here: only a cache miss needs it

    reader = gguf.GGUFReader(path)
    fields = _Fields(reader, path)
    file_arch = fields.get("general.architecture")
    arch = arch_for_gguf(file_arch, has_experts=bool(fields.scalar(f"{file_arch}.expert_count",
                                                                     0)))
    if arch is None:
        supported = sorted({spec.gguf_arch or name for name, spec in MODELS.items()})
        raise ValueError(
            f"{path}: unsupported GGUF architecture {file_arch!r}; "
            f"supported: {', '.join(supported)}"
        )
    meta = file_arch  # metadata keys carry the file's architecture name
    scaling_type = fields.get(f"{meta}.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise ValueError(f"{path}: unsupported rope scaling type {scaling_type!r} in GGUF")

    tensors = {t.name: t for t in reader.tensors}
    hooks = loader_hooks(arch)  # a family's own names and conversions (Gemma), else None
    layer_names = {**_LAYER_TENSORS, **(hooks.GGUF_LAYER_TENSORS if hooks else {})}
    num_heads = fields.scalar(f"{meta}.attention.head_count")
    num_kv_heads = fields.scalar(f"{meta}.attention.head_count_kv", num_heads)
    hidden = fields.scalar(f"{meta}.embedding_length")
    head_dim = fields.scalar(f"{meta}.attention.key_length", hidden // num_heads)
    rope_dim = fields.scalar(f"{meta}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary (rope dim {rope_dim} != head_dim {head_dim})")
    rope_theta = _f32_to_float(fields.scalar(f"{meta}.rope.freq_base", 10000.0))

    def dequant(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported quantization type {t.tensor_type.name}"
            ) from e
        return np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])

    tokenizer = _gguf_tokenizer(fields)
    rope_scaling = None
    if _ROPE_FREQS in tensors:
        rope_scaling = _llama3_scaling_from_freqs(dequant(_ROPE_FREQS), rope_theta, head_dim, path)
    embed_rows = int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else 0
    eos_ids = list(tokenizer.eos_token_ids)
    config = ModelConfig(
        arch=arch,
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=fields.scalar(f"{meta}.feed_forward_length"),
        num_layers=fields.scalar(f"{meta}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=_f32_to_float(fields.scalar(f"{meta}.attention.layer_norm_rms_epsilon")),
        context_len=fields.scalar(f"{meta}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(eos_ids),
        **_moe_fields(fields, meta, tensors, arch),
    )
    if hooks is not None:
        config = dataclasses.replace(config, gemma=hooks.gemma_from_gguf(
            arch, fields.scalar, config.num_layers, rope_theta, head_dim))

    params: Params = {"layers": [{} for _ in range(config.num_layers)]}
    permuted = get_model_spec(arch).gguf_permuted_qk
    for name in tensors:
        if name == _ROPE_FREQS:
            continue
        layer_idx, target = _canonical_name(name, path, layer_names)
        w = dequant(name)
        if hooks is not None:
            w = hooks.from_gguf(target, w)
        if permuted and target in ("wq", "bq"):
            w = unpermute_qk(w, num_heads)
        elif permuted and target in ("wk", "bk"):
            w = unpermute_qk(w, num_kv_heads)
        if w.ndim == 2 and target != "embed":
            w = np.ascontiguousarray(w.T)  # (out, in) -> (in, out)
        elif target == "shexp_gate" and w.ndim == 1:  # llama.cpp's shape: [D]
            w = w[:, None]
        elif w.ndim == 3:  # stacked experts (E, out, in) -> (E, in, out)
            w = np.ascontiguousarray(w.transpose(0, 2, 1))
        if layer_idx is None:
            params[target] = w
        elif layer_idx < config.num_layers:
            params["layers"][layer_idx][target] = w
        else:
            raise ValueError(f"{path}: tensor {name!r} beyond block_count {config.num_layers}")
    check_params(config, params, str(path))
    return config, params, tokenizer


def _moe_fields(fields: _Fields, meta: str, tensors: dict, arch: str) -> dict[str, Any]:
    """ModelConfig's expert fields. llama.cpp renormalises the top-k weights of Mixtral and
    Qwen3-MoE files (the released Qwen3-MoE models set norm_topk_prob), unless the file says
    otherwise in `expert_weights_norm`."""
    if not get_model_spec(arch).moe:
        return {}
    num_experts = fields.scalar(f"{meta}.expert_count")
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    if gate is None:
        raise ValueError(f"{meta}: expert_count {num_experts} but no blk.0.ffn_gate_exps")
    return dict(num_experts=num_experts,
                num_experts_per_tok=fields.scalar(f"{meta}.expert_used_count"),
                moe_intermediate_size=int(gate.shape[1]),  # GGUF dims: [D, F, E]
                norm_topk_prob=bool(fields.scalar(f"{meta}.expert_weights_norm",
                                                  arch != "qwen2_moe")),
                shared_expert_intermediate_size=fields.scalar(
                    f"{meta}.expert_shared_feed_forward_length", 0))


def _f32_to_float(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06; keep the short value."""
    return float(str(np.float32(value)))


def _canonical_name(name: str, path: Path, layer_names: dict[str, str]
                    ) -> tuple[int | None, str]:
    if name in _TOP_TENSORS:
        return None, _TOP_TENSORS[name]
    prefix, _, rest = name.partition(".")
    idx, _, suffix = rest.partition(".")
    if prefix == "blk" and idx.isdigit() and suffix in layer_names:
        return int(idx), layer_names[suffix]
    raise ValueError(f"{path}: unexpected tensor {name!r}")


def _gguf_tokenizer(fields: _Fields) -> Tokenizer:
    tokens = fields.get("tokenizer.ggml.tokens")
    bos = fields.scalar("tokenizer.ggml.bos_token_id", None)
    eos = [fields.scalar("tokenizer.ggml.eos_token_id")]
    eot = fields.scalar("tokenizer.ggml.eot_token_id", None)
    if eot is not None:
        eos.append(eot)
    model = fields.get("tokenizer.ggml.model")
    if model == "llama":  # SentencePiece (Gemma)
        backend = build_spm_backend(
            tokens=tokens, token_types=fields.get("tokenizer.ggml.token_type"),
            bos_token_id=bos, add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)))
        return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos,
                         chat_template=fields.get("tokenizer.chat_template", None))
    backend = build_gguf_backend(
        tokenizer_model=model,
        pre=fields.get("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=fields.get("tokenizer.ggml.token_type", [1] * len(tokens)),
        merges=fields.get("tokenizer.ggml.merges"),
        bos_token_id=bos,
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    )
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos,
                     chat_template=fields.get("tokenizer.chat_template", None))


def llama3_rope_factors(scaling: RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores as `rope_freqs.weight` for Llama-3 scaling."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, scaling.factor, mid))


def _llama3_scaling_from_freqs(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: Path
) -> RopeScaling:
    """Recover RopeScaling from `rope_freqs.weight`; llama.cpp keeps only the factors.

    llama.cpp's converter reads low/high freq factors from the HF config (Llama 3.x: 1 and 4) and
    the original context from `hparams["original_max_position_embeddings"]`, which is absent at the
    top level of Llama 3.x configs, so its default 8192 applies. We accept exactly those settings
    (factor = the largest divisor) and verify them against the stored factors.
    """
    candidate = RopeScaling(factor=float(factors.max()), low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192)
    expected = llama3_rope_factors(candidate, rope_theta, head_dim)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5):
        raise ValueError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling")
    return candidate


# ---------------------------------------------------------------- cache


def _flat_arrays(params: Params) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i, lp in enumerate(params["layers"]):
        flat.update({f"layers.{i}.{k}": v for k, v in lp.items()})
    return flat


def _config_from_dict(d: dict[str, Any]) -> ModelConfig:
    scaling = d.get("rope_scaling")
    gemma = d.get("gemma")
    if gemma:
        gemma = GemmaConfig(**{**gemma, "sliding_layers": tuple(gemma["sliding_layers"])})
    return ModelConfig(**{**d, "rope_scaling": RopeScaling(**scaling) if scaling else None,
                          "eos_token_ids": tuple(d["eos_token_ids"]), "gemma": gemma})


def _read_cache(entry: Path) -> tuple[ModelConfig, Params, Tokenizer] | None:
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("loader_version") != LOADER_VERSION:
            return None
        config = _config_from_dict(meta["config"])
        params: Params = {"layers": [{} for _ in range(config.num_layers)]}
        for name in meta["arrays"]:
            arr = np.load(entry / f"{name}.npy", mmap_mode="r")
            if name.startswith("layers."):
                _, idx, key = name.split(".")
                params["layers"][int(idx)][key] = arr
            else:
                params[name] = arr
        check_params(config, params, str(entry))
        tokenizer = Tokenizer.from_dict(meta["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable weight cache %s: %s", entry, e)
        return None
    logger.info("loaded weights from cache %s", entry)
    return config, params, tokenizer


def _write_cache(entry: Path, config: ModelConfig, params: Params, tokenizer: Tokenizer,
                 source: str) -> None:
    """Write into a private temp dir, then rename: readers never see a half-written entry."""
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        flat = _flat_arrays(params)
        for name, arr in flat.items():
            np.save(tmp / f"{name}.npy", arr)
        meta = {
            "loader_version": LOADER_VERSION,
            "source": source,
            "config": dataclasses.asdict(config),
            "tokenizer": tokenizer.to_dict(),
            "arrays": list(flat),
        }
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)  # stale entry (e.g. older loader version)
        os.rename(tmp, entry)
    except OSError as e:
        logger.warning("could not write weight cache %s: %s", entry, e)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
