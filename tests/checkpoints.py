"""Tiny checkpoints for tests: random transformers models saved as HF directories or GGUF files.

    make_tiny_hf_checkpoint(dir, arch)  -> dir with config.json, model.safetensors,
                                           tokenizer.json, tokenizer_config.json (ChatML)
    make_tiny_gguf(path, arch)          -> path.gguf written the way llama.cpp's converter would
                                           (llama Q/K rows permuted, one Q8_0 tensor), plus its
                                           HF twin at hf_twin_dir(path) holding the same weights

Both share a small byte-level BPE (SmolLM-style digit splitting) trained on a few sentences, with
<|endoftext|>, <|im_start|>, <|im_end|> as ids 0, 1, 2. torch/transformers/gguf are imported inside
the functions so importing this module stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Tokenizers split text into pieces; models read the pieces as integers 0123456789.",
    "JSON looks like {\"name\": \"value\", \"list\": [1, 2, 3]}.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 unicode text \U0001f600 works too.",
] * 4

# HF per-layer suffix -> GGUF per-layer suffix (llama.cpp's tensor names), written out
# independently of the loader's own tables.
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_TO_GGUF_LAYER.update({  # MoE: the router and the experts stacked [E, out, in]
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "experts.gate": "ffn_gate_exps.weight", "experts.up": "ffn_up_exps.weight",
    "experts.down": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
})
# our name -> llama.cpp's
_GGUF_MOE_ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_EXPERT_ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}
Q8_0_TENSOR = "blk.0.ffn_gate.weight"  # written quantized; the HF twin holds its dequantized value


def make_tiny_tokenizer() -> Any:
    """A trained byte-level BPE `tokenizers.Tokenizer` (vocab about 400)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def _build_model(arch: str, vocab_size: int, *, seed: int, tie_word_embeddings: bool,
                 rope_scaling: dict[str, Any] | None, heads: tuple[int, int] | None = None,
                 **overrides: Any) -> Any:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings, bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if heads is not None:
        common.update(num_attention_heads=heads[0], num_key_value_heads=heads[1],
                      hidden_size=16 * heads[0])
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {"rope_theta": 10000.0}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"rope_theta": 1000000.0}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "rope_theta": 1000000.0}),
        # 8 experts, top 2, unnormalised top-k weights (Qwen3-MoE's config default)
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
            "head_dim": 32, "rope_theta": 1000000.0, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        # plus a shared expert behind a sigmoid gate; qkv bias
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {
            "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
        "mixtral": (MixtralConfig, MixtralForCausalLM, {
            "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}),
        # a window shorter than the test prompts, so the mask matters
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
        # LongRoPE with a pretrained context of 64 (longer than the test prompts: HF switches
        # a whole sequence to the long factors past it, we switch per position)
        "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": 0, "rope_scaling": {
            "rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)],
            "original_max_position_embeddings": 64}, "original_max_position_embeddings": 64}),
    }
    if arch not in classes:
        raise ValueError(f"unknown test arch {arch!r}")
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    if heads is not None:
        extra = {**extra, "head_dim": 16}
    model = model_cls(config_cls(**{**common, **extra, **overrides})).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _write_tokenizer_files(out: Path, tok: Any) -> None:
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")


