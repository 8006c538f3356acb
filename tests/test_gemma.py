"""Gemma 2 and Gemma 3 on both executor backends against transformers, float32.

Tiny random checkpoints (tests/gemma_checkpoints.py) with a sliding window of 6 tokens over
pages of 4, so local layers' windows cross page boundaries, start inside cached prefixes and
slide during decode, next to global layers that see everything. Each case:

  * prefill of a 21-token prompt in two EXTEND steps (the second reads the first's K/V from
    the pool, as a radix-cache hit does), batched with a second, unrelated prompt (ragged);
  * 8 paged DECODE steps of both sequences in one batch: each greedy token equals the
    reference's argmax (where the top two differ by more than 10x the tolerance) and its
    log-probability the reference's;

and every logit equals the reference run of each sequence alone. Tolerance: max abs logit
(and log-prob) difference 2e-3, logits of order 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gemma_checkpoints import WINDOW, make_tiny_gemma, make_tiny_gemma3_gguf
from model_helpers import hf_logits

from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import load_model
from sgl_tpu.loader.spm_tokenizer import merges_from_vocab, respell
from sgl_tpu.sampling_params import SamplingParams

ATOL = 2e-3
PAGE = 4
DECODE_STEPS = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_gemma(tmp_path_factory.mktemp(request.param), request.param)


def _runner(model_dir, backend: str):
    loaded = load_model(model_dir)
    args = ServerArgs(backend=backend, dtype="float32", torch_compile="off", skip_warmup=True,
                      page_size=PAGE, max_total_tokens=1024, kv_tile=8, block_q=8,
                      min_token_bucket=16, chunked_prefill_size=64, max_running_requests=4)
    return loaded, create_model_runner(loaded.config, loaded.params,
                                       runner_config(args, loaded.config.context_len))


def _step(tokens, prefix_len, pages, num_output_tokens=0) -> SeqStep:
    return SeqStep(token_ids=tokens, prefix_len=prefix_len, pages=pages, sampling=GREEDY,
                   seed=0, num_output_tokens=num_output_tokens)


def _extend_logits(runner, seqs) -> list[np.ndarray]:
    result = runner.forward(ForwardMode.EXTEND, [_step(*s) for s in seqs])
    rows = np.arange(sum(len(t) for t, _, _ in seqs), dtype=np.int32)
    logits = runner.row_logits(result.hidden, rows)
    return np.split(logits, np.cumsum([len(t) for t, _, _ in seqs])[:-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_gemma_prefill_and_paged_decode_match_transformers(checkpoint, backend):
    arch, model_dir = checkpoint
    loaded, runner = _runner(model_dir, backend)
    cfg = loaded.config
    assert cfg.arch == arch and cfg.gemma.sliding_window == WINDOW
    assert cfg.gemma.sliding_layers == (True, False, True)
    rng = np.random.default_rng(1)
    a = rng.integers(3, cfg.vocab_size, 21).tolist()
    b = rng.integers(3, cfg.vocab_size, 9).tolist()
    pages_a, pages_b = np.arange(1, 9), np.arange(9, 14)  # room for the decoded tokens

    (first,) = _extend_logits(runner, [(a[:10], 0, pages_a)])
    rest_a, all_b = _extend_logits(runner, [(a[10:], 10, pages_a), (b, 0, pages_b)])
    ref_a, ref_b = hf_logits(model_dir, a), hf_logits(model_dir, b)
    np.testing.assert_allclose(np.concatenate([first, rest_a]), ref_a, atol=ATOL)
    np.testing.assert_allclose(all_b, ref_b, atol=ATOL)

    # greedy decode of both sequences in one batch, then each checked against the reference
    # run of that sequence alone (causal: row t of one run over everything = a run up to t)
    seqs = [(list(a) + [int(ref_a[-1].argmax())], pages_a),
            (list(b) + [int(ref_b[-1].argmax())], pages_b)]
    logprobs: list[list[float]] = [[], []]
    for n in range(DECODE_STEPS):
        steps = [_step([toks[-1]], len(toks) - 1, pages, n + 1) for toks, pages in seqs]
        result = runner.forward(ForwardMode.DECODE, steps)
        for i, (toks, _) in enumerate(seqs):
            toks.append(int(result.token_ids[i]))
            logprobs[i].append(float(result.logprobs[i]))
    for (toks, _), lps in zip(seqs, logprobs, strict=True):
        ref = hf_logits(model_dir, toks)[-DECODE_STEPS - 1 : -1]  # rows that predicted them
        got = np.array(toks[-DECODE_STEPS:])
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 10 * ATOL
        np.testing.assert_array_equal(got[clear], ref.argmax(-1)[clear])
        ref_lp = np.take_along_axis(_log_softmax(ref), got[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(lps, ref_lp, atol=ATOL)


# ---------------------------------------------------------------- GGUF (tiny, written here)

_STRINGS = ["the quick brown fox", "  the  lazy   dog ", "hello\n\nworld\n", "café naïve 日本語",
            "12345 678", "return(fox);", "<start_of_turn>user\nhi<end_of_turn>",
            "\t\u00a0\U0001f600", "thequickbrown", " ", "", "x" * 7, "    four spaces",
            "e\u0301 ﬁ \x07"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gemma3_gguf(tmp_path_factory.mktemp("g3gguf") / "tiny-gemma3.gguf")


def test_tiny_gemma3_gguf_matches_transformers_gguf_loading(tiny_gguf, tmp_path, monkeypatch):
    """Config, weights (norms lose llama.cpp's +1), tokenizer and logits of a Gemma 3 GGUF
    equal transformers' loading of the same file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SGL_TPU_CACHE_DIR", str(tmp_path))
    path = Path(tiny_gguf)
    loaded = load_model(str(path))
    cfg = loaded.config
    assert cfg.arch == "gemma3" and cfg.head_dim == 256 and cfg.qk_norm
    assert cfg.gemma.sliding_layers == (True,) * 5 + (False,)
    assert (cfg.gemma.sliding_window, cfg.gemma.rope_local_theta, cfg.rope_theta) == (
        WINDOW, 10000.0, 1000000.0)

    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for s in _STRINGS:
        ids = loaded.tokenizer.encode(s)
        assert ids == ref_tok(s).input_ids, repr(s)
        assert loaded.tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(loaded.params["layers"][5]["post_mlp_norm"],
                                  sd["model.layers.5.post_feedforward_layernorm.weight"])
    np.testing.assert_array_equal(loaded.params["layers"][0]["wq"],
                                  sd["model.layers.0.self_attn.q_proj.weight"].T)
    ids = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog, hello world")
    assert len(ids) > 2 * WINDOW
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    _, runner = _runner(str(path), "torch")
    (got,) = _extend_logits(runner, [(ids, 0, np.arange(1, 1 + -(-len(ids) // PAGE)))])
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_spm_merges_follow_vocabulary_order():
    """Merge priority is the merged piece's position, then the longer left part."""
    pieces = ["a", "b", "c", "ab", "bc", "abc"]
    assert merges_from_vocab(pieces) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    assert respell(["  ", "a b", " "]) == ["\u2581\u2581", "a b", "\u2581"]


# ---------------------------------------------------------------- serving a base model


def test_chat_template_flag(tmp_path):
    from checkpoints import make_tiny_tokenizer

    from sgl_tpu.choices import check_registry_names
    from sgl_tpu.loader.chat_templates import with_chat_template
    from sgl_tpu.loader.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="chat_template must be one of gemma, chatml"):
        check_registry_names(ServerArgs(chat_template=str(tmp_path / "missing.jinja")))
    base = Tokenizer(make_tiny_tokenizer(), bos_token_id=1, eos_token_ids=[2],
                     chat_template=None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    with pytest.raises(ValueError, match="--chat-template"):
        base.apply_chat_template(msgs)
    gemma = with_chat_template(base, ServerArgs(chat_template="gemma").chat_template)
    assert gemma.apply_chat_template(msgs) == (
        "<|im_start|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    custom = with_chat_template(base, ServerArgs(chat_template=str(path)).chat_template)
    assert custom.apply_chat_template(msgs[1:2]) == "[Hi]"


def test_packaged_model_without_its_wheel_names_the_install(monkeypatch):
    from sgl_tpu.loader import packaged_models

    spec = packaged_models.PackagedModel(package="no_such_model_wheel_xyz",
                                         install="pip install no-such-wheel", description="x")
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "tiny-missing", spec)
    with pytest.raises(FileNotFoundError, match="pip install no-such-wheel"):
        load_model("tiny-missing")
