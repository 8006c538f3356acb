"""Loader tests: default GGUF facts and weights vs transformers, tiny HF/GGUF checkpoints,
tokenizer, and error messages for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu.loader import LoadedModel, Tokenizer, default_model_path, load_model
from sgl_tpu.loader.gguf_loader import cache_entry_dir
from sgl_tpu.models.config import RopeScaling

# Strings without digit runs (transformers' GGUF tokenizer lacks SmolLM's digit rule).
TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x * two\n\n",
    "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e \U0001f600!",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "it's we'll they've I'm don't",
    '{"key": "value", "list": [true, false, null]}',
]

HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}


def hf_view(name: str, w: np.ndarray) -> np.ndarray:
    """Canonical param -> HF tensor layout ((out, in) for 2-D weights; embed unchanged)."""
    return w.T if w.ndim == 2 and name != "embed" else w


def assert_params_match_state_dict(model: LoadedModel, state: dict[str, np.ndarray]) -> None:
    p = model.params
    np.testing.assert_array_equal(p["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["final_norm"], state["model.norm.weight"])
    if model.config.tie_word_embeddings:
        assert "lm_head" not in p
    else:
        np.testing.assert_array_equal(p["lm_head"].T, state["lm_head.weight"])
    for i, lp in enumerate(p["layers"]):
        for name, w in lp.items():
            np.testing.assert_array_equal(
                hf_view(name, w), state[f"model.layers.{i}.{HF_LAYER_NAMES[name]}"],
                err_msg=f"layer {i} {name}",
            )


def torch_state(model_dir: str) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load_file

    return {k: v.to(torch.float32).numpy() for k, v in
            load_file(str(Path(model_dir) / "model.safetensors")).items()}


# ---------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None)


def test_default_model_facts(default_model: LoadedModel) -> None:
    c = default_model.config
    assert default_model.source_format == "gguf"
    assert default_model.model_path == default_model_path()
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.context_len) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert c.tie_word_embeddings and "lm_head" not in default_model.params
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    tok = default_model.tokenizer
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert tok.chat_end_token == "<|im_end|>"
    assert default_model.params["embed"].dtype == np.float32


def test_default_qk_match_transformers_unpermute(default_model: LoadedModel) -> None:
    """transformers' llama Q/K reverse permutation on gguf's dequantization agrees (fast check)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for layer, name, gguf_name in [(0, "wq", "attn_q"), (0, "wk", "attn_k"), (29, "wq", "attn_q"),
                                   (29, "wk", "attn_k"), (5, "w_up", "ffn_up")]:
        t = tensors[f"blk.{layer}.{gguf_name}.weight"]
        raw = gguf.quants.dequantize(t.data, t.tensor_type)
        want = processor.process(weights=raw, name=t.name).weights
        assert (name in ("wq", "wk")) == (not np.array_equal(want, raw))  # Q/K were permuted
        np.testing.assert_array_equal(default_model.params["layers"][layer][name].T, want)
    t = tensors["token_embd.weight"]
    np.testing.assert_array_equal(default_model.params["embed"],
                                  gguf.quants.dequantize(t.data, t.tensor_type))


