"""A random-weight Hugging Face checkpoint of a model's shape: for timing a machine that lacks
the model's weights (an accelerator host without network gets a few MB instead of the model;
the accelerator bench's `host` part runs this script for its minimal model).

    python tools/random_checkpoint.py shape DIR [--model-path M] [--minimal]
        M (default: the default model) ──load──► config.json, generation_config.json,
        tokenizer.json, tokenizer_config.json (chat template, bos/eos) in DIR; no weights
        (--minimal: one decoder layer of width 64, the same vocabulary and tokenizer)
    python tools/random_checkpoint.py weights DIR [--seed 0] [--std 0.02]
        DIR/config.json ──► DIR/model.safetensors: every tensor of that shape, float32,
        N(0, std) (RMSNorm weights 1); kept when DIR already has one

`--model-path DIR` then serves it, with the real model's tokenizer, shapes and step costs (the
text it writes is gibberish). Dense Llama-family shapes only (the default model's); others
are refused by name. A `--minimal` model costs next to nothing per step, so a server of it
measures what the server costs around the model (HTTP, tokenizer, scheduler, detokenizer,
sampling over the real vocabulary): the ceiling of the real model's server on that host.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

WEIGHTS_FILE = "model.safetensors"
# --minimal: the smallest decoder of the family (grouped-query attention kept)
MINIMAL_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def write_shape(out_dir: str | Path, model_path: str | None = None,
                minimal: bool = False) -> Path:
    """Config and tokenizer files of `model_path`'s model (no weights) into out_dir; `minimal`:
    the layers shrunk to `MINIMAL_SHAPE`, vocabulary and tokenizer kept."""
    from tokenizers import Tokenizer

    from sgl_tpu.loader import load_model

    loaded = load_model(model_path)
    cfg, tok = loaded.config, loaded.tokenizer
    unsupported = [name for name, on in (
        (f"architecture {cfg.arch!r}", cfg.arch != "llama"),
        ("rope scaling", cfg.rope_scaling is not None or cfg.long_rope is not None),
        ("attention bias", cfg.attention_bias), ("q/k norm", cfg.qk_norm),
        ("experts", cfg.num_experts > 0), ("sliding window", cfg.sliding_window is not None),
    ) if on]
    if unsupported:
        raise ValueError(f"{loaded.model_path}: random checkpoints are of dense Llama-family "
                         f"shapes; this model has {', '.join(unsupported)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = list(cfg.eos_token_ids)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.context_len,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
    }
    if minimal:
        config.update(MINIMAL_SHAPE)
    backend_json = tok.to_dict()["backend"]
    backend = Tokenizer.from_str(backend_json)
    tok_config = {"chat_template": tok.chat_template, "eos_token": backend.id_to_token(eos[0])}
    if tok.bos_token_id is not None:
        tok_config["bos_token"] = backend.id_to_token(tok.bos_token_id)
    files = {"config.json": config, "generation_config.json": {"eos_token_id": eos},
             "tokenizer_config.json": tok_config}
    for name, body in files.items():
        (out / name).write_text(json.dumps(body, indent=1), encoding="utf-8")
    (out / "tokenizer.json").write_text(backend_json, encoding="utf-8")
    return out


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names -> shapes of a config.json."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": s for name, s in layer.items()})
    return shapes


def write_weights(model_dir: str | Path, seed: int = 0, std: float = 0.02) -> Path:
    """DIR/model.safetensors of DIR/config.json's shapes (kept if present); -> its path."""
    from safetensors.numpy import save_file

    model_dir = Path(model_dir)
    path = model_dir / WEIGHTS_FILE
    if path.exists():
        return path
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = rng.standard_normal(shape, np.float32) * np.float32(std)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)  # a killed write leaves no half file behind that `weights` would keep
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    shape = sub.add_parser("shape", help="config + tokenizer files of a model, no weights")
    shape.add_argument("out_dir")
    shape.add_argument("--model-path", default=None)
    shape.add_argument("--minimal", action="store_true",
                       help="one layer of width 64 (same vocabulary and tokenizer)")
    weights = sub.add_parser("weights", help="random weights for DIR/config.json")
    weights.add_argument("model_dir")
    weights.add_argument("--seed", type=int, default=0)
    weights.add_argument("--std", type=float, default=0.02)
    args = p.parse_args(argv)
    if args.command == "shape":
        print(write_shape(args.out_dir, args.model_path, args.minimal))
    else:
        print(write_weights(args.model_dir, args.seed, args.std))


if __name__ == "__main__":
    main()
