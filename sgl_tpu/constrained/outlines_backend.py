"""Grammar backend on outlines-core: regex and JSON schema (no EBNF).

outlines-core compiles a regex into a token-level automaton (`Index`) over a `Vocabulary`
built here from each token's raw bytes (decoded strings would lose partial UTF-8 bytes);
special tokens are left out, so they are never allowed. A JSON schema is first turned into a
regex (compact layout, `{"name":"x","age":3}`) by outlines' own converter.

Known limitations, kept on purpose (tests document them):
- integer `minimum`/`maximum` (and other keywords the converter does not know) are silently
  dropped: `{"type":"integer","maximum":120}` admits 999;
- compiling is slow for large schemas (0.3 s to seconds; GrammarManager caches and runs it on
  a worker thread, and outlines-core releases the GIL while it works);
- in a final state outlines has no transition on EOS, so accepting EOS is tracked here.

Jump-forward: every byte that occurs in a token is also a single-byte token (checked at start),
so the bytes allowed next are exactly the allowed single-byte tokens; while there is exactly
one and the state is not final, that byte is forced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import outlines_core

from sgl_tpu.constrained.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    canonical_forced_tokens,
    parse_json_schema,
    regex_error,
    shorten,
)

if TYPE_CHECKING:
    from sgl_tpu.loader import Tokenizer

_JSON_WHITESPACE = ""  # compact JSON, like the other backends
_MAX_ROLLBACK_TOKENS = 256
_MAX_FORCED_BYTES = 256


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    supported_kinds = ("regex", "json_schema")

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(tokenizer.vocab_size):
            piece = tokenizer.id_to_token_bytes(token_id)
            if piece and token_id not in tokenizer.special_token_ids:
                by_bytes.setdefault(piece, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_ids[0], by_bytes)
        # byte -> its single-byte token id, when jump-forward can be computed exactly.
        single = {piece[0]: ids[0] for piece, ids in by_bytes.items() if len(piece) == 1}
        used = set().union(*(set(piece) for piece in by_bytes))
        self.byte_tokens: tuple[tuple[int, int], ...] = (
            tuple(sorted(single.items())) if used <= single.keys() else ()
        )

    def _compile(self, kind: str, text: str) -> OutlinesGrammar:
        if kind == "json_schema":
            parse_json_schema(text)
            try:
                regex = outlines_core.json_schema.build_regex_from_schema(text, _JSON_WHITESPACE)
            except ValueError as e:
                raise GrammarError(
                    f"unsupported grammar feature: JSON schema: {shorten(str(e))}"
                ) from None
        else:
            regex = text
        try:
            index = outlines_core.Index(regex, self._vocabulary)
        except ValueError as e:
            if kind == "regex":
                detail = f"{e} (no look-around or backreferences)"
                raise regex_error(self.name, text, detail) from None
            raise GrammarError(
                f"unsupported grammar feature: JSON schema: {shorten(str(e))}"
            ) from None
        return OutlinesGrammar(self, index)


class OutlinesGrammar(CompiledGrammar):
    """The index plus per-state facts computed lazily and shared by all matchers."""

    def __init__(self, backend: OutlinesBackend, index: outlines_core.Index) -> None:
        self.backend = backend
        self.index = index
        self._only_eos: dict[int, bool] = {}
        self._forced: dict[int, bytes] = {}

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self, outlines_core.Guide(self.index, _MAX_ROLLBACK_TOKENS))

    def only_eos(self, state: int) -> bool:
        """Final state with no way to continue."""
        result = self._only_eos.get(state)
        if result is None:
            result = self.index.is_final_state(state) and all(
                t in self.backend.eos_token_ids for t in self.index.get_allowed_tokens(state)
            )
            self._only_eos[state] = result
        return result

    def forced_bytes(self, state: int) -> bytes:
        result = self._forced.get(state)
        if result is None:
            result = self._walk_forced_bytes(state)
            self._forced[state] = result
        return result

    def _walk_forced_bytes(self, state: int) -> bytes:
        out = bytearray()
        byte_tokens = self.backend.byte_tokens
        while byte_tokens and len(out) < _MAX_FORCED_BYTES and not self.index.is_final_state(state):
            choices = []
            for byte, token_id in byte_tokens:
                next_state = self.index.get_next_state(state, token_id)
                if next_state is not None:
                    choices.append((byte, next_state))
                    if len(choices) > 1:
                        break
            if len(choices) != 1:
                break
            out.append(choices[0][0])
            state = choices[0][1]
        return bytes(out)


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, grammar: OutlinesGrammar, guide: outlines_core.Guide) -> None:
        self._grammar = grammar
        self._guide = guide
        self._eos_accepted = False

    def fill_bitmask(self, row: np.ndarray) -> None:
        backend = self._grammar.backend
        backend.check_row(row)
        if self.is_terminated():
            np.copyto(row, backend.eos_only_row)
            return
        self._guide.write_mask_into(row.ctypes.data, row.size, 4)
        if self._guide.is_finished():  # outlines marks only the first EOS id
            row |= backend.eos_only_row
        backend.clear_padding(row)

    def accept_token(self, token_id: int) -> bool:
        backend = self._grammar.backend
        if self._eos_accepted or not 0 <= token_id < backend.tokenizer_vocab_size:
            return False
        if token_id in backend.eos_token_ids:
            self._eos_accepted = self._guide.is_finished()
            return self._eos_accepted
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # not allowed; the guide keeps its state
            return False
        return True

    def is_terminated(self) -> bool:
        return self._eos_accepted or self._grammar.only_eos(self._guide.get_state())

    def forced_tokens(self) -> list[int]:
        if self._eos_accepted or self._guide.is_finished():
            return []
        forced = self._grammar.forced_bytes(self._guide.get_state())
        return canonical_forced_tokens(self._grammar.backend.tokenizer, forced) if forced else []

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._eos_accepted:
            self._eos_accepted = False
            num_tokens -= 1
        if num_tokens > 0:
            self._guide.rollback_state(num_tokens)

