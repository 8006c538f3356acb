"""The Responses API's pure parts, without a server: the store's bound and expiry (on a test
clock), input items -> chat messages and item resources, `input_items` pages, truncation cuts,
output-text log-probs, `reasoning.effort`, the streamed event sequence built from chat
chunks (reasoning, text and parallel tool calls, log-probs, as the chat path streams them), and
a background run's snapshots and final states."""

from __future__ import annotations

import asyncio

import pytest

from sgl_tpu.server.responses_background import BackgroundRuns
from sgl_tpu.server.responses_items import input_item_resources, page, truncation_cuts
from sgl_tpu.server.responses_protocol import (
    chat_tools,
    items_to_messages,
    output_items,
    text_logprobs,
    thinking_kwargs,
)
from sgl_tpu.server.responses_store import ResponseStore
from sgl_tpu.server.responses_stream import ResponseEvents
from sgl_tpu.server.tokenizer_manager import RequestError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, rid: str) -> None:
    store.put({"id": rid}, [{"role": "user", "content": rid}], conversation_id=rid)


def test_store_expires_entries_a_ttl_after_their_last_use():
    clock = Clock()
    store = ResponseStore(max_count=10, ttl_s=60, clock=clock)
    put(store, "a")
    put(store, "b")
    clock.now = 50
    assert store.get("a") is not None  # renews a until 110
    clock.now = 100
    assert store.get("b") is None and store.get("a") is not None  # b expired at 60
    clock.now = 200
    assert store.get("a") is None and len(store) == 0


def test_store_keeps_at_most_max_count_dropping_least_recently_used():
    store = ResponseStore(max_count=2, ttl_s=60, clock=Clock())
    put(store, "a")
    put(store, "b")
    store.get("a")
    put(store, "c")  # b is the least recently used
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    with pytest.raises(ValueError):
        ResponseStore(max_count=0, ttl_s=1)


def test_items_to_messages():
    msgs = items_to_messages([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ])
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    assert items_to_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad, needle in [([{"type": "function_call", "name": "f"}], "call_id"),
                        ([{"role": "robot", "content": "x"}], "role"),
                        (["text"], "must be an object")]:
        with pytest.raises(RequestError, match=needle):
            items_to_messages(bad)


def test_output_items_replay_as_the_assistant_message():
    message = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    items = output_items(message)
    assert [it["type"] for it in items] == ["message", "function_call"]
    assert items[1]["call_id"] == "c1"
    assert items_to_messages(items) == [message]  # how the next turn replays them
    assert [it["type"] for it in output_items({"content": None})] == ["message"]


def chunk(delta=None, finish=None, usage=None):
    choices = [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish}]
    return {"choices": choices, "usage": usage}


def test_stream_events_for_reasoning_text_and_parallel_calls():
    events = ResponseEvents({"id": "resp_1", "object": "response", "usage": None})
    out = events.start()
    for c in [chunk({"role": "assistant", "content": ""}),
              chunk({"reasoning_content": "Need "}), chunk({"reasoning_content": "weather."}),
              chunk({"content": "Checking"}), chunk({"content": "."}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                                     "function": {"name": "get_time", "arguments": "{}"}}]}),
              chunk(finish="tool_calls"),
              chunk(usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14,
                           "prompt_tokens_details": {"cached_tokens": 3}})]:
        out += events.feed(c)
    closing, final = events.finish()
    out += closing
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.added"] == [
        0, 1, 2, 3]
    assert final["status"] == "completed"
    assert [it["type"] for it in final["output"]] == [
        "reasoning", "message", "function_call", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Checking."
    assert final["output"][2]["arguments"] == '{"city": "Paris"}'
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 3}
    assert all(it["status"] == "completed" for it in final["output"])


