"""The scheduler against a model runner whose outputs can be worked out by hand: it implements
the step contract (executor/step.py) and answers every sequence with `last input token + 1`
(mod V). Chunked prefill, prefix caching, retraction under KV pressure and aborts are then
checked exactly, with no model, plus the KV integrity invariant after every step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.executor.step import ForwardMode, SeqStep, StepResult
from sgl_tpu.messages import TokenizedGenerateReq
from sgl_tpu.scheduler.intake import COPIED_FIELDS

V = 1000
PAGE = 4


class PlusOneRunner:
    """Step contract with hand-computable outputs; records (mode, [(new, prefix)]) per call."""

    backend = "fake"
    kv_bytes = 0

    def __init__(self) -> None:
        self.calls: list[tuple[ForwardMode, list[tuple[int, int]]]] = []

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        self.calls.append((mode, [(len(s.token_ids), s.prefix_len) for s in steps]))
        n = len(steps)
        ids = np.array([(int(s.token_ids[-1]) + 1) % V for s in steps], np.int32)
        return StepResult(ids, np.full(n, -0.5, np.float32), np.zeros((n, 0), np.int32),
                          np.zeros((n, 0), np.float32), hidden=None)

    def token_logprobs(self, hidden, target_ids):  # not asked for in these tests
        raise AssertionError("no input log-probs were requested")

    def row_logits(self, hidden, rows):
        raise AssertionError("no jump-forward without a grammar")

    def warmup(self) -> float:
        return 0.0

    def num_compilations(self) -> int:
        return 0

    def compute_info(self) -> dict:
        return {"backend": "fake"}


def make_scheduler(num_pages: int = 64, chunk: int = 16, max_running: int = 8):
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=max_running, max_extend_seqs=8,
                          chunked_prefill_size=chunk, context_len=512)
    runner = PlusOneRunner()
    sched = Scheduler(cfg, runner, num_pages=num_pages, decode=lambda ids, skip: "",
                      eos_token_ids=(), vocab_size=V)
    return sched, runner


def request(rid: str, prompt: list[int], max_new: int, **sp) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=prompt,
                                sampling={"max_new_tokens": max_new, "temperature": 0.0, **sp})


def run_steps(sched, out: dict[str, dict], max_steps: int = 500) -> dict[str, dict]:
    """Step until idle or `max_steps`, checking integrity after every step; collects per rid
    the new tokens, the finish reason and the cached-token count into `out`."""
    for _ in range(max_steps):
        if not sched.has_work:
            break
        for o in sched.step():
            r = out.setdefault(o.rid, {"ids": [], "reason": None, "cached": 0})
            r["ids"] += o.new_token_ids
            r["cached"] = max(r["cached"], o.cached_tokens)
            if o.finished:
                r["reason"] = o.finish_reason
        sched.check_integrity()
    return out


def run_all(sched) -> dict[str, dict]:
    out = run_steps(sched, {})
    assert not sched.has_work, "scheduler did not go idle"
    return out


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + k) % V for k in range(1, n + 1)]


def test_chunked_prefill_runs_budget_sized_chunks_then_decodes():
    sched, runner = make_scheduler(chunk=16)
    prompt = list(range(100, 150))  # 50 tokens: chunks of 16, 16, 16, 2
    assert sched.add_request(request("a", prompt, 5)) is None
    out = run_all(sched)
    assert out["a"]["ids"] == expected(prompt, 5)
    assert out["a"]["reason"]["type"] == "length"
    extends = [c for m, c in runner.calls if m == ForwardMode.EXTEND]
    assert extends == [[(16, 0)], [(16, 16)], [(16, 32)], [(2, 48)]]
    decodes = [c for m, c in runner.calls if m == ForwardMode.DECODE]
    assert decodes == [[(1, 50 + k)] for k in range(4)]  # first token came from the prefill


def test_chunks_of_a_long_prompt_take_turns_with_the_running_decode():
    """A stream decodes one token between any two chunks of a prompt that arrives beside it,
    and both outputs stay exact."""
    sched, runner = make_scheduler(chunk=16)
    stream = list(range(10, 14))
    sched.add_request(request("s", stream, 20))
    out = run_steps(sched, {}, max_steps=2)  # its prefill, one decode
    prompt = list(range(100, 150))  # 50 tokens: chunks of 16, 16, 16, 2
    sched.add_request(request("a", prompt, 3))
    run_steps(sched, out)
    assert out["s"]["ids"] == expected(stream, 20)
    assert out["a"]["ids"] == expected(prompt, 3)
    modes = [m for m, _ in runner.calls][2:7]
    assert modes == [ForwardMode.EXTEND, ForwardMode.DECODE] * 2 + [ForwardMode.EXTEND]


def test_load_counts_a_chunked_prompt_and_a_jump_forward_request_as_running():
    """`/server_info`, `/get_load` and the harness's idle check see every admitted request:
    one between its prefill chunks and one waiting to re-extend after a jump forward hold KV
    pages, and neither is in `running`."""
    from sgl_tpu.scheduler.stats import load_info, server_info

    sched, _ = make_scheduler(chunk=16)
    sched.add_request(request("a", list(range(100, 150)), 3))  # 50 tokens: 4 chunks
    sched.step()
    assert not sched.running and sched.queues.chunked_req is not None
    assert server_info(sched)["num_running_reqs"] == 1
    load = load_info(sched)
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (1, 0)
    assert (load["num_tokens"], load["num_pending_tokens"]) == (16, 34)
    run_steps(sched, {}, max_steps=3)  # the other chunks, then the first decode
    a = sched.running.pop()
    a.jumped = True
    sched.queues.jump_forward_reqs.append(a)
    assert server_info(sched)["num_running_reqs"] == 1 and load_info(sched)["num_reqs"] == 1
    out = run_all(sched)
    assert out["a"]["reason"]["type"] == "length"
    assert server_info(sched)["num_running_reqs"] == 0


def test_cached_prefix_is_not_recomputed():
    sched, runner = make_scheduler(chunk=64)
    prompt = list(range(200, 230))  # 30 tokens
    sched.add_request(request("a", prompt, 2))
    run_all(sched)
    runner.calls.clear()
    sched.add_request(request("b", prompt + [7, 8, 9], 3))
    out = run_all(sched)
    # a's KV covers its prompt and first output (31 tokens; its last token was never run):
    # 7 whole pages = 28 tokens are in the tree, so b runs only its last 5 tokens
    first = runner.calls[0]
    assert first[0] == ForwardMode.EXTEND and first[1] == [(33 - 28, 28)]
    assert out["b"]["cached"] == 28
    assert out["b"]["ids"] == expected(prompt + [7, 8, 9], 3)


def test_retraction_under_kv_pressure_keeps_outputs_exact():
    # 12 usable pages of 4 tokens; three requests that grow to 8 + 12 = 20 tokens (5 pages)
    # each cannot all stay resident: some are retracted, requeued and finished later
    sched, _ = make_scheduler(num_pages=13, chunk=64, max_running=3)
    prompts = {f"r{i}": list(range(300 + 10 * i, 308 + 10 * i)) for i in range(3)}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, 12)) is None
    out = run_all(sched)
    assert sched.stats.num_retractions > 0
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, 12), rid
        assert out[rid]["reason"]["type"] == "length"
    tree_pages = sched.kv.tree.evictable_size() // PAGE
    assert sched.kv.allocator.num_free_pages + tree_pages == 12  # nothing held, nothing lost


def test_short_memory_retracts_a_jump_forward_request_before_ending_the_last_runner():
    """A request waiting to re-extend after a jump forward holds KV but does not decode. When
    the only running request needs a page and that request holds the rest, it is retracted
    (not the runner ended without an answer, which left its client waiting forever)."""
    # 5 usable pages of 4 tokens: a (8-token prompt) and b (7) take 2 each; a's first decode
    # takes the last free page
    sched, _ = make_scheduler(num_pages=6, chunk=64, max_running=2)
    prompts = {"a": list(range(10, 18)), "b": list(range(40, 47))}
    for rid, p in prompts.items():
        assert sched.add_request(request(rid, p, 8)) is None
    out = run_steps(sched, {}, max_steps=2)  # EXTEND (both), DECODE
    assert len(sched.running) == 2 and sched.kv.allocator.num_free_pages == 0
    # b jumps forward (no forced token here): it leaves the decode batch until it is
    # re-extended, which needs a page it cannot get while a runs
    b = next(r for r in sched.running if r.rid == "b")
    sched.running.remove(b)
    b.jumped = True
    sched.queues.jump_forward_reqs.append(b)
    out = run_steps(sched, out)
    assert not sched.has_work, "scheduler did not go idle"
    for rid, p in prompts.items():
        assert out[rid]["ids"] == expected(p, 8), rid
        assert out[rid]["reason"]["type"] == "length", out[rid]
    assert sched.stats.num_retractions >= 1 and sched.stats.num_requests_finished == 2


def test_abort_ends_one_request_and_frees_its_pages():
    sched, _ = make_scheduler(chunk=64)
    sched.add_request(request("keep", list(range(10, 20)), 6))
    sched.add_request(request("drop", list(range(40, 50)), 50))
    out = run_steps(sched, {}, max_steps=2)  # both prefilled, one decode step
    sched.abort("drop")
    run_steps(sched, out)
    assert not sched.has_work
    assert out["drop"]["reason"]["type"] == "abort"
    assert out["keep"]["ids"] == expected(list(range(10, 20)), 6)
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("bad, message", [
    ({"max_new_tokens": 5, "temperature": -1.0}, "temperature"),
    ({"max_new_tokens": 10_000}, "context"),
])
def test_requests_that_cannot_run_are_refused_at_intake(bad, message):
    sched, runner = make_scheduler()
    err = sched.add_request(TokenizedGenerateReq(rid="x", input_ids=[1, 2, 3], sampling=bad))
    assert err is not None and err.finished and message in err.finish_reason["message"]
    assert not sched.has_work and not runner.calls


def test_intake_carries_the_request_fields_to_the_req():
    """The fields a Req shares with the request by name arrive as sent; the rest as intake
    derives them (prompt copied, sampling parsed, top_logprobs_num bounded, priority kept)."""
    assert {"rid", "return_logprob", "logprob_start_len", "session_id", "retention_seconds",
            "tool_pause", "may_call_tools"} <= set(COPIED_FIELDS)
    sched, _ = make_scheduler()
    msg = TokenizedGenerateReq(rid="fields", input_ids=[1, 2, 3],
                               sampling={"max_new_tokens": 2, "temperature": 0.5},
                               return_logprob=True, logprob_start_len=1, top_logprobs_num=500,
                               session_id="agent-1", priority=5, retention_seconds=30.0,
                               tool_pause=True, may_call_tools=True, program_id="user-1")
    assert sched.add_request(msg) is None
    req = sched.waiting[-1]
    assert all(getattr(req, name) == getattr(msg, name) for name in COPIED_FIELDS)
    assert req.origin_input_ids == [1, 2, 3] and req.sampling.temperature == 0.5
    assert req.top_logprobs_num == sched.config.max_top_logprobs and req.priority == 5
    bad = msgspec.structs.replace(msg, rid="bad", program_id="")
    err = sched.add_request(bad)
    assert err is not None and "program_id" in err.finish_reason["message"]


# ---- overlap scheduling (scheduler/overlap.py) --------------------------------------------------
class OverlapPlusOneRunner(PlusOneRunner):
    """PlusOneRunner that also dispatches: placeholder inputs resolve, as on a device, from the
    last dispatched step's tokens; results come back only when asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.last_ids = np.zeros(0, np.int32)
        self.lagged_steps = 0  # dispatched steps with placeholder inputs

    def dispatch(self, mode: ForwardMode, steps: Sequence[SeqStep]):
        from sgl_tpu.executor.step import DoneStep, has_placeholders, resolve_placeholders

        self.lagged_steps += has_placeholders(steps)
        resolved = [dataclasses.replace(s, token_ids=resolve_placeholders(
            np.asarray(s.token_ids), self.last_ids).tolist()) for s in steps]
        result = self.forward(mode, resolved)
        self.last_ids = result.token_ids
        return DoneStep(result)


