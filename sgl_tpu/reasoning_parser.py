"""Reasoning output: split a reasoning model's `<think>…</think>` block from its answer
(`--reasoning-parser`, SGLang's names), whole or incrementally.

    qwen3        the block is in the output only when the model opens it with <think>
                 (or the prompt ends inside one: Qwen3 "thinking" templates open it)
    deepseek-r1  the template opens the block: the output starts inside it, and text with no
                 </think> is all reasoning

    ReasoningSplitter(parser, in_reasoning).feed(chunk) -> (reasoning piece, content piece)
                                           .finish()    -> the held-back tail
A tail that could still become a marker is held back, so a stream never shows `</thi`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_tpu.function_call.base import partial_marker_len

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    force_reasoning: bool  # the output starts inside the block

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return self.force_reasoning or prompt_text.rstrip().endswith(START)


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", force_reasoning=False),
    "deepseek-r1": ReasoningParser("deepseek-r1", force_reasoning=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choices: "
                         f"{', '.join(REASONING_PARSERS)}") from None


class ReasoningSplitter:
    """Incremental split. States: before (may still open a block), inside, after."""

    def __init__(self, in_reasoning: bool) -> None:
        self._state = "inside" if in_reasoning else "before"
        self._buf = ""

    def feed(self, chunk: str, final: bool = False) -> tuple[str, str]:
        self._buf += chunk
        reasoning = content = ""
        while self._buf:
            if self._state == "before":
                stripped = self._buf.lstrip()
                if stripped.startswith(START):
                    self._state, self._buf = "inside", stripped[len(START):]
                    continue
                if not final and START.startswith(stripped):
                    break  # whitespace or a prefix of <think>: wait
                self._state = "after"
            elif self._state == "inside":
                if self._buf.startswith(START):  # a template-opened block restated
                    self._buf = self._buf[len(START):]
                end = self._buf.find(END)
                if end >= 0:
                    reasoning += self._buf[:end]
                    self._buf, self._state = self._buf[end + len(END):], "after"
                    continue
                keep = 0 if final else partial_marker_len(self._buf, (END, START))
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            else:
                content += self._buf
                self._buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """Non-streaming: (reasoning or None when there was no block, content)."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    opened = in_reasoning or text.lstrip().startswith(START)
    return (reasoning.strip() if opened else None), (c1 + c2)
