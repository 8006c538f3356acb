"""Incremental detokenization over the IPC: the detokenizer sends only new text and ids per
step, the accumulator rebuilds the cumulative result. Checked with a real byte-level BPE
(multi-byte characters split across tokens, special tokens) against decoding the whole output
at once, for every way the ids can arrive in chunks."""

from __future__ import annotations

import random

import pytest
from checkpoints import make_tiny_tokenizer

from sgl_tpu.detokenize import DetokenizerState, stop_safe_len
from sgl_tpu.messages import ReqOutput
from sgl_tpu.response import ResponseAccumulator, incremental_logprobs

TEXT = "Caf\u00e9 na\u00efve \U0001f600 r\u00e9sum\u00e9 \u2014 the quick brown fox jumps."


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _decode_fn(tok):
    return lambda ids, skip: tok.decode(list(ids), skip_special_tokens=skip)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(ids[i : i + n])
        i += n
    return out


def _stream(tok, chunks, *, skip=True, stops=(), stop_text_offset=-1, rid="r"):
    """Feed `chunks` as scheduler outputs; returns (accumulator, messages, texts after each)."""
    state = DetokenizerState(_decode_fn(tok))
    acc = ResponseAccumulator(rid)
    msgs, texts = [], []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        out = ReqOutput(rid=rid, new_token_ids=chunk, finished=last,
                        finish_reason={"type": "stop"} if last else None,
                        completion_tokens=sum(map(len, chunks[: i + 1])),
                        skip_special_tokens=skip, stop_strs=list(stops),
                        stop_text_offset=stop_text_offset if last else -1)
        (msg,) = state.process([out])
        acc.update(msg)
        msgs.append(msg)
        texts.append(acc.to_dict()["text"])
    return acc, msgs, texts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_rebuild_the_whole_decode(tok, seed, skip):
    ids = [1] + tok.encode(TEXT).ids + [2]  # <|im_start|> ... <|im_end|>
    assert len(ids) > len(TEXT) // 3  # a real split: several tokens per word, bytes per emoji
    full = tok.decode(ids, skip_special_tokens=skip)
    acc, msgs, texts = _stream(tok, _chunks(ids, random.Random(seed)), skip=skip)
    assert acc.to_dict()["text"] == full and acc.to_dict()["output_ids"] == ids
    for text in texts:  # never half a character, always a prefix of the final text
        assert "\ufffd" not in text and full.startswith(text)
    # Each character and id crossed the process boundary once: O(L), not O(L^2).
    assert sum(len(m.new_text) for m in msgs) == len(full)
    assert sum(len(m.new_output_ids) for m in msgs) == len(ids)
    assert all(m.text_cut == -1 for m in msgs)


@pytest.mark.parametrize("seed", range(4))
def test_stop_string_spanning_chunks_is_held_back_then_trimmed(tok, seed):
    ids = tok.encode(TEXT).ids
    full = tok.decode(ids)
    stop = "brown fox"
    offset = full.index(stop)
    # The scheduler ends the request at the step whose text completes the stop string.
    chunks = _chunks(ids, random.Random(seed))
    upto = next(i for i in range(len(chunks))
                if stop in tok.decode(sum(chunks[: i + 1], [])))
    acc, msgs, texts = _stream(tok, chunks[: upto + 1], stops=[stop], stop_text_offset=offset)
    for text in texts[:-1]:  # streamed: never a tail that may still become the stop string
        assert full[:offset].startswith(text) and "\ufffd" not in text
        assert not any(text.endswith(stop[:k]) for k in range(1, len(stop)))
        assert stop_safe_len(text, [stop]) == len(text)
    assert texts[-1] == full[:offset]
    assert msgs[-1].text_cut == -1


def test_final_cut_before_delivered_text(tok):
    """A `stop_regex` match can begin in text that already went out: the final message cuts."""
    ids = tok.encode(TEXT).ids
    full = tok.decode(ids)
    half = next(n for n in range(len(ids) // 2, len(ids))
                if not tok.decode(ids[:n]).endswith("\ufffd"))
    acc, msgs, texts = _stream(tok, [ids[:half], ids[half:]], stop_text_offset=4)
    assert len(texts[0]) > 4
    assert msgs[-1].text_cut == 4 and msgs[-1].new_text == ""
    assert texts[-1] == full[:4] and acc.to_dict()["output_ids"] == ids


def _with_logprobs(rid: str, ids: list[int], **kw) -> ReqOutput:
    """A scheduler output carrying one (made-up) log-prob and one top entry per token."""
    return ReqOutput(rid=rid, new_token_ids=ids, output_token_logprobs=[[-0.5, t] for t in ids],
                     output_top_logprobs=[[[-0.5, t]] for t in ids], **kw)


def test_streamed_dicts_do_not_change_afterwards(tok):
    """A streamed dict may wait (in the OpenAI routes' queue of n choices, or while a native
    stream's response starts) while more tokens arrive: its text, ids and log-probs stay as
    they were, so a chunk built from it later carries one log-prob per token of its text."""
    ids = tok.encode(TEXT).ids
    state = DetokenizerState(_decode_fn(tok))
    acc = ResponseAccumulator("r", return_logprob=True)
    acc.update(state.process([_with_logprobs("r", ids[:3], completion_tokens=3)])[0])
    first = acc.to_dict()
    meta = first["meta_info"]
    kept = (first["text"], list(first["output_ids"]), list(meta["output_token_logprobs"]),
            list(meta["output_top_logprobs"]), meta["output_token_logprobs_length"])
    acc.update(state.process([_with_logprobs("r", ids[3:], finished=True,
                                             completion_tokens=len(ids))])[0])
    assert (first["text"], first["output_ids"], meta["output_token_logprobs"],
            meta["output_top_logprobs"], meta["output_token_logprobs_length"]) == kept
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    # the streamed form of the first dict, built only now, still holds its own three entries
    chunk = incremental_logprobs(first, 0)["meta_info"]
    assert [e[1] for e in chunk["output_token_logprobs"]] == ids[:3]
    assert len(chunk["output_top_logprobs"]) == 3
    rest = incremental_logprobs(acc.to_dict(), 3)["meta_info"]
    assert [e[1] for e in rest["output_token_logprobs"]] == ids[3:]
