"""The default grammar backend: llguidance (regex, JSON schema, GBNF/Lark grammars).

The tokenizer is handed to llguidance as its `tokenizers` JSON, so llguidance sees exactly the
model's vocabulary (special tokens included, which it never allows). Compiling builds one
template `LLMatcher` (about a millisecond); each request gets a `deep_copy` of it (microseconds).
Mask computation runs in Rust without the GIL.

JSON is generated in one canonical layout, compact (`{"name":"x","age":3}`), so the text is
fixed between values and jump-forward can skip it; flexible whitespace would also let a weak
model emit whitespace forever.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import llguidance
import numpy as np

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

logger = logging.getLogger(__name__)

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self._lltokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )

    def _compile(self, kind: str, text: str) -> LLGuidanceGrammar:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "json_schema":
            parse_json_schema(text)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        else:
            try:
                grammar = llguidance.grammar_from("ebnf", text)
            except ValueError as e:
                raise GrammarError(f"invalid EBNF grammar: {shorten(str(e))}") from None
        template = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if template.is_error():
            detail = template.get_error()
            if kind == "regex":
                raise regex_error(self.name, text, detail)
            if kind == "json_schema":
                raise GrammarError(f"unsupported grammar feature: JSON schema: {shorten(detail)}")
            raise GrammarError(f"invalid EBNF grammar: {shorten(detail)}")
        return LLGuidanceGrammar(self, template)


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, backend: LLGuidanceBackend, template: llguidance.LLMatcher) -> None:
        self._backend = backend
        self._template = template

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._backend, self._template.deep_copy())


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, backend: LLGuidanceBackend, matcher: llguidance.LLMatcher) -> None:
        self._backend = backend
        self._matcher = matcher
        self._eos_accepted = False

    def fill_bitmask(self, row: np.ndarray) -> None:
        backend = self._backend
        backend.check_row(row)
        if self._eos_accepted:
            np.copyto(row, backend.eos_only_row)
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._matcher.is_error():
            # Parser limits hit (e.g. a pathological grammar): end the request cleanly.
            logger.warning("llguidance matcher error: %s", shorten(self._matcher.get_error()))
            np.copyto(row, backend.eos_only_row)
            return
        backend.clear_padding(row)

    def accept_token(self, token_id: int) -> bool:
        m = self._matcher
        if self._eos_accepted or not 0 <= token_id < self._backend.tokenizer_vocab_size:
            return False
        if token_id in self._backend.eos_token_ids:
            if m.is_error() or not m.is_accepting():
                return False
            self._eos_accepted = m.consume_token(token_id)
            return self._eos_accepted
        # consume_token on a disallowed token would put the matcher in an error state for good.
        if m.validate_tokens([token_id]) != 1:
            return False
        return m.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._eos_accepted or self._matcher.is_stopped()

    def forced_tokens(self) -> list[int]:
        m = self._matcher
        if self._eos_accepted or m.is_stopped() or m.is_accepting():
            return []
        tokens = canonical_forced_tokens(self._backend.tokenizer, m.compute_ff_bytes())
        return tokens[: m.validate_tokens(tokens)] if tokens else []

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens")
        self._eos_accepted = False