def _mixed_traffic(overlap: bool) -> tuple[dict[str, dict], object]:
    """Chunked prompts, stop tokens met mid-stream (found one step late under overlap), an
    abort, a late arrival and KV pressure (retraction); run to idle."""
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=4, max_extend_seqs=4,
                          chunked_prefill_size=24, context_len=512, overlap_schedule=overlap)
    runner = OverlapPlusOneRunner()
    sched = Scheduler(cfg, runner, num_pages=22, decode=lambda ids, skip: "",
                      eos_token_ids=(), vocab_size=V)
    reqs = [request("long", list(range(100, 140)), 9),  # 40 tokens: two chunks
            request("stop", list(range(200, 205)), 30, stop_token_ids=[211]),
            request("stop1", list(range(300, 305)), 30, stop_token_ids=[306]),  # 1st decode
            request("drop", list(range(400, 410)), 40),
            request("one", [7, 8, 9], 1),
            request("grow", list(range(500, 512)), 25)]
    for r in reqs:
        assert sched.add_request(r) is None
    out = run_steps(sched, {}, max_steps=6)
    sched.abort("drop")
    sched.add_request(request("late", list(range(600, 606)), 11, stop_token_ids=[613]))
    run_steps(sched, out)
    assert not sched.has_work
    return out, sched


