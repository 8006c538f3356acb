"""The reuse oracle: the prompt tokens an unbounded prefix cache would have reused over a run.

    Trace records (prompt text, answer text, start/end) --tokenize--> token sequences
      --in start order, against every sequence seen before--> oracle tokens per request

What counts as seen before request r (the cache never evicts):
  - the prompt of every request sent before r (its KV exists once it is computed; the server
    runs a second prompt that shares an uncomputed prefix after the first, not beside it), and
  - the prompt followed by the answer of every request that ended before r (the server caches
    generated tokens too), without the answer's last token, whose KV is never computed.
r's oracle is its longest prefix shared with a seen sequence, at most its length - 1 (one token
must run to give logits), rounded down to whole pages of `page_size` tokens, as the radix cache
matches and inserts whole pages (page_size 1: the exact token count).

Tokens are the model tokenizer's: prompts encoded as the server encodes a text prompt (native
and completions APIs; special tokens added), answers encoded from their text (the APIs send no
token ids, so an answer the tokenizer would split differently counts its re-encoded tokens).
`prompt_token_mismatches` counts requests whose encoded prompt length differs from the
`prompt_tokens` the server reported (non-zero with the chat API when the server renders another
template than the harness).

Pages are matched by chained hashes (a page's hash covers every token before it), so the
oracle costs one pass over the run's tokens and a set of the distinct page hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl_tpu.bench.agent_loop.trace import RequestRecord

Encode = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> ids


def page_hashes(ids: list[int], page_size: int) -> list[int]:
    """Chained hash of each whole page of `ids`: entry i identifies ids[: (i + 1) * page_size]."""
    out, h = [], 0
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, *ids[start:start + page_size]))
        out.append(h)
    return out


def shared_pages(hashes: list[int], seen: set[int]) -> int:
    """How many leading pages of a sequence the seen set holds (prefix-closed: stop at a miss)."""
    n = 0
    for h in hashes:
        if h not in seen:
            break
        n += 1
    return n


def oracle_tokens(records: list[RequestRecord], prompts: list[list[int]], encode: Encode,
                  page_size: int) -> list[int]:
    """Per record (in the given order, `prompts` its encoded prompts): its oracle tokens."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    order = sorted(range(len(records)), key=lambda i: records[i].start_s)
    ends = sorted((i for i in range(len(records)) if records[i].ok),
                  key=lambda i: records[i].end_s)
    seen: set[int] = set()
    out = [0] * len(records)
    next_end = 0
    for pos, i in enumerate(order):
        r = records[i]
        while next_end < len(ends) and records[ends[next_end]].end_s <= r.start_s:
            j = ends[next_end]
            answer = encode(records[j].text, False)[:-1]
            seen.update(page_hashes(prompts[j] + answer, page_size))
            next_end += 1
        ids = prompts[i]
        usable = ids[: max(len(ids) - 1, 0)]
        out[i] = shared_pages(page_hashes(usable, page_size), seen) * page_size
        if pos + 1 < len(order):  # sent before the next one
            seen.update(page_hashes(ids, page_size))
    return out


def _share(reused: int, oracle: int) -> float | None:
    return reused / oracle if oracle else None


def _part(rs: list[RequestRecord], oracle: list[int]) -> dict[str, Any]:
    reused = sum(r.cached_tokens or 0 for r in rs)
    total = sum(oracle)
    return {"requests": len(rs), "reused_tokens": reused, "oracle_tokens": total,
            "reused_over_oracle": _share(reused, total)}


def oracle_report(records: list[RequestRecord], encode: Encode, page_size: int
                  ) -> dict[str, Any] | None:
    """Reused (the server's cached_tokens) against the oracle over the run's successful
    requests, overall, after a compaction and at a subagent's first call; None when the
    server reported no cached tokens or the trace has no prompt texts."""
    ok = [r for r in records if r.ok and r.prompt]
    if not ok or all(r.cached_tokens is None for r in ok):
        return None
    prompts = [encode(r.prompt, True) for r in ok]
    per = oracle_tokens(ok, prompts, encode, page_size)
    prompt_lens = [len(ids) for ids in prompts]

    def where(pred: Callable[[RequestRecord], bool]) -> dict[str, Any]:
        picked = [k for k, r in enumerate(ok) if pred(r)]
        return _part([ok[k] for k in picked], [per[k] for k in picked])

    return {
        "page_size": page_size,
        **_part(ok, per),
        "prompt_tokens": sum(prompt_lens),
        "oracle_over_prompt": _share(sum(per), sum(prompt_lens)),
        "requests_over_oracle": sum((r.cached_tokens or 0) > o
                                    for r, o in zip(ok, per, strict=True)),
        "prompt_token_mismatches": sum(n != r.prompt_tokens
                                       for r, n in zip(ok, prompt_lens, strict=True)),
        "after_compaction": where(lambda r: r.compacted),
        "subagent_first_call": where(lambda r: r.forked),
    }
