"""The HTTP process's TokenizerManager without the other processes: a request's sampling
params are parsed once in this process (a route's `validate`, whose result `generate` reuses),
and what crosses to the scheduler process is the request's own dict, which that process parses
again."""

from __future__ import annotations

import asyncio

import checkpoints as ck
import pytest

from sgl_tpu import messages
from sgl_tpu.config import ServerArgs
from sgl_tpu.loader import load_model
from sgl_tpu.messages import BatchStrOut, ReqStrOut, TokenizedGenerateReq
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.server.ipc import PortArgs
from sgl_tpu.server.tokenizer_manager import GenItem, ServerDead, TokenizerManager


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    model_dir = ck.make_tiny_hf_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")
    return model_dir, load_model(model_dir)


def _run(loaded, tmp_path, body) -> list[TokenizedGenerateReq]:
    """Run `body(tm)` against a TokenizerManager whose scheduler answers every request at once
    with one finished token; returns the messages sent to the scheduler."""
    model_dir, model = loaded
    ports = PortArgs(scheduler_in=f"ipc://{tmp_path}/s", detokenizer_in=f"ipc://{tmp_path}/d",
                     tokenizer_in=f"ipc://{tmp_path}/t")
    sent = []

    async def main() -> None:
        tm = TokenizerManager(ServerArgs(model_path=str(model_dir)), ports, model.tokenizer,
                              model.config.vocab_size, str(model_dir))
        tm.context_len, tm.max_total_tokens = 64, 256

        class SchedulerSocket:
            async def send(self, data: bytes) -> None:
                msg = messages.decode(data)
                sent.append(msg)
                tm._handle(BatchStrOut(outputs=[ReqStrOut(
                    rid=msg.rid, new_text="x", new_output_ids=[5], finished=True,
                    finish_reason={"type": "length", "length": 1}, prompt_tokens=3,
                    completion_tokens=1, cached_tokens=0)]))

        tm.to_scheduler = SchedulerSocket()
        try:
            await body(tm)
        finally:
            tm.close()

    asyncio.run(main())
    return sent


def test_a_request_is_parsed_once_in_the_http_process(loaded, tmp_path, monkeypatch):
    parse = SamplingParams.from_dict.__func__
    calls = []

    def counting(cls, d):
        calls.append(d)
        return parse(cls, d)

    monkeypatch.setattr(SamplingParams, "from_dict", classmethod(counting))
    sampling = {"max_new_tokens": 1, "temperature": 0.5, "stream_interval": 3}
    validated = GenItem(input_ids=[5, 6, 7], sampling=sampling)
    unvalidated = GenItem(input_ids=[5, 6, 7], sampling=dict(sampling))  # /health_generate's
    results = []

    async def body(tm: TokenizerManager) -> None:
        # a route validates its items, then generates them
        assert tm.validate(validated) is validated.parsed
        assert validated.parsed.temperature == 0.5
        results.extend([r async for r in tm.generate(validated, final_only=True)])
        assert len(calls) == 1
        # an item nobody validated is validated by generate, once
        results.extend([r async for r in tm.generate(unvalidated, final_only=True)])
        assert len(calls) == 2 and unvalidated.parsed == validated.parsed
        # a validated item still meets a server that died since
        tm.mark_dead("scheduler died")
        with pytest.raises(ServerDead, match="scheduler died"):
            await anext(tm.generate(GenItem(input_ids=[5], sampling={}, parsed=SamplingParams())))

    sent = _run(loaded, tmp_path, body)
    assert [r["text"] for r in results] == ["x", "x"]
    # the scheduler process receives the request's dict (and parses it there)
    assert [m.sampling for m in sent] == [sampling, sampling]
