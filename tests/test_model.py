"""The JAX model over the paged KV pool matches Hugging Face transformers (CPU torch).

Logit tolerance: float32 max abs diff < 2e-3 on tiny random checkpoints (logits of order 1);
the default model's greedy continuation must match token for token.
"""

from __future__ import annotations

import checkpoints as ck
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import PagedModel, hf_logits

from sgl_tpu.executor.step import ForwardMode
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
ATOL = 2e-3


@pytest.mark.parametrize("arch,kw,page_size", [
    (arch, kw, ps) for arch, kw in ck.ARCH_CASES
    for ps in ([4] if (arch, kw) in ck.NEW_ARCH_CASES else [1, 4])])  # page 1: once per layer kind
def test_prefill_and_decode_match_transformers(tmp_path, arch, kw, page_size):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", arch, **kw)
    loaded = load_model(model_dir)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, loaded.config.vocab_size, 23).tolist()
    ref = hf_logits(model_dir, ids)
    m = PagedModel(loaded, page_size=page_size)
    pages = m.new_pages(len(ids))
    # Prefill the first 19 tokens, then 4 decode steps through the paged cache.
    (pre,) = m.run(ForwardMode.EXTEND, [(ids[:19], 0, pages)])
    np.testing.assert_allclose(pre, ref[:19], atol=ATOL)
    for pos in range(19, 23):
        (dec,) = m.run(ForwardMode.DECODE, [([ids[pos]], pos, pages)])
        np.testing.assert_allclose(dec[0], ref[pos], atol=ATOL)


# mixtral: routing sorts the whole batch's tokens by expert; mistral: the window over a prefix
@pytest.mark.parametrize("arch", ["llama", "mixtral", "mistral"])
def test_ragged_batch_equals_each_sequence_alone(tmp_path, arch):
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", arch))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, loaded.config.vocab_size, n).tolist() for n in (30, 7, 18, 11)]
    alone = PagedModel(loaded)
    ref = []
    for s in seqs:
        (lg,) = alone.run(ForwardMode.EXTEND, [(s, 0, alone.new_pages(len(s)))])
        ref.append(lg)
    m = PagedModel(loaded)
    # Sequences 0 and 2 already have a cached prefix (10 and 9 tokens, one ending mid-page)
    # from an earlier step; 1 and 3 start fresh. All four then run in one ragged EXTEND batch.
    p0, p2 = m.new_pages(30), m.new_pages(18)
    m.run(ForwardMode.EXTEND, [(seqs[0][:10], 0, p0), (seqs[2][:9], 0, p2)])
    p1, p3 = m.new_pages(7), m.new_pages(11)
    out = m.run(ForwardMode.EXTEND, [(seqs[0][10:], 10, p0), (seqs[1], 0, p1),
                                     (seqs[2][9:], 9, p2), (seqs[3], 0, p3)])
    np.testing.assert_allclose(out[0], ref[0][10:], atol=ATOL)
    np.testing.assert_allclose(out[1], ref[1], atol=ATOL)
    np.testing.assert_allclose(out[2], ref[2][9:], atol=ATOL)
    np.testing.assert_allclose(out[3], ref[3], atol=ATOL)
    # A decode batch of all four equals each one's next-token logits alone.
    nxt = [int(r[-1].argmax()) for r in ref]
    dec = m.run(ForwardMode.DECODE, [([nxt[0]], 30, p0), ([nxt[1]], 7, p1),
                                     ([nxt[2]], 18, p2), ([nxt[3]], 11, p3)])
    for i, s in enumerate(seqs):
        (solo,) = alone.run(ForwardMode.EXTEND, [(s + [nxt[i]], 0, alone.new_pages(len(s) + 1))])
        np.testing.assert_allclose(dec[i][0], solo[-1], atol=ATOL)


def test_bfloat16_logits_close(tmp_path):
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    ids = list(range(3, 40))
    (f32,) = PagedModel(loaded).run(ForwardMode.EXTEND, [(ids, 0, np.arange(1, 11))])
    m16 = PagedModel(loaded, dtype="bfloat16")
    assert m16.runner.dtype == jnp.bfloat16
    (bf16,) = m16.run(ForwardMode.EXTEND, [(ids, 0, np.arange(1, 11))])
    assert np.abs(bf16 - f32).max() < 0.1 * np.abs(f32).max()


@pytest.fixture(scope="module")
def smol_greedy_reference():
    """(prompt ids, 32 greedy ids from transformers in float32 on the default GGUF)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from sgl_tpu.loader import default_model_path

    loaded = load_model(None)
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}])
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    path = default_model_path()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
    ref, past, inp = [], None, torch.tensor([ids])
    with torch.inference_mode():  # plain greedy, EOS not special (like ignore_eos)
        for _ in range(32):
            out_t = model(inp, past_key_values=past, use_cache=True)
            past = out_t.past_key_values
            ref.append(int(out_t.logits[0, -1].argmax()))
            inp = torch.tensor([[ref[-1]]])
    return ids, ref


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_default_model_greedy_matches_transformers(smol_greedy_reference, backend):
    """32 greedy tokens of SmolLM2 (our loader + either backend, float32; torch on the exact
    block kernels, which `auto` trades for int8 activations where the tiles are built) ==
    transformers on the same GGUF."""
    from sgl_tpu import Engine

    ids, ref = smol_greedy_reference
    exact = {"quantization": "gguf"} if backend == "torch" else {}
    engine = Engine(skip_warmup=True, max_total_tokens=2048, chunked_prefill_size=256,
                    max_running_requests=4, backend=backend, dtype="float32", **exact)
    out = engine.generate(input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
    assert out["output_ids"] == ref
    engine.scheduler.check_integrity()
