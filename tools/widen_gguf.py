"""A widened copy of a Llama-architecture GGUF: F times the hidden size, heads, KV heads and FFN
units (or any larger FFN size), with every added weight zero, so it computes the source model's
logits with about F^2 times its weights (model size as a benchmark axis at real sizes, without
new weights).

    python tools/widen_gguf.py OUT.gguf --factor F [--ffn-size N] [--model-path M]
        M (default: the default model) ──► OUT.gguf: the same layers, vocabulary, tokenizer
        and metadata; embedding_length, head_count, head_count_kv x F, feed_forward_length
        N (default: F x the source's; a multiple of the block size, 32)

The default model (hidden 576, 9 heads, 3 KV heads, FFN 1,536) with --factor 3 --ffn-size
6912 is the 1.4B-class model: 27 heads, 9 KV heads, hidden 1,728, FFN 6,912 (4 x hidden, the
common Llama ratio), 30 layers, Q4_1 blocks, Q8_0 embedding; 10x the default's weights.

Each tensor is the source tensor in its top-left corner and zeros elsewhere (GGUF's ne[0] is
the input dimension, stored innermost; rows are output units):

    attn_q.weight [D, H*hd] -> [F*D, F*H*hd]     rows: heads 0..H-1 as stored, then zero heads
    ┌────────────┬──────────────────┐           columns: hidden 0..D-1, then zero dims
    │ source     │ 0                │
    ├────────────┼──────────────────┤
    │ 0          │ 0                │
    └────────────┴──────────────────┘

Why the logits do not change:
  - hidden dims D.. are zero in the embedding, and every matrix writing into them has zero rows,
    so the residual stream stays [x, 0]; every matrix reading them has zero columns.
  - added query heads have zero Q, K and V rows, hence a zero output, and zero columns in
    attn_output. Original heads come first, so head i still reads KV head i // (H / KV): the
    group size (F*H) / (F*KV) is unchanged. head_dim is unchanged (so the attention scale and
    RoPE are), and llama.cpp's per-head Q/K row permutation keeps a head's rows in place.
  - added FFN units (any number) have zero gate and up rows: silu(0) * 0 = 0, and zero down
    columns.
  - RMSNorm: the mean of squares over F*D values, (F-1)*D of them zero, is mean(x^2) / F, so
    x / sqrt(mean(x^2) / F + eps') = sqrt(F) * x / sqrt(mean(x^2) + F * eps'). Every norm
    weight is scaled by 1/sqrt(F) and the epsilon stored as eps / F, so eps' * F = eps: the same
    function (up to float32 rounding of w/sqrt(F) and eps/F). Without the epsilon change the
    effective epsilon would be F * eps (3e-5 for 1e-5 at F=3).
  - a widened model sums more (zero) terms per dot product, so float32 logits differ from the
    source's by summation order only: 7e-5 at most on the default model's logits (up to ~30)
    at F=2, against 2e-2 with the epsilon left unchanged (tests/test_widen_gguf.py).

Quantized tensors are copied block by block: a row's blocks (32 values each for Q4_0, Q4_1,
Q8_0) stay bit-exact, and the added blocks are zero bytes (scale 0, min 0: value 0). Every
block type present is checked to dequantize its all-zero block to zeros first; F32/F16 tensors
are zero-padded. Nothing is requantized.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "llama"
# GGUF tensor name (per layer: after "blk.{i}.") -> kind of each ne dimension (ne[0] first):
# D hidden, Q query heads * head_dim, KV KV heads * head_dim, FF FFN units (all widened);
# V vocabulary, R rope frequencies (kept).
_TENSOR_DIMS: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("D", "V"), "output.weight": ("D", "V"),
    "output_norm.weight": ("D",), "rope_freqs.weight": ("R",),
    "attn_norm.weight": ("D",), "ffn_norm.weight": ("D",),
    "attn_q.weight": ("D", "Q"), "attn_k.weight": ("D", "KV"), "attn_v.weight": ("D", "KV"),
    "attn_output.weight": ("Q", "D"),
    "attn_q.bias": ("Q",), "attn_k.bias": ("KV",), "attn_v.bias": ("KV",),
    "ffn_gate.weight": ("D", "FF"), "ffn_up.weight": ("D", "FF"), "ffn_down.weight": ("FF", "D"),
}
_NORMS = {"output_norm.weight", "attn_norm.weight", "ffn_norm.weight"}
# metadata keys (after "llama.") multiplied by F (feed_forward_length: set to the FFN size)
_SCALED_KEYS = ("embedding_length", "attention.head_count", "attention.head_count_kv")
_EPS_KEY = "attention.layer_norm_rms_epsilon"


def _suffix(name: str) -> str:
    """Per-layer tensor names lose their "blk.{i}." prefix."""
    prefix, _, rest = name.partition(".")
    if prefix == "blk":
        return rest.partition(".")[2]
    return name


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _dims(fields: dict[str, Any], path: Path) -> dict[str, int]:
    """Sizes of the dimension kinds from the source's metadata."""
    def scalar(key: str, default: Any = None) -> Any:
        field = fields.get(f"{ARCH}.{key}")
        if field is None:
            if default is None:
                raise ValueError(f"{path}: GGUF metadata lacks {ARCH}.{key!r}")
            return default
        value = field.contents()
        if isinstance(value, list):
            raise ValueError(f"{path}: per-layer {ARCH}.{key!r} is not supported")
        return int(value)

    hidden = scalar("embedding_length")
    heads = scalar("attention.head_count")
    kv_heads = scalar("attention.head_count_kv", heads)
    key_len = scalar("attention.key_length", hidden // heads)
    value_len = scalar("attention.value_length", key_len)
    if value_len != key_len:
        raise ValueError(f"{path}: key_length {key_len} != value_length {value_len}")
    return {"D": hidden, "Q": heads * key_len, "KV": kv_heads * key_len,
            "FF": scalar("feed_forward_length")}


def _zero_blocks_are_zero(qtype: Any) -> bool:
    """Whether an all-zero block of `qtype` dequantizes to zeros (true of the Q and K types:
    their scales are then 0), so padding with zero bytes adds zero weights."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        values = gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return values.size == block_size and not np.any(values)


def _widen_tensor(tensor: Any, kinds: tuple[str, ...], dims: dict[str, int],
                  new_dims: dict[str, int], factor: int, is_norm: bool, path: Path
                  ) -> tuple[np.ndarray, Any]:
    """The widened tensor as rows of bytes (numpy shape [rows, row_bytes], uint8) + its type.

    A row (ne[0] values) is a whole number of blocks, so padding rows with zero bytes and
    adding zero rows never splits a block."""
    import gguf

    qtype = tensor.tensor_type
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    ne = [int(n) for n in tensor.shape]
    if len(ne) != len(kinds):
        raise ValueError(f"{path}: tensor {tensor.name!r} has {len(ne)} dimensions, "
                         f"expected {len(kinds)}")
    for n, kind in zip(ne, kinds, strict=True):
        if kind in dims and n != dims[kind]:
            raise ValueError(f"{path}: tensor {tensor.name!r} has ne {ne}; its {kind} "
                             f"dimension should be {dims[kind]} by the metadata")
    new_ne = [new_dims.get(kind, n) for n, kind in zip(ne, kinds, strict=True)]
    if new_ne[0] % block_size:
        raise ValueError(f"{path}: {tensor.name!r} rows of {new_ne[0]} values are not whole "
                         f"{qtype.name} blocks of {block_size}")
    rows, new_rows = math.prod(ne[1:]), math.prod(new_ne[1:])
    src = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)  # [rows, bytes]
    if is_norm:  # the RMS over F*D values is 1/sqrt(F) of the RMS over D
        if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"{path}: norm {tensor.name!r} is {qtype.name}, not F32/F16")
        dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
        scaled = src.view(dtype).astype(np.float32) / np.float32(math.sqrt(factor))
        src = scaled.astype(dtype).view(np.uint8)
    out = np.zeros((new_rows, new_ne[0] // block_size * type_size), np.uint8)
    out[:rows, : src.shape[1]] = src
    return out.reshape([*reversed(new_ne[1:]), -1]), qtype  # numpy order: ne reversed


def widen_gguf(src_path: str | Path, out_path: str | Path, factor: int,
               ffn_size: int | None = None) -> dict[str, int]:
    """Write `src_path` widened `factor` times (FFN: `ffn_size` units, default `factor` times
    the source's) to `out_path`; returns the new sizes by dimension kind."""
    import gguf

    factor = _check_int("factor", factor, 1)
    src_path, out_path = Path(src_path), Path(out_path)
    if out_path.resolve() == src_path.resolve():
        raise ValueError(f"{out_path}: the output would overwrite the source")
    reader = gguf.GGUFReader(src_path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != ARCH:
        raise ValueError(f"{src_path}: architecture {arch!r}; only {ARCH!r} GGUFs are widened")
    dims = _dims(reader.fields, src_path)
    new_dims = {kind: n * factor for kind, n in dims.items()}
    if ffn_size is not None:
        new_dims["FF"] = _check_int("ffn_size", ffn_size, dims["FF"])

    partial = out_path.with_name(out_path.name + ".partial")  # renamed once complete
    writer = gguf.GGUFWriter(partial, arch=ARCH)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue  # the writer writes these itself
        value = field.contents()
        short = key.removeprefix(f"{ARCH}.")
        if short == "feed_forward_length":
            value = new_dims["FF"]
        elif short in _SCALED_KEYS:
            value *= factor
        elif short == _EPS_KEY:
            value /= factor
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)

    checked: set[Any] = set()
    for tensor in reader.tensors:
        suffix = _suffix(tensor.name)
        kinds = _TENSOR_DIMS.get(suffix)
        if kinds is None:
            raise ValueError(f"{src_path}: tensor {tensor.name!r} is not one a dense llama "
                             f"model has; cannot widen it")
        if tensor.tensor_type not in checked:
            if not _zero_blocks_are_zero(tensor.tensor_type):
                raise ValueError(f"{src_path}: {tensor.tensor_type.name} blocks of zero bytes "
                                 f"are not zero weights; cannot pad {tensor.name!r}")
            checked.add(tensor.tensor_type)
        data, qtype = _widen_tensor(tensor, kinds, dims, new_dims, factor, suffix in _NORMS,
                                    src_path)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out_path)
    return new_dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the widened GGUF to write")
    parser.add_argument("--factor", type=int, required=True,
                        help="width factor F (integer >= 1): hidden, heads, KV heads, FFN x F")
    parser.add_argument("--ffn-size", type=int, default=None,
                        help="FFN units (feed_forward_length) of the widened model; default: "
                             "F x the source's; at least the source's, a multiple of 32")
    parser.add_argument("--model-path", default=None,
                        help="source GGUF (llama architecture); default: the default model")
    args = parser.parse_args(argv)
    from sgl_tpu.loader.default_model import default_model_path

    src = args.model_path or default_model_path()
    start = time.perf_counter()
    try:
        dims = widen_gguf(src, args.out, args.factor, args.ffn_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: hidden {dims['D']}, FFN {dims['FF']}, {size / 1e9:.2f} GB "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
