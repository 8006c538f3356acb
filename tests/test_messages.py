"""Every cross-process message survives msgpack encoding unchanged, and the decoder refuses
what is not one of them (a process treats its inbox as untrusted)."""

from __future__ import annotations

import msgspec
import pytest

from sgl_tpu import messages as M

OUTPUT = M.ReqOutput(rid="r1", new_token_ids=[5, 6], finished=True,
                     finish_reason={"type": "stop", "matched": "\n"}, prompt_tokens=9,
                     completion_tokens=2, cached_tokens=8, stop_text_offset=3,
                     skip_special_tokens=False, stop_strs=["\n"],
                     output_token_logprobs=[[-0.5, 5], [-0.25, 6]],
                     output_top_logprobs=[[[-0.5, 5]], [[-0.25, 6]]],
                     input_token_logprobs=[[None, 1]], input_top_logprobs=[None])
STR_OUT = M.ReqStrOut(rid="r1", new_text="héllo ✓", new_output_ids=[5, 6], finished=True,
                      finish_reason={"type": "stop", "matched": "x+"}, prompt_tokens=9,
                      completion_tokens=2, cached_tokens=8, text_cut=3,
                      output_token_logprobs=[[-0.5, 5]], output_top_logprobs=[[[-0.5, 5]]])

MESSAGES = [
    M.TokenizedGenerateReq(rid="r1", input_ids=[1, 2, 3],
                           sampling={"max_new_tokens": 4, "stop": ["x"], "seed": 2**63 - 1},
                           return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                           session_id="agent-7", priority=-3, retention_seconds=12.5,
                           tool_pause=True, may_call_tools=True),
    M.TokenizedGenerateReq(rid="r2", input_ids=[4], sampling={}, program_id="user-9"),
    M.TokenizedGenerateReq(rid="e1", input_ids=[4, 5], sampling={"max_new_tokens": 0},
                           embed=True),
    M.TokenizedGenerateReq(rid="l1", input_ids=[4, 5], sampling={}, lora_id=3),
    M.LoadLoraReq(call_id=11, lora_name="sql", lora_path="/adapters/sql"),
    M.UnloadLoraReq(call_id=12, lora_name="sql"),
    M.AbortReq(rid="r1"),
    M.OpenSessionReq(call_id=8, session_id="agent-7", ttl_s=60.0),
    M.OpenSessionReq(call_id=9),
    M.CloseSessionReq(call_id=10, session_id="agent-7"),
    M.ToolPauseReq(rids=["r1", "r2"]),
    M.KvHintsReq(call_id=13, session_id="agent-7", actions=[
        M.KvHintAction(action_id="a1", action_type="prefetch", ttl_s=30.0),
        M.KvHintAction(action_id="a2", action_type="release")]),
    M.ControlReq(call_id=7, name="server_info"),
    M.ControlResp(call_id=7, ok=True, data={"memory": {"num_pages_free": 3}}),
    M.ReadyMsg(process="scheduler", ok=False, error="boom", info={"pid": 1}),
    M.BatchTokenIdOut(outputs=[OUTPUT]),
    M.BatchStrOut(outputs=[STR_OUT]),
    M.BatchTokenIdOut(outputs=[M.ReqOutput(rid="e1", new_token_ids=[], finished=True,
                                           prompt_tokens=2, embedding=[0.1, -2.5e-8, 3.0])]),
    M.BatchStrOut(outputs=[M.ReqStrOut(rid="e1", new_text="", new_output_ids=[], finished=True,
                                       finish_reason={"type": "length", "length": 0},
                                       prompt_tokens=2, completion_tokens=0, cached_tokens=0,
                                       embedding=[0.1, -2.5e-8, 3.0])]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    decoded = M.decode(M.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


def test_decoder_refuses_foreign_data():
    with pytest.raises(msgspec.DecodeError):
        M.decode(msgspec.msgpack.encode({"type": "Nope", "rid": "x"}))
    with pytest.raises(msgspec.ValidationError):  # right tag, wrong field type
        M.decode(msgspec.msgpack.encode({"type": "AbortReq", "rid": 5}))
