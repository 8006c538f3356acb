"""Settings declared once (sgl_tpu/settings.py, sgl_tpu/config.py): the reusable checks, the CLI
derived from the declarations, and `scheduler_config()` copying the scheduler's part by name.
Fast, no model."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from sgl_tpu.cli import build_parser, parse_args
from sgl_tpu.config import RunnerConfig, SchedulerConfig, SchedulerSettings, ServerArgs
from sgl_tpu.settings import Int, Number, OneOf, OrNone


@pytest.mark.parametrize("rule,good,bad,says", [
    (Int(1), [1, 2**40], [0, -1, True, 1.0, "1", None], "must be a positive integer"),
    (Int(0), [0, 7], [-1, False, 0.5], "must be an integer >= 0"),
    (Int(1, 64), [1, 64], [0, 65, True], "must be an integer in [1, 64]"),
    (Int(1, power_of_two=True), [1, 16], [0, 12, -16, True], "must be a power of two"),
    (Number(), [0, 0.5, 10**9], [-0.1, math.inf, math.nan, True, "1"],
     "must be a finite number >= 0"),
    (Number(0, lo_open=True), [1e-9, 3], [0, math.inf], "must be a finite number > 0"),
    (Number(0, 1, lo_open=True), [1, 0.125], [0, 1.5, False], "must be in (0, 1]"),
    (Number(0, 1), [0, 1], [-0.01, 1.01], "must be in [0, 1]"),
    (OneOf(("on", "off")), ["on"], ["auto", None], "must be one of ('on', 'off')"),
    (OrNone(Int(0)), [None, 3], [-3, True], "must be an integer >= 0"),
])
def test_rules_accept_and_refuse_with_a_message_naming_the_field(rule, good, bad, says):
    for value in good:
        rule("x", value)
    for value in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(f'x {says}, got {value!r}')}$"):
            rule("x", value)


def test_every_setting_is_declared_with_help_and_every_flag_derives_from_it():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(ServerArgs):
        assert f.metadata["help"], f.name
        if not f.metadata["flag"]:
            assert f.name not in actions
            continue
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        assert action.default == f.default and action.help == f.metadata["help"]
        choices = getattr(f.metadata["check"], "choices", None)
        if choices:
            assert tuple(action.choices) == choices
    # the type comes from the annotation, also where the default is None
    args = parse_args(["--context-length", "99", "--omp-spin-count", "0",
                       "--hicache-size", "1", "--allow-origins", "a", "b"])
    assert (args.context_length, args.omp_spin_count, args.hicache_size,
            args.allow_origins) == (99, 0, 1.0, ("a", "b"))


@pytest.mark.parametrize("argv,says", [
    (["--page-size", "12"], "page_size must be a power of two, got 12"),
    (["--port", "0"], r"port must be an integer in \[1, 65535\], got 0"),
    (["--dp-size", "0"], r"dp_size must be an integer in \[1, 256\], got 0"),
    (["--responses-ttl-s", "0"], "responses_ttl_s must be a finite number > 0, got 0.0"),
    (["--swa-full-tokens-ratio", "2"], r"swa_full_tokens_ratio must be in \(0, 1\], got 2.0"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3 is not supported"),
    (["--served-model-name", " "], "served_model_name must not be empty"),
    (["--session-ttl-s", "700"], r"session_ttl_s must be in \(0, max_retention_s = 600.0\]"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert re.search(says, capsys.readouterr().err)


def test_scheduler_config_copies_every_scheduler_setting_by_name():
    changed = {"page_size": 8, "max_running_requests": 7, "schedule_policy": "lpm",
               "disable_radix_cache": True, "session_retention_s": 5,
               "radix_eviction_policy": "priority", "max_retention_s": 60.0,
               "session_ttl_s": 50.0, "tool_pause_grace_s": 2.0,
               "enable_priority_scheduling": True, "schedule_low_priority_values_first": True,
               "priority_scheduling_preemption_threshold": 3,
               "disable_priority_preemption": True, "default_priority_value": -2,
               "retraction_policy": "priority", "priority_aging_rate": 1,
               "program_ttl_s": 9.0, "max_top_logprobs": 3,
               "speculative_num_draft_tokens": 5,
               "speculative_ngram_min_match_window_size": 2,
               "speculative_ngram_max_match_window_size": 6,
               "speculative_suffix_max_tree_depth": 30,
               "speculative_suffix_max_cached_requests": 100,
               "speculative_suffix_max_spec_factor": 2.0,
               "speculative_suffix_min_token_prob": 0.2, "pooling": "mean",
               "disable_kv_prefetch": True}
    assert set(changed) == {f.name for f in dataclasses.fields(SchedulerSettings)}
    runner = RunnerConfig(model_path=None, dtype="float32", page_size=8, num_pages=100,
                          max_running_requests=7, max_extend_seqs=5, context_len=512,
                          token_buckets=(64, 128), seq_buckets=(1, 2), kv_tile=256, block_q=128,
                          max_top_logprobs=3)
    cfg = ServerArgs(**changed).scheduler_config(runner, overlap_schedule=True)
    for name, value in changed.items():
        assert getattr(cfg, name) == value, name
    assert isinstance(cfg.session_retention_s, float) and isinstance(cfg.priority_aging_rate,
                                                                      float)
    assert (cfg.max_extend_seqs, cfg.chunked_prefill_size, cfg.context_len) == (5, 128, 512)
    assert cfg.overlap_schedule is True and cfg.program_admission is False
    assert ServerArgs().scheduler_config(runner).program_admission is True
    with pytest.raises(ValueError, match="requires --enable-priority-scheduling"):
        SchedulerConfig(max_extend_seqs=1, chunked_prefill_size=64, context_len=64,
                        retraction_policy="priority")
