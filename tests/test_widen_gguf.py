"""tools/widen_gguf.py on the default model, F=2 and an FFN of FFN_SIZE units (not 2x, to cover
--ffn-size): the widened file loads with twice the hidden size, heads and KV heads, runs the
same greedy tokens with the same float32 logits (torch backend, dense weights), holds the
source's quantized blocks byte for byte, keeps the metadata, and bad input is refused by name.

Logit tolerance: atol 1e-3 on logits up to ~30. The widened model computes the same function,
so float32 summation order is the only difference (7e-5 measured); an epsilon left at eps
(effectively 2 * eps) moves the logits by ~2e-2, which this tolerance catches."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from tool_scripts import TOOLS_DIR, load_tool

from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.loader import default_model_path, load_model
from sgl_tpu.sampling_params import SamplingParams

widen = load_tool("widen_gguf")

FACTOR = 2
FFN_SIZE = 3328  # 2 x 1536 + 256: whole blocks of 32
ATOL = 1e-3
PAGE = 4
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0)
PROMPT = "The capital of France is Paris, and the capital of Germany is the city of"


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    """(path of the widened default model, its LoadedModel); its 2 GB float32 weight cache goes
    to a temporary folder, removed afterwards (the loaded arrays map it until then)."""
    base = tmp_path_factory.mktemp("widen")
    path = base / f"smollm2-w{FACTOR}.gguf"
    widen.widen_gguf(default_model_path(), path, FACTOR, FFN_SIZE)
    cache = base / "cache"
    saved = os.environ.get("SGL_TPU_CACHE_DIR")
    os.environ["SGL_TPU_CACHE_DIR"] = str(cache)
    try:
        loaded = load_model(str(path))
    finally:
        if saved is None:
            os.environ.pop("SGL_TPU_CACHE_DIR", None)
        else:
            os.environ["SGL_TPU_CACHE_DIR"] = saved
    yield path, loaded
    shutil.rmtree(cache, ignore_errors=True)
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def readers(widened):
    """GGUFReaders of the default model and its widened copy (a few seconds each)."""
    return gguf.GGUFReader(default_model_path()), gguf.GGUFReader(widened[0])


def test_config_dims_are_factor_times(widened):
    _, wide = widened
    cfg, src = wide.config, load_model(None).config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        FACTOR * src.hidden_size, FACTOR * src.num_heads, FACTOR * src.num_kv_heads, FFN_SIZE)
    assert (cfg.head_dim, cfg.num_layers, cfg.vocab_size) == (
        src.head_dim, src.num_layers, src.vocab_size)
    assert math.isclose(cfg.rms_norm_eps, src.rms_norm_eps / FACTOR, rel_tol=1e-6)


def _greedy_run(loaded, prompt_ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Prompt logits [T, V] and NEW_TOKENS greedy tokens, torch backend, float32, dense."""
    args = ServerArgs(backend="torch", dtype="float32", torch_compile="off", skip_warmup=True,
                      quantization="none", page_size=PAGE, max_total_tokens=256,
                      chunked_prefill_size=64, max_running_requests=2)
    runner = create_model_runner(loaded.config, loaded.params, runner_config(args, 256))
    pages = np.arange(1, 1 + -(-(len(prompt_ids) + NEW_TOKENS) // PAGE))
    step = SeqStep(token_ids=prompt_ids, prefix_len=0, pages=pages, sampling=GREEDY, seed=0,
                   num_output_tokens=0)
    result = runner.forward(ForwardMode.EXTEND, [step])
    logits = runner.row_logits(result.hidden, np.arange(len(prompt_ids), dtype=np.int32))
    tokens = [int(result.token_ids[0])]
    while len(tokens) < NEW_TOKENS:
        step = SeqStep(token_ids=[tokens[-1]], prefix_len=len(prompt_ids) + len(tokens) - 1,
                       pages=pages, sampling=GREEDY, seed=0, num_output_tokens=len(tokens))
        tokens.append(int(runner.forward(ForwardMode.DECODE, [step]).token_ids[0]))
    return logits, tokens


def test_same_greedy_tokens_and_logits(widened):
    _, wide = widened
    src = load_model(None)
    prompt_ids = src.tokenizer.encode(PROMPT)
    assert len(prompt_ids) == 16
    assert wide.tokenizer.encode(PROMPT) == prompt_ids
    src_logits, src_tokens = _greedy_run(src, prompt_ids)
    wide_logits, wide_tokens = _greedy_run(wide, prompt_ids)
    assert wide_tokens == src_tokens
    np.testing.assert_allclose(wide_logits, src_logits, atol=ATOL, rtol=0)
    assert (wide_logits.argmax(-1) == src_logits.argmax(-1)).all()


def _row_bytes(tensor) -> np.ndarray:
    """A tensor's storage as [rows, row_bytes] (rows: all ne but ne[0])."""
    rows = math.prod(int(n) for n in tensor.shape[1:])
    return np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)


def test_source_blocks_are_bit_exact_inside(readers):
    src, wide_reader = readers
    wide = {t.name: t for t in wide_reader.tensors}
    assert len(wide) == len(src.tensors)
    for t in src.tensors:
        w = wide[t.name]
        assert w.tensor_type == t.tensor_type, t.name
        a, b = _row_bytes(t), _row_bytes(w)
        rows, cols = a.shape
        kinds = widen._TENSOR_DIMS[widen._suffix(t.name)]
        assert [int(n) for n in w.shape] == [
            FFN_SIZE if kind == "FF" else int(n) if kind == "V" else FACTOR * int(n)
            for n, kind in zip(t.shape, kinds, strict=True)], t.name
        if t.name.endswith("norm.weight"):  # scaled, then zero-padded
            np.testing.assert_array_equal(
                b[:, :cols].view(np.float32), a.view(np.float32) / np.float32(math.sqrt(FACTOR)))
        else:
            assert np.array_equal(b[:rows, :cols], a), t.name
        assert not b[rows:].any() and not b[:, cols:].any(), t.name


def test_metadata_kept_but_the_dimensions(readers):
    src, wide = readers
    changed = {f"llama.{k}" for k in (*widen._SCALED_KEYS, widen._EPS_KEY,
                                      "feed_forward_length")}
    skip = changed | {"GGUF.kv_count", "GGUF.tensor_count", "GGUF.version"}
    assert set(wide.fields) >= set(src.fields) - {"general.alignment"}
    for key, field in src.fields.items():
        if key not in skip:
            assert wide.fields[key].contents() == field.contents(), key
    for key in widen._SCALED_KEYS:
        key = f"llama.{key}"
        assert wide.fields[key].contents() == FACTOR * src.fields[key].contents(), key
    assert wide.fields["llama.feed_forward_length"].contents() == FFN_SIZE


def _tiny_gguf(path, arch: str):
    """A one-tensor GGUF: hidden 32, one head, FFN 64, ffn_down in Q8_0 blocks."""
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, value in (("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 1)):
        writer.add_uint32(f"{arch}.{key}", value)
    down = gguf.quants.quantize(np.ones((32, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", down, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_input_is_refused(tmp_path):
    tiny = _tiny_gguf(tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "x.gguf"
    widen.widen_gguf(tiny, out, 2, 96)  # the file is widenable
    assert gguf.GGUFReader(out).fields["llama.feed_forward_length"].contents() == 96
    out.unlink()
    for factor in (0, -1, 1.5, "3", True):
        with pytest.raises(ValueError, match="factor must be an integer >= 1"):
            widen.widen_gguf(tiny, out, factor)
    with pytest.raises(ValueError, match="ffn_size must be an integer >= 64, got 63"):
        widen.widen_gguf(tiny, out, 2, 63)
    with pytest.raises(ValueError, match="rows of 100 values are not whole Q8_0 blocks of 32"):
        widen.widen_gguf(tiny, out, 2, 100)
    qwen = _tiny_gguf(tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2'; only 'llama'"):
        widen.widen_gguf(qwen, out, 2)
    with pytest.raises(ValueError, match="would overwrite the source"):
        widen.widen_gguf(tiny, tiny, 2)
    script = [sys.executable, str(TOOLS_DIR / "widen_gguf.py"), str(out), "--model-path",
              str(tiny)]
    bad = subprocess.run([*script, "--factor", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "factor must be an integer >= 1, got 0" in bad.stderr
    bad = subprocess.run([*script, "--factor", "2.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid int value: '2.5'" in bad.stderr
    assert not list(tmp_path.glob("x.gguf*"))