@pytest.mark.slow
def test_default_weights_match_transformers_dequantization(default_model: LoadedModel) -> None:
    """transformers' full GGUF path (names, dequantization, Q/K reverse permutation) agrees.

    Slow (about 20 s): transformers rebuilds gguf's tensor-name map once per module.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = default_model.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_config)
    parsed = load_gguf_checkpoint(default_model_path(), return_tensors=True,
                                  model_to_load=skeleton)
    hf = {k: v.numpy() for k, v in parsed["tensors"].items()}
    assert parsed["config"]["num_attention_heads"] == 9
    np.testing.assert_array_equal(default_model.params["embed"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(default_model.params["final_norm"], hf["model.norm.weight"])
    for i in (0, 17, 29):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_down", "attn_norm"):
            np.testing.assert_array_equal(
                hf_view(name, np.asarray(default_model.params["layers"][i][name])),
                hf[f"model.layers.{i}.{HF_LAYER_NAMES[name]}"], err_msg=f"layer {i} {name}")


def test_default_second_load_comes_from_cache(default_model: LoadedModel) -> None:
    entry = cache_entry_dir(Path(default_model_path()).resolve())
    assert (entry / "meta.json").is_file()
    again = load_model(None)
    assert isinstance(again.params["layers"][0]["wq"], np.memmap)  # memory-mapped cache
    np.testing.assert_array_equal(again.params["layers"][3]["wk"],
                                  default_model.params["layers"][3]["wk"])
    assert again.config == default_model.config
    assert again.tokenizer.encode(TEXTS[2]) == default_model.tokenizer.encode(TEXTS[2])


# ---------------------------------------------------------------- default tokenizer


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_tokenizer_matches_transformers(default_model: LoadedModel, hf_gguf_tokenizer) -> None:
    tok = default_model.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_gguf_tokenizer(text).input_ids, text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == hf_gguf_tokenizer.decode(ids)
    assert hf_gguf_tokenizer("Hello").input_ids[0] != 1  # transformers adds no BOS either


def test_tokenizer_roundtrip_and_special_tokens(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    for text in TEXTS + ["numbers 12345 and 3.14159"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>")[0] == 1
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.encode("Hello world")[0] != tok.bos_token_id  # no BOS prepended


def test_tokenizer_splits_digits_individually(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")
    pieces = [tok.decode([i]) for i in tok.encode("year 2024, x9")]
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == ["2", "0", "2", "4", "9"]


def test_id_to_token_bytes_roundtrip(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    for text in TEXTS + ["digits 0987"]:
        ids = tok.encode(text)
        assert b"".join(tok.id_to_token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.id_to_token_bytes(2) == b"<|im_end|>"
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_token_bytes(tok.vocab_size)


def test_chat_template(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    text = tok.apply_chat_template(parts, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_no_chat_template_and_raise_exception(default_model: LoadedModel) -> None:
    backend = default_model.tokenizer.backend
    bare = Tokenizer(backend, bos_token_id=None, eos_token_ids=[2], chat_template=None)
    assert bare.chat_end_token is None
    with pytest.raises(ValueError, match="model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2],
                       chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template([])


def test_gguf_add_bos_token() -> None:
    """A GGUF with add_bos_token=1 gets BOS from encode(), but not with add_special_tokens=False."""
    from sgl_tpu.loader.tokenizer import build_gguf_backend

    tokens, types, merges = ck.tokenizer_vocab(ck.make_tiny_tokenizer())
    backend = build_gguf_backend(tokenizer_model="gpt2", pre="smollm", tokens=tokens,
                                 token_types=types, merges=merges, bos_token_id=1, add_bos=True)
    tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'nope'"):
        build_gguf_backend(tokenizer_model="gpt2", pre="nope", tokens=tokens, token_types=types,
                           merges=merges, bos_token_id=1, add_bos=True)


# ---------------------------------------------------------------- tiny HF checkpoints


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_checkpoint(tmp_path: Path, arch: str) -> None:
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / arch, arch)
    model = load_model(model_dir)
    c = model.config
    assert model.source_format == "hf" and c.arch == arch
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (64, 2, 4, 2)
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.vocab_size == model.tokenizer.vocab_size
    assert c.eos_token_ids == (2,) and model.tokenizer.chat_end_token == "<|im_end|>"
    assert not c.tie_word_embeddings
    assert_params_match_state_dict(model, torch_state(model_dir))
    assert model.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>system\nYou are a tiny test model.")


def test_tiny_hf_tied_bf16(tmp_path: Path) -> None:
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", tie_word_embeddings=True,
                                           dtype="bfloat16")
    model = load_model(model_dir)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    assert_params_match_state_dict(model, torch_state(model_dir))  # bf16 -> f32 exactly


def test_tiny_hf_llama3_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = Path(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama", rope_scaling=scaling))
    want = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)
    assert load_model(str(model_dir)).config.rope_scaling == want  # transformers 5 format
    cfg = json.loads((model_dir / "config.json").read_text())
    rope_parameters = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope_parameters.pop("rope_theta")
    cfg["rope_scaling"] = rope_parameters  # transformers 4 format
    (model_dir / "config.json").write_text(json.dumps(cfg))
    c = load_model(str(model_dir)).config
    assert c.rope_scaling == want and c.rope_theta == 10000.0


# ---------------------------------------------------------------- tiny GGUF vs its HF twin


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SGL_TPU_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_equals_hf_twin(tmp_path: Path, cache_dir: Path, arch: str) -> None:
    path = ck.make_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    from_gguf = load_model(path)
    from_hf = load_model(ck.hf_twin_dir(path))
    assert from_gguf.source_format == "gguf"
    assert from_gguf.config == from_hf.config
    assert_params_match_state_dict(from_gguf, torch_state(ck.hf_twin_dir(path)))
    text = "Hello world 2024! <|im_start|>user\nCaf\u00e9<|im_end|>"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    assert from_gguf.tokenizer.chat_template == from_hf.tokenizer.chat_template
    cached = load_model(path)  # second load: from the cache in tmp
    assert len(list(cache_dir.glob("gguf/*/meta.json"))) == 1
    assert isinstance(cached.params["embed"], np.memmap)
    assert_params_match_state_dict(cached, torch_state(ck.hf_twin_dir(path)))


def test_tiny_gguf_tied(tmp_path: Path, cache_dir: Path) -> None:
    path = ck.make_tiny_gguf(tmp_path / "t.gguf", "llama", tie_word_embeddings=True)
    model = load_model(path)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    assert_params_match_state_dict(model, torch_state(ck.hf_twin_dir(path)))


# ---------------------------------------------------------------- bad input


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_model("/no/such/model")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(bogus))


def _edit_config(model_dir: str, **changes: object) -> None:
    cfg_file = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


def test_unsupported_hf_arch(tmp_path: Path) -> None:
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    _edit_config(model_dir, model_type="falcon", architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'.*llama, qwen2, qwen3"):
        load_model(model_dir)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                             "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        load_model(model_dir)


def test_unsupported_gguf_arch(tmp_path: Path, cache_dir: Path) -> None:
    path = ck.make_tiny_gguf(tmp_path / "g.gguf", "llama", gguf_arch="gemma")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'.*llama"):
        load_model(path)


def test_unsupported_gguf_quant_type(tmp_path: Path, cache_dir: Path) -> None:
    path = ck.make_tiny_gguf(tmp_path / "q.gguf", "llama", i8_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight.*I8"):
        load_model(path)