def test_stream_events_length_is_incomplete_and_empty_answer_is_one_message():
    events = ResponseEvents({"id": "resp_2"})
    out = events.start() + events.feed(chunk(finish="length"))
    closing, final = events.finish()
    out += closing
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in closing] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [it["type"] for it in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == ""


def test_background_run_snapshots_and_ends_in_a_final_state():
    """Progress shows the open item in progress; a run cancelled mid-way, or before its task
    first ran, or whose chunks raise, ends stored in a final state."""

    async def scenario() -> list[dict]:
        saved: list[dict] = []

        def save(final: dict, _events: list | None) -> None:
            saved.append(final)

        runs = BackgroundRuns()
        gate = asyncio.Event()

        async def chunks():
            yield chunk({"content": "Hel"})
            await gate.wait()  # blocks until cancelled
            yield chunk({"content": "lo"})

        events = ResponseEvents({"id": "resp_a", "status": "queued"})
        assert runs.start(events, [], save, chunks()).response()["status"] == "queued"
        for _ in range(100):  # a few loop turns: the task runs to its first chunk
            if events.items:
                break
            await asyncio.sleep(0)
        progress = runs.get("resp_a").response()
        assert progress["status"] == "in_progress"
        assert progress["output"][0]["status"] == "in_progress"
        assert progress["output"][0]["content"][0]["text"] == "Hel"
        cancelled = await runs.cancel("resp_a")
        assert cancelled["status"] == "cancelled" and runs.get("resp_a") is None
        assert cancelled["output"][0]["status"] == "incomplete"
        # cancelled before its task ran a step
        runs.start(ResponseEvents({"id": "resp_b"}), [], save, chunks())
        assert (await runs.cancel("resp_b"))["status"] == "cancelled"

        async def broken():
            yield chunk({"content": "x"})
            raise RuntimeError("boom")

        runs.start(ResponseEvents({"id": "resp_c"}), [], save, broken())
        for _ in range(100):
            if runs.get("resp_c") is None:
                break
            await asyncio.sleep(0)
        return saved

    saved = asyncio.run(scenario())
    assert [(r["id"], r["status"]) for r in saved] == [
        ("resp_a", "cancelled"), ("resp_b", "cancelled"), ("resp_c", "failed")]
    assert saved[2]["error"] == {"code": "server_error", "message":
                                 "internal server error (RuntimeError); see the server log"}


def test_chat_tools_flat_and_chat_forms():
    fn = {"name": "f", "description": "d", "parameters": {"type": "object"}}
    want = [{"type": "function", "function": fn}]
    assert chat_tools([{"type": "function", **fn}]) == want
    assert chat_tools(want) == want
    with pytest.raises(RequestError, match="function tools only"):
        chat_tools([{"type": "file_search"}])


def test_input_item_resources_have_ids_and_replay_the_same_messages():
    items = [{"role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok", "id": "mine"}]
    res = input_item_resources(items)
    assert [r["id"][:3] for r in res[:2]] == ["msg", "fc_"] and res[2]["id"] == "mine"
    assert res[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert all(r["status"] == "completed" for r in res)
    assert items_to_messages(res) == items_to_messages(items)
    assert input_item_resources("hi")[0]["role"] == "user"


def test_input_items_pages_like_openai():
    items = [{"id": f"i{k}"} for k in range(5)]
    first = page(items, {"limit": "2"})  # newest first by default
    assert [it["id"] for it in first["data"]] == ["i4", "i3"]
    assert (first["object"], first["first_id"], first["last_id"], first["has_more"]) == (
        "list", "i4", "i3", True)
    rest = page(items, {"limit": "2", "after": "i3"})
    assert [it["id"] for it in rest["data"]] == ["i2", "i1"] and rest["has_more"]
    last = page(items, {"order": "asc", "after": "i3"})
    assert [it["id"] for it in last["data"]] == ["i4"] and not last["has_more"]
    assert page([], {})["data"] == [] and page([], {})["first_id"] is None
    for bad, needle in [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                        ({"limit": "101"}, "limit"), ({"order": "up"}, "order"),
                        ({"after": "nope"}, "after")]:
        with pytest.raises(RequestError, match=needle):
            page(items, bad)


def test_truncation_cuts_start_turns_and_keep_calls_with_outputs():
    user = {"type": "message", "role": "user"}
    call = {"type": "function_call", "call_id": "c"}
    items = [user, {"type": "message", "role": "assistant"},    # turn 1
             user, call, {"type": "function_call_output", "call_id": "c"},  # turn 2, a tool
             {"type": "message", "role": "assistant"},
             user, call | {"call_id": "d"},                       # turn 3 asks for a tool
             {"type": "function_call_output", "call_id": "d"}]    # the new input
    assert truncation_cuts(items, 8) == [2, 6]  # not at 8: the call's output would be orphaned
    assert truncation_cuts(items, 6) == [2, 6]
    assert truncation_cuts(items, 0) == []


def test_text_logprobs_keep_the_tokens_of_the_text():
    def lp(token):
        return {"token": token, "logprob": -1.0, "bytes": [], "top_logprobs": []}

    entries = [lp("<think>"), lp("hm"), lp("</think>"), lp("\n"), lp("Hel"), lp("lo"),
               lp("<tool_call>")]
    assert [e["token"] for e in text_logprobs(entries, "Hello")] == ["Hel", "lo"]
    assert text_logprobs(entries, "") == []
    assert text_logprobs(entries, "elsewhere") == entries  # not found: all of them
    message = {"content": "Hello"}
    got = output_items(message, entries)[0]["content"][0]["logprobs"]
    assert [e["token"] for e in got] == ["Hel", "lo"]
    assert output_items(message)[0]["content"][0]["logprobs"] == []


def test_text_logprobs_find_a_character_split_over_tokens_by_bytes():
    def lp(token, data):
        return {"token": token, "logprob": -1.0, "bytes": list(data), "top_logprobs": []}

    # "é" is two tokens of one byte each; token by token each decodes to U+FFFD
    entries = [lp("<think>", b"<think>"), lp("</think>", b"</think>"), lp("caf", b"caf"),
               lp("\ufffd", b"\xc3"), lp("\ufffd", b"\xa9"), lp("<|im_end|>", b"<|im_end|>")]
    assert [e["bytes"] for e in text_logprobs(entries, "café")] == [
        list(b"caf"), [0xC3], [0xA9]]
    # text the tokens' bytes do not hold (a detokenizer that rewrote it): every entry,
    # reasoning and EOS included, as docs/agent-apis.md says
    assert text_logprobs(entries, "cafe") == entries
    events = ResponseEvents({"id": "resp_4"})
    events.start()
    deltas = []
    for content, lps in [("caf", entries[2:3]), ("", entries[3:4]), ("é", entries[4:5]),
                         ("cafe", entries[2:])]:
        c = chunk({"content": content})
        c["choices"][0]["logprobs"] = {"content": lps}
        deltas += [e["logprobs"] for e in events.feed(c)
                   if e["type"] == "response.output_text.delta"]
    # the half character waits for the delta that wrote "é"; text not in the bytes: the
    # chunk's entries, its EOS included
    assert deltas == [entries[2:3], entries[3:5], entries[2:]]


def test_reasoning_effort_none_turns_thinking_off():
    assert thinking_kwargs({"effort": "none"}) == {"enable_thinking": False}
    assert thinking_kwargs({"effort": "high", "summary": "auto"}) is None
    assert thinking_kwargs(None) is None
    with pytest.raises(RequestError, match="reasoning.effort"):
        thinking_kwargs({"effort": "max"})


def test_stream_logprobs_go_with_the_text_deltas():
    def lp(token):
        return {"token": token, "logprob": -0.5, "bytes": [], "top_logprobs": []}

    def with_lp(delta, *tokens):
        c = chunk(delta)
        c["choices"][0]["logprobs"] = {"content": [lp(t) for t in tokens]}
        return c

    events = ResponseEvents({"id": "resp_3"}, count_reasoning=lambda items: 7)
    out = events.start()
    # "\ufffd": a token that wrote no text yet (half a character); the last chunk's step
    # wrote " ok" and the EOS (a speculative step can accept both)
    for c in [with_lp({"reasoning_content": "hm"}, "hm"), with_lp({"content": ""}, "He"),
              with_lp({"content": "Hello"}, "llo"), with_lp({"content": "!"}, "!"),
              with_lp({"content": ""}, "\ufffd"), with_lp({"content": " ok"}, " ok", "<eos>"),
              chunk(finish="stop"),
              chunk(usage={"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6})]:
        out += events.feed(c)
    closing, final = events.finish()
    deltas = [e for e in out if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in e["logprobs"]] for e in deltas] == [
        ["He", "llo"], ["!"], ["\ufffd", " ok"]]
    done = next(e for e in closing if e["type"] == "response.output_text.done")
    assert [x["token"] for x in done["logprobs"]] == ["He", "llo", "!", "\ufffd", " ok"]
    assert final["output"][1]["content"][0]["logprobs"] == done["logprobs"]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 7}
