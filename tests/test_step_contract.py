"""The numpy step contract shared by both runners (executor/step.py), the registries the CLI
reads, and the import boundary: a torch-backend process never loads JAX."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import checkpoints as ck
import numpy as np
import pytest

from sgl_tpu.cli import build_parser
from sgl_tpu.executor.step import (
    ForwardMode,
    SeqStep,
    mask_words,
    pack_tokens,
    sampling_columns,
    step_rows,
    warmup_step,
)
from sgl_tpu.models.registry import MODELS, get_model_spec
from sgl_tpu.sampling_params import SamplingParams


def _step(n_new: int, prefix: int, pages: list[int], **kw) -> SeqStep:
    return SeqStep(token_ids=list(range(100, 100 + n_new)), prefix_len=prefix, pages=pages,
                   sampling=SamplingParams(**kw), seed=7, num_output_tokens=prefix)


def test_pack_tokens_lays_sequences_end_to_end_with_slots():
    # page_size 4: seq 0 continues at position 6 of pages [3, 5]; seq 1 is fresh on page [2]
    steps = [_step(3, 6, [3, 5, 9]), _step(2, 0, [2])]
    p = pack_tokens(steps, 8, page_size=4, max_pages=4)
    assert p.input_ids.tolist() == [100, 101, 102, 100, 101, 0, 0, 0]
    assert p.positions.tolist() == [6, 7, 8, 0, 1, 0, 0, 0]
    # position 6 -> page 5 offset 2 = slot 22; 8 -> page 9 offset 0 = 36; padding -> slot 0
    assert p.out_slots.tolist() == [22, 23, 36, 8, 9, 0, 0, 0]
    assert p.starts.tolist() == [0, 3] and p.sample_rows.tolist() == [2, 4]
    assert p.seq_lens.tolist() == [9, 2]
    with pytest.raises(ValueError, match="pages cannot hold"):
        pack_tokens([_step(3, 6, [3, 5])], 8, page_size=4, max_pages=4)
    with pytest.raises(ValueError, match="more than 4 tokens"):
        pack_tokens(steps, 4, page_size=4, max_pages=4)


def test_step_rows_picks_buckets_and_checks_limits():
    kw = {"token_buckets": (8, 16), "seq_buckets": (1, 2, 4), "max_extend_seqs": 2}
    steps = [_step(3, 0, [1]), _step(6, 0, [2, 3])]
    assert step_rows(ForwardMode.EXTEND, steps, **kw) == (16, 9)
    assert step_rows(ForwardMode.DECODE, (steps * 2)[:3], **kw) == (4, 3)
    with pytest.raises(ValueError, match="max_extend_seqs"):
        step_rows(ForwardMode.EXTEND, steps * 2, **kw)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        step_rows(ForwardMode.DECODE, steps * 3, **kw)


def test_sampling_columns_pad_greedy_and_keep_masks():
    mask = np.array([5, 0, 1], np.int32)
    steps = [_step(1, 0, [1], temperature=0.7, top_p=0.9, frequency_penalty=0.5),
             _step(1, 3, [2], temperature=0.0)]
    steps[0].counts_row, steps[0].counts_reset = 3, True
    steps[1].bitmask = mask
    cols = sampling_columns(steps, 4, num_mask_words=3)
    assert cols.temperature.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.0])
    assert cols.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0])
    assert cols.counts_rows.tolist() == [3, 0, 0, 0] and cols.counts_reset.tolist()[:2] == [
        True, False]
    assert cols.sample_valid.tolist() == [True, True, False, False]  # padding: never counted
    assert cols.step.tolist() == [0, 3, 0, 0] and cols.uses_penalties
    assert (cols.bitmask[0] == -1).all() and cols.bitmask[1].tolist() == mask.tolist()
    assert sampling_columns(steps[:1], 1, 3).bitmask is None  # no row constrained: no mask
    assert mask_words(49152) == 1536 and mask_words(100) == 4
    w = warmup_step()
    assert list(w.pages) == [0] and not w.sample_valid


def test_cli_choices_come_from_the_registries():
    actions = {a.dest: a for a in build_parser()._actions}
    assert set(actions["backend"].choices) == {"auto", "jax", "torch"}
    assert "torch-sdpa" in actions["attention_backend"].choices
    assert "pallas" in actions["attention_backend"].choices
    assert set(actions["schedule_policy"].choices) == {"lpm", "fcfs", "dfs-weight"}
    assert "llguidance" in actions["grammar_backend"].choices
    assert set(MODELS) >= {"llama", "qwen2", "qwen3"}
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        get_model_spec("gpt2")


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_torch_process_never_imports_jax(tmp_path, backend):
    """An Engine on the torch backend (explicit, or `auto` on this CPU) loads, schedules,
    generates and constrains output without JAX entering the process."""
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama")
    code = textwrap.dedent(f"""
        import sys
        from sgl_tpu import Engine
        engine = Engine({str(model_dir)!r}, backend={backend!r}, skip_warmup=True,
                        max_total_tokens=512, page_size=4)
        out = engine.generate("hello", {{"max_new_tokens": 4, "temperature": 0}})
        forced = engine.generate("hi", {{"max_new_tokens": 8, "regex": "[ab]{{3}}"}})
        assert engine.scheduler.runner.backend == "torch", engine.scheduler.runner.backend
        assert out["meta_info"]["completion_tokens"] == 4
        assert forced["text"] and set(forced["text"]) <= set("ab"), forced["text"]
        engine.shutdown()
        loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))
        print("JAX_MODULES", loaded)
        assert not loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "JAX_MODULES []" in proc.stdout