# (arch, make_tiny_hf_checkpoint kwargs) covering every supported family and option: the
# parametrization of the model-parity tests of both backends.
ARCH_CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    ("qwen2", {}),
    ("qwen3", {}),
]
# mixture of experts, sliding window, fused projections + LongRoPE (tests/test_moe.py too)
NEW_ARCH_CASES = [("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}), ("mistral", {}),
                  ("phi3", {})]
ARCH_CASES += NEW_ARCH_CASES


def make_tiny_hf_checkpoint(
    dir: str | Path,
    arch: str,
    *,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    dtype: str = "float32",
    heads: tuple[int, int] | None = None,
    **overrides: Any,
) -> str:
    """Save a tiny random `arch` model (hidden 64, 2 layers, 4 heads, 2 kv heads) into `dir`;
    `heads` = (query heads, KV heads) instead, head_dim 16 and hidden 16 x query heads (e.g.
    (6, 3) for 3-way TP); `overrides` replace fields of its transformers config."""
    import torch

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer()
    model = _build_model(arch, tok.get_vocab_size(), seed=seed,
                         tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling,
                         heads=heads, **overrides)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    _write_tokenizer_files(out, tok)
    return str(out)


def hf_twin_dir(gguf_path: str | Path) -> str:
    """Where make_tiny_gguf puts the HF checkpoint holding the same weights."""
    return str(gguf_path) + ".hf"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows -> interleaved pairs).
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tokenizer_vocab(tok: Any) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, llama.cpp token types, merges as 'a b') of a trained BPE tokenizer."""
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def _stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF expert tensors (per expert, or fused as transformers 5 holds them) ->
    "model.layers.{i}.experts.{role}" stacked [E, out, in]."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in state.items():
        parts = name.split(".")
        if name.endswith("experts.gate_up_proj"):  # transformers 5 in memory: [E, 2F, D]
            base = f"model.layers.{parts[2]}.experts"
            out[f"{base}.gate"], out[f"{base}.up"] = np.split(arr, 2, axis=1)
        elif name.endswith("experts.down_proj"):  # [E, D, F]
            out[f"model.layers.{parts[2]}.experts.down"] = arr
        elif "experts" in parts:
            at = parts.index("experts")
            key = f"model.layers.{parts[2]}.experts.{_EXPERT_ROLES[parts[at + 2]]}"
            stacks.setdefault(key, {})[int(parts[at + 1])] = arr
        else:
            out[name] = arr
    for key, by_index in stacks.items():
        out[key] = np.stack([by_index[j] for j in sorted(by_index)])
    return out


def gguf_tensor_name(hf_name: str, layer_names: dict[str, str]) -> str:
    """llama.cpp's name of the HF tensor `hf_name`: top-level ones from `_HF_TO_GGUF_TOP`,
    per-layer ones `blk.{i}.` + `layer_names[suffix]`."""
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    _, _, idx, suffix = hf_name.split(".", 3)
    return f"blk.{idx}.{layer_names[suffix]}"


def add_gguf_model_shape(w: Any, cfg: Any, head_dim: int) -> None:
    """The shape keys every architecture's GGUF carries (`w`: a `gguf.GGUFWriter`); key and
    value lengths only where `head_dim` is not hidden / heads, as llama.cpp's converter does."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def finish_gguf(w: Any) -> None:
    """Write the header, the metadata and the tensors of `w`, then close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    gguf_arch: str | None = None,
    i8_tensor: str | None = None,
    projection_type: str | None = None,
) -> str:
    """Write a tiny `arch` GGUF at `path` and its HF twin at `hf_twin_dir(path)`.

    For error tests: `gguf_arch` overrides the architecture name written to the file, and the
    tensor named `i8_tensor` is stored as GGML type I8 (which gguf cannot dequantize).
    `projection_type` ("Q4_0", "Q4_1", "Q8_0") stores every q/k/v/o/gate/up/down projection in
    that block format (but `Q8_0_TENSOR`, always Q8_0), as llama.cpp's quantized files do.
    """
    import gguf
    import torch

    path = Path(path)
    tok = make_tiny_tokenizer()
    moe = arch in _GGUF_MOE_ARCHS
    # llama.cpp renormalises Qwen3-MoE's top-k weights (the released models set it too)
    model = _build_model(arch, tok.get_vocab_size(), seed=seed,
                         tie_word_embeddings=tie_word_embeddings, rope_scaling=None,
                         **({"norm_topk_prob": True} if arch == "qwen3_moe" else {}))
    cfg = model.config
    gate = model.model.layers[0].mlp.gate_proj.weight if not moe else None
    q8 = None
    if gate is not None:
        q8 = gguf.quants.quantize(gate.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
        with torch.no_grad():
            gate.copy_(torch.from_numpy(gguf.quants.dequantize(
                q8, gguf.GGMLQuantizationType.Q8_0)))
    blocks: dict[str, np.ndarray] = {}  # HF name -> raw GGUF blocks (HF row order)
    if projection_type is not None:
        qtype = getattr(gguf.GGMLQuantizationType, projection_type)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.weight") and p is not gate:
                    raw = gguf.quants.quantize(p.detach().numpy(), qtype)
                    p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
                    blocks[name] = raw
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)

    twin = Path(hf_twin_dir(path))
    twin.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(twin, safe_serialization=True)
    _write_tokenizer_files(twin, tok)

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), gguf_arch or _GGUF_MOE_ARCHS.get(arch, arch))
    if moe:
        w.add_expert_count(cfg.num_local_experts if arch == "mixtral" else cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch in ("qwen3_moe", "qwen2_moe"):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        state = _stack_experts(state)
    add_gguf_model_shape(w, cfg, head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = tokenizer_vocab(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    for name, arr in state.items():
        arr = blocks.get(name, arr)  # row permutations below apply to block rows alike
        gguf_name = gguf_tensor_name(name, _HF_TO_GGUF_LAYER)
        if arch in ("llama", "mixtral") and ".self_attn.q_proj." in name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch in ("llama", "mixtral") and ".self_attn.k_proj." in name:
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        if gguf_name == i8_tensor:
            w.add_tensor(gguf_name, np.zeros(arr.shape, dtype=np.int8))
        elif gguf_name == Q8_0_TENSOR:
            w.add_tensor(gguf_name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name in blocks:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr))
    finish_gguf(w)
    return str(path)


def truncate_gguf(src: str | Path, dst: str | Path, num_layers: int) -> str:
    """Copy the GGUF at `src` to `dst` with only its first `num_layers` blocks: the tensors
    blk.0 .. blk.{num_layers - 1}, the embedding, the final norm and the head, their blocks
    copied byte for byte, and every metadata field but the block count as it is. The real
    model's weights, tokenizer and shapes at a fraction of its compile and step time, for tests
    whose math does not depend on the depth (tensor-parallel sharding, an attention kernel)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if reader.get_field(block_count).contents() < num_layers:
        raise ValueError(f"{src} has fewer than {num_layers} blocks")
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value = num_layers if field.name == block_count else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < num_layers]
    for t in kept:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data)
    w.close()
    return str(dst)
