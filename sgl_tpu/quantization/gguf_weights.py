"""A GGUF file's projection matrices in their stored quantized form, under the canonical names
of the fused torch weights (the dense loader dequantizes the same tensors; see loader/).

    file.gguf ──gguf_tensors (memory-mapped)──► blk.{i}.attn_q.weight  u8[N, K/32 * bytes] Q4_1
              ──blocks.decode_gguf_blocks──► Int4Groups / Int8Groups  [N, K]
              ──Q/K rows un-permuted (llama arch, as the dense loader)──► fused along N:

    {"layers.{i}.wqkv": wq|wk|wv, "layers.{i}.wo", "layers.{i}.w_gate_up": gate|up,
     "layers.{i}.w_down", "lm_head": output (or token_embd when the head is tied) [V, D]}

A projection whose parts are not all in a block format with an exact quantized form (float
tensors, K-quants but Q4_K, or an 8-bit format (Q8_0, Q5_0) next to a 4-bit one in one fused
matrix) is left out: it stays dense.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sgl_tpu.loader.gguf_loader import unpermute_qk
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.registry import get_model_spec
from sgl_tpu.quantization.blocks import (
    GGUF_BLOCKS,
    QuantizedMatrix,
    concat_rows,
    decode_gguf_blocks,
    rows,
)
from sgl_tpu.quantization.gguf_tensors import GGUFTensor, read_gguf_tensors

HEAD = "lm_head"  # the vocabulary head's key (a [V, D] matrix like the torch weight)

# canonical fused name -> the GGUF per-layer tensors stacked along N, in order
FUSED = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w_gate_up": ("ffn_gate", "ffn_up"),
    "w_down": ("ffn_down",),
}


def read_gguf_quantized(path: str | Path, cfg: ModelConfig) -> dict[str, QuantizedMatrix]:
    """The exactly representable fused projections of the GGUF at `path` (see module doc)."""
    tensors = read_gguf_tensors(path)
    permuted = get_model_spec(cfg.arch).gguf_permuted_qk
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    out: dict[str, QuantizedMatrix] = {}
    for i in range(cfg.num_layers):
        for fused, parts in FUSED.items():
            mats = []
            for part in parts:
                t = tensors.get(f"blk.{i}.{part}.weight")
                m = _decoded(t)
                if m is None:
                    break
                if permuted and part in heads:
                    m = rows(m, unpermute_qk(np.arange(t.dims[1]), heads[part]))
                mats.append(m)
            else:
                stacked = concat_rows(mats)
                if stacked is not None:
                    out[f"layers.{i}.{fused}"] = stacked
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if (m := _decoded(head)) is not None:
        out[HEAD] = m
    return out


def _decoded(t: GGUFTensor | None) -> QuantizedMatrix | None:
    """A tensor's exact quantized form; None for a float tensor, another type, or blocks
    without one (blocks.py)."""
    if t is None or t.type_name not in GGUF_BLOCKS:
        return None
    try:
        return decode_gguf_blocks(t.type_name, t.rows(), t.dims[0])
    except ValueError:
        return None