def test_overlap_gives_the_serial_outputs_and_frees_every_page():
    serial, _ = _mixed_traffic(overlap=False)
    out, sched = _mixed_traffic(overlap=True)
    assert sched.runner.lagged_steps > 5  # the overlap path did run
    assert sched.stats.num_retractions > 0
    assert out["drop"]["reason"]["type"] == "abort"
    del serial["drop"], out["drop"]  # how far an abort gets depends on when it arrives
    assert out == serial
    assert out["stop"]["ids"] == list(range(205, 212))  # ends at the stop token, nothing more
    assert out["stop1"]["ids"] == [305, 306]
    assert out["late"]["ids"] == [606, 607, 608, 609, 610, 611, 612, 613]
    assert out["grow"]["ids"] == expected(list(range(500, 512)), 25)
    assert sched.flush_cache()
    assert sched.kv.allocator.num_free_pages == 21  # all but the reserved page


def test_overlap_discards_the_row_of_a_request_that_finished_one_step_late():
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=4, max_extend_seqs=4,
                          chunked_prefill_size=64, context_len=512, overlap_schedule=True)
    runner = OverlapPlusOneRunner()
    sched = Scheduler(cfg, runner, num_pages=16, decode=lambda ids, skip: "",
                      eos_token_ids=(), vocab_size=V)
    sched.add_request(request("a", [1, 2, 3], 20, stop_token_ids=[6]))
    sched.add_request(request("b", [50, 51, 52], 6))
    out = run_all(sched)
    assert out["a"] == {"ids": [4, 5, 6], "reason": {"type": "stop", "matched": 6},
                        "cached": 0}
    assert out["b"]["ids"] == expected([50, 51, 52], 6)
    # decode steps: a and b (lag 0), a and b (a's stop token not yet seen), then b alone
    # twice more; b's last step has no second row: its length finish is known in advance
    decodes = [len(c) for m, c in runner.calls if m == ForwardMode.DECODE]
    assert decodes == [2, 2, 2, 1, 1]


