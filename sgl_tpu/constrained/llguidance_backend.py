"""The default grammar backend: llguidance (regex, JSON schema, GBNF/Lark grammars).

The tokenizer is handed to llguidance as its `tokenizers` JSON, so llguidance sees exactly the
model's vocabulary (special tokens included, which it never allows). Compiling builds one
template `LLMatcher` (about a millisecond); each request gets a `deep_copy` of it (microseconds).
Mask computation runs in Rust without the GIL.

Budgets (llguidance's parser limits, set explicitly): compiling a grammar is bounded by
`initial_lexer_fuel` and `max_grammar_size`; each mask computation by `step_lexer_fuel` and
`step_max_items` (a few ms at most), so a pathological grammar cannot stall the batch. The
default `max_items_in_row` (2,000) is too small for objects with many optional properties (a
1,000-property schema needs ~4,000 items in the row after `{"`): the mask, which does not build
that row, allowed `{"`, and consuming it then hit the limit. It is raised to 20,000 (~5,000
optional properties), and `compile` probes every token the first mask allows, so a grammar
beyond even that is a 400 at compile time, not an error after the first token.

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
    allowed_token_ids,
    canonical_forced_tokens,
    parse_json_schema,
    regex_error,
    shorten,
)

if TYPE_CHECKING:
    from sgl_tpu.loader import Tokenizer

logger = logging.getLogger(__name__)

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_LIMITS = dict(max_items_in_row=20_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
               step_max_items=50_000, max_grammar_size=500_000, verbose_errors=False)
_MAX_PROBED_TOKENS = 64  # first-mask tokens test-consumed at compile time


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
        template = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0,
                                        limits=llguidance.LLParserLimits(**_LIMITS))
        if not template.is_error():
            self._probe(template)
        if template.is_error():
            detail = template.get_error()
            if kind == "regex":
                raise regex_error(self.name, text, detail)
            if kind == "json_schema":
                raise GrammarError(f"unsupported grammar feature: JSON schema: {shorten(detail)}")
            raise GrammarError(f"invalid EBNF grammar: {shorten(detail)}")
        return LLGuidanceGrammar(self, template)

    def _probe(self, template: llguidance.LLMatcher) -> None:
        """Compute the first mask and consume each token it allows (on copies): errors that
        would only show after the first token (a parser limit, a grammar that admits nothing,
        e.g. a `$ref` cycle) surface now, as a compile error."""
        probe = template.deep_copy()
        row = np.empty(self.num_mask_words, np.int32)
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if probe.is_error():
            raise GrammarError(f"unusable grammar: {shorten(probe.get_error())}")
        self.clear_padding(row)
        allowed = [t for t in allowed_token_ids(row).tolist() if t not in self.eos_token_ids]
        if not allowed and not probe.is_accepting():
            raise GrammarError("unusable grammar: it matches no text")
        for token in allowed[:_MAX_PROBED_TOKENS]:
            copy = template.deep_copy()
            copy.consume_token(token)
            if copy.is_error():
                raise GrammarError(f"grammar too complex for the parser's limits: "
                                   f"{shorten(copy.get_error())}")


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
            # A parser limit hit mid-generation (a pathological grammar): the request ends
            # with this error (the scheduler asks `error()`), never with a truncated 200.
            raise GrammarError(f"grammar too complex for the parser's limits: {self.error()}")
        backend.clear_padding(row)

    def error(self) -> str | None:
        m = self._matcher
        return shorten(m.get_error()) if m.is_error() else None

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
