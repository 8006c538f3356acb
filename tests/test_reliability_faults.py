"""Defence in depth inside the processes: an exception while handling one request ends that
request alone (an error output with a status, its KV pages discarded) and everybody else keeps
running; messages that bypass the HTTP checks are re-checked. Real scheduler, real tiny model
(in-process `Engine`), real detokenizer state and message codec; faults are injected by
replacing one request's grammar matcher, the runner's step, or the decode function."""

from __future__ import annotations

import checkpoints as ck
import msgspec
import numpy as np
import pytest

from sgl_tpu import Engine, messages
from sgl_tpu.constrained.base import GrammarError
from sgl_tpu.detokenize import DetokenizerState
from sgl_tpu.messages import BatchTokenIdOut, ReqOutput, TokenizedGenerateReq
from sgl_tpu.server.detokenizer_process import _rids

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")
    eng = Engine(model_dir, page_size=4, max_total_tokens=1024, max_running_requests=8,
                 chunked_prefill_size=128, min_token_bucket=32, kv_tile=16, block_q=16,
                 dtype="float32", skip_warmup=True)
    yield eng
    eng.shutdown()


def _run(engine, reqs: list[TokenizedGenerateReq], before_step=None, max_steps: int = 200
         ) -> dict[str, ReqOutput]:
    """Submit raw scheduler messages, step until all finished; the final output per rid."""
    sched = engine.scheduler
    final: dict[str, ReqOutput] = {}
    for msg in reqs:
        err = sched.add_request(msg)
        if err is not None:
            final[msg.rid] = err
    for step in range(max_steps):
        if len(final) == len(reqs):
            break
        if before_step is not None:
            before_step(step)
        for out in sched.step():
            if out.finished:
                final[out.rid] = out
    assert len(final) == len(reqs), "requests hung"
    assert not sched.has_work
    sched.check_integrity()
    assert sched.memory_info()["num_pages_requests"] == 0
    return final


def _req(rid: str, n: int, **sampling) -> TokenizedGenerateReq:
    ids = np.random.default_rng(len(rid)).integers(3, 300, 12).tolist()
    return TokenizedGenerateReq(rid=rid, input_ids=ids,
                                sampling={**GREEDY, "max_new_tokens": n, **sampling})


class _FailingMatcher:
    """Allows every token until `fail_at` masks were asked for, then raises `exc`."""

    def __init__(self, exc: Exception, fail_at: int) -> None:
        self.exc, self.fail_at, self.calls = exc, fail_at, 0

    def fill_bitmask(self, row: np.ndarray) -> None:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise self.exc
        row[:] = -1

    def accept_token(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return []

    def rollback(self, num_tokens: int) -> None:
        pass

    def error(self) -> str | None:
        return None


@pytest.mark.parametrize("exc, status", [(RuntimeError("injected matcher bug"), 500),
                                         (GrammarError("grammar too complex: injected"), 400)])
def test_matcher_fault_ends_only_its_request(engine, exc, status):
    sched = engine.scheduler
    victim = _req("victim", 12)

    def inject(step: int) -> None:
        for req in sched.waiting + sched.running:
            if req.rid == "victim" and req.matcher is None:
                req.matcher = _FailingMatcher(exc, fail_at=3)
                req.sampling = req.sampling.replace(regex=".*")  # no jump-forward/draft paths

    final = _run(engine, [victim, _req("bystander-1", 10), _req("bystander-2", 7)], inject)
    reason = final["victim"].finish_reason
    assert reason["type"] == "abort" and reason["status_code"] == status
    assert str(exc) in reason["message"]
    assert final["bystander-1"].completion_tokens == 10
    assert final["bystander-2"].completion_tokens == 7
    assert sched.stats.num_requests_failed >= 1


def test_step_fault_fails_that_step_then_serves(engine):
    sched = engine.scheduler
    runner = sched.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky_forward(mode, steps):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected device step fault")
        return real_forward(mode, steps)

    runner.forward = flaky_forward
    try:
        sched.add_request(_req("a", 6))
        sched.add_request(_req("b", 6))
        outs: dict[str, ReqOutput] = {}
        for _ in range(50):
            try:
                produced = sched.step()
            except RuntimeError as e:  # what the scheduler process does on a step fault
                produced = sched.fail_all(e)
            outs.update({o.rid: o for o in produced if o.finished})
            if not sched.has_work:
                break
    finally:
        runner.forward = real_forward
    assert {o.finish_reason["status_code"] for o in outs.values()} == {500}
    sched.check_integrity()
    assert sched.memory_info()["num_pages_requests"] == 0
    assert _run(engine, [_req("after", 5)])["after"].completion_tokens == 5


def test_scheduler_rechecks_what_bypasses_http(engine):
    vocab = engine.scheduler.vocab_size
    final = _run(engine, [
        _req("stop-id", 5, stop_token_ids=[vocab + 5], min_new_tokens=2),
        TokenizedGenerateReq(rid="bad-ids", input_ids=[1, vocab + 1], sampling=GREEDY),
        _req("bad-bool", 5, skip_special_tokens="no"),
        _req("ok", 4),
    ])
    for rid, word in (("stop-id", "stop_token_ids"), ("bad-ids", "input_ids"),
                      ("bad-bool", "skip_special_tokens")):
        reason = final[rid].finish_reason
        assert reason["status_code"] == 400 and word in reason["message"]
    assert final["ok"].completion_tokens == 4


def test_detokenizer_fault_ends_only_its_request():
    def decode(ids, skip):
        if 13 in ids:
            raise ValueError("injected decode fault")
        return "".join(chr(97 + i % 26) for i in ids)

    state = DetokenizerState(decode)
    outs = state.process([ReqOutput(rid="bad", new_token_ids=[13]),
                          ReqOutput(rid="good", new_token_ids=[1, 2], finished=True)])
    assert outs[0].finished and outs[0].finish_reason["status_code"] == 500
    assert outs[1].new_text == "bc" and outs[1].finished


def test_undecodable_batch_still_names_its_requests():
    good = messages.encode(BatchTokenIdOut(outputs=[ReqOutput(rid="r1", new_token_ids=[1]),
                                                    ReqOutput(rid="r2", new_token_ids=[2])]))
    raw = msgspec.msgpack.decode(good)
    raw["outputs"][1]["skip_special_tokens"] = "no"  # what used to kill the detokenizer
    bad = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError):
        messages.decode(bad)
    assert _rids(bad) == ["r1", "r2"]