EOS = 500


class EosWantingRunner(OverlapPlusOneRunner):
    """Answers EOS wherever a step's vocab mask allows it, else `last input token + 1`."""

    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        result = super().forward(mode, steps)
        ids = result.token_ids.copy()
        for i, s in enumerate(steps):
            if s.bitmask is None or (int(s.bitmask.view(np.uint32)[EOS // 32]) >> EOS % 32) & 1:
                ids[i] = EOS
        return dataclasses.replace(result, token_ids=ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_min_new_tokens_bans_eos_even_with_ignore_eos(overlap):
    """min_new_tokens masks EOS (and stop ids) up to that many outputs whether or not
    ignore_eos is set, as SGLang's min-new-tokens penalizer does, also in the lagged steps of
    overlap scheduling (their mask is one token ahead); after it, ignore_eos decides whether an
    EOS ends the request."""
    from sgl_tpu.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(page_size=PAGE, max_running_requests=4, max_extend_seqs=4,
                          chunked_prefill_size=64, context_len=512, overlap_schedule=overlap)
    runner = EosWantingRunner()
    sched = Scheduler(cfg, runner, num_pages=32, decode=lambda ids, skip: "",
                      eos_token_ids=(EOS,), vocab_size=V)
    sched.add_request(request("forced", [10, 11, 12], 6, ignore_eos=True, min_new_tokens=4))
    sched.add_request(request("ignore", [20, 21, 22], 3, ignore_eos=True))
    sched.add_request(request("min", [30, 31, 32], 6, min_new_tokens=2))
    out = run_all(sched)
    assert out["forced"]["ids"] == [13, 14, 15, 16, EOS, EOS]
    assert out["forced"]["reason"] == {"type": "length", "length": 6}
    assert out["ignore"]["ids"] == [EOS, EOS, EOS]
    assert out["min"]["ids"] == [33, 34, EOS]
    assert out["min"]["reason"] == {"type": "stop", "matched": EOS}
    if overlap:
        assert runner.lagged_steps > 0
