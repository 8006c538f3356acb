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
    build_host_batch,
    mask_words,
    placeholder_id,
    sampling_columns,
    step_rows,
    warmup_step,
)
from sgl_tpu.models.registry import MODELS, get_model_spec
from sgl_tpu.sampling_params import SamplingParams


def _step(n_new: int, prefix: int, pages: list[int], **kw) -> SeqStep:
    return SeqStep(token_ids=list(range(100, 100 + n_new)), prefix_len=prefix, pages=pages,
                   sampling=SamplingParams(**kw), seed=7, num_output_tokens=prefix)


def test_host_batch_lays_out_tokens_sequences_and_pages():
    # page_size 4: seq 0 continues at position 6 of pages [3, 5, 9]; seq 1 is fresh on page [2]
    steps = [_step(3, 6, [3, 5, 9]), _step(2, 0, [2], temperature=0.5)]
    kw = {"num_tokens": 8, "num_seqs": 4, "page_size": 4, "max_pages": 4, "num_mask_words": 2}
    hb = build_host_batch(ForwardMode.EXTEND, steps, **kw)
    assert hb.mode == ForwardMode.EXTEND and hb.num_seqs == 2 and hb.num_tokens == 5
    assert hb.input_ids.tolist() == [100, 101, 102, 100, 101, 0, 0, 0]
    assert hb.positions.tolist() == [6, 7, 8, 0, 1, 0, 0, 0]
    # position 6 -> page 5 offset 2 = slot 22; 8 -> page 9 offset 0 = 36; padding -> slot 0
    assert hb.out_slots.tolist() == [22, 23, 36, 8, 9, 0, 0, 0]
    # sequence rows: padding rows have every length and row 0
    assert hb.starts.tolist() == [0, 3, 0, 0] and hb.sample_rows.tolist() == [2, 4, 0, 0]
    assert hb.extend_lens.tolist() == [3, 2, 0, 0] and hb.prefix_lens.tolist() == [6, 0, 0, 0]
    assert hb.seq_lens.tolist() == [9, 2, 0, 0]
    assert hb.page_table.dtype == np.int32
    assert hb.page_table.tolist() == [[3, 5, 9, 0], [2, 0, 0, 0], [0] * 4, [0] * 4]
    assert hb.sampling.temperature.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert hb.sampling.sample_valid.tolist() == [True, True, False, False]
    # a runner without compiled page-table shapes takes the longest sequence's width
    trimmed = build_host_batch(ForwardMode.EXTEND, steps, **{**kw, "trim_pages": True})
    assert trimmed.page_table.tolist() == [[3, 5, 9], [2, 0, 0], [0] * 3, [0] * 3]
    assert trimmed.out_slots.tolist() == hb.out_slots.tolist()
    with pytest.raises(ValueError, match="pages cannot hold"):
        build_host_batch(ForwardMode.EXTEND, [_step(3, 6, [3, 5])], **kw)
    with pytest.raises(ValueError, match="pages cannot hold"):  # more pages than the table
        build_host_batch(ForwardMode.EXTEND, [_step(1, 0, [1, 2, 3, 4, 5])], **kw)
    with pytest.raises(ValueError, match="more than 4 tokens"):
        build_host_batch(ForwardMode.EXTEND, steps, **{**kw, "num_tokens": 4})
    with pytest.raises(ValueError, match="exceed the batch"):
        build_host_batch(ForwardMode.EXTEND, steps, **{**kw, "num_seqs": 1})


def test_host_batch_decode_keeps_placeholders_and_pads_sequences():
    steps = [_step(1, 4, [7, 8]), _step(1, 0, [3])]
    steps[1].token_ids = [placeholder_id(0)]
    hb = build_host_batch(ForwardMode.DECODE, steps, num_tokens=4, num_seqs=4, page_size=4,
                          max_pages=2, num_mask_words=1)
    assert hb.input_ids.tolist() == [100, -1, 0, 0]  # resolved on the device, not here
    assert hb.positions.tolist() == [4, 0, 0, 0] and hb.out_slots.tolist() == [32, 12, 0, 0]
    assert hb.sample_rows.tolist() == [0, 1, 0, 0] and hb.seq_lens.tolist() == [5, 1, 0, 0]
    empty = build_host_batch(ForwardMode.DECODE, [], num_tokens=2, num_seqs=2, page_size=4,
                             max_pages=2, num_mask_words=1)
    assert empty.num_seqs == 0 and empty.page_table.tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_host_batch_matches_a_per_sequence_layout(seed):
    """Random ragged batches (lists and arrays as inputs) against the layout written one
    sequence at a time."""
    rng = np.random.default_rng(seed)
    ps, n = 4, int(rng.integers(1, 7))
    steps, free = [], list(rng.permutation(np.arange(1, 200)))
    for i in range(n):
        prefix, new = int(rng.integers(0, 30)), int(rng.integers(1, 12))
        pages = [int(free.pop()) for _ in range(-(-(prefix + new) // ps) + int(i % 2))]
        ids = rng.integers(0, 1000, new)
        steps.append(SeqStep(token_ids=ids if i % 2 else ids.tolist(), prefix_len=prefix,
                             pages=np.array(pages) if i % 3 == 0 else pages,
                             sampling=SamplingParams(), seed=i, num_output_tokens=0))
    total = sum(len(st.token_ids) for st in steps)
    hb = build_host_batch(ForwardMode.EXTEND, steps, num_tokens=total + 3, num_seqs=n + 1,
                          page_size=ps, max_pages=16, num_mask_words=1)
    t = 0
    for i, st in enumerate(steps):
        k, pages = len(st.token_ids), np.asarray(st.pages)
        pos = np.arange(st.prefix_len, st.prefix_len + k)
        rows = slice(t, t + k)
        assert hb.input_ids[rows].tolist() == list(st.token_ids)
        assert hb.positions[rows].tolist() == pos.tolist()
        assert hb.out_slots[rows].tolist() == (pages[pos // ps] * ps + pos % ps).tolist()
        assert (hb.starts[i], hb.sample_rows[i], hb.seq_lens[i]) == (t, t + k - 1,
                                                                     st.prefix_len + k)
        assert hb.page_table[i, : len(pages)].tolist() == pages.tolist()
        assert not hb.page_table[i, len(pages):].any()
        t += k
    assert not hb.input_ids[t:].any() and not hb.out_slots[t:].any()


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
    assert set(actions["schedule_policy"].choices) == {"lpm", "fcfs", "dfs-weight", "program"}
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
