"""Grammar backend on xgrammar (optional extra `sgl-tpu[xgrammar]`; it imports torch).

xgrammar is imported when the backend is created, not with this module, so the server starts
without it. Its vocabulary is built from raw token bytes with two workarounds for issues seen
with byte-level BPE tokenizers:
- special tokens are blanked (an empty entry is never allowed); given their literal text,
  xgrammar allowed e.g. `<|im_end|>` inside JSON strings;
- for JSON schemas a second vocabulary also blanks every token containing a control byte
  (< 0x20): strings with `maxLength` admitted raw control characters, which is invalid JSON.
  That is safe because JSON here is compact (`{"name":"x","age":3}`): no whitespace at all.

Forced text comes from `find_jump_forward_string`, tokenized canonically here; xgrammar's own
`find_jump_forward_tokens` is a greedy longest match that may differ from the tokenizer's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

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

# "[05:12:52] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> "Regex parsing ..."
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _detail(e: Exception) -> str:
    return _LOG_PREFIX.sub("", shorten(str(e)))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        try:
            import xgrammar
        except ImportError as e:
            raise GrammarError(
                "xgrammar is not installed (optional extra, needs torch): "
                "pip install 'sgl-tpu[xgrammar]'"
            ) from e
        self._xgr = xgrammar
        special = tokenizer.special_token_ids
        vocab = [
            b"" if i in special else tokenizer.id_to_token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        json_vocab = [b"" if any(b < 0x20 for b in piece) else piece for piece in vocab]
        self._compiler = self._make_compiler(vocab)
        self._json_compiler = self._make_compiler(json_vocab)

    def _make_compiler(self, vocab: list[bytes]) -> Any:
        xgr = self._xgr
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids),
        )
        return xgr.GrammarCompiler(info, cache_enabled=False)  # GrammarManager caches

    def _compile(self, kind: str, text: str) -> XGrammarGrammar:
        if kind == "regex":
            try:
                compiled = self._compiler.compile_regex(text)
            except RuntimeError as e:
                raise regex_error(self.name, text, _detail(e)) from None
        elif kind == "json_schema":
            parse_json_schema(text)
            try:
                compiled = self._json_compiler.compile_json_schema(
                    text, any_whitespace=False, separators=(",", ":")
                )
            except RuntimeError as e:
                raise GrammarError(
                    f"unsupported grammar feature: JSON schema: {_detail(e)}"
                ) from None
        else:
            try:
                compiled = self._compiler.compile_grammar(self._xgr.Grammar.from_ebnf(text))
            except RuntimeError as e:
                raise GrammarError(f"invalid EBNF grammar: {_detail(e)}") from None
        return XGrammarGrammar(self, compiled)


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, backend: XGrammarBackend, compiled: Any) -> None:
        self._backend = backend
        self._compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        matcher = self._backend._xgr.GrammarMatcher(
            self._compiled, override_stop_tokens=list(self._backend.eos_token_ids)
        )
        return XGrammarMatcher(self._backend, matcher)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, backend: XGrammarBackend, matcher: Any) -> None:
        self._backend = backend
        self._matcher = matcher
        self._scratch = np.zeros((1, backend.num_mask_words), dtype=np.int32)
        self._only_eos: bool | None = None  # cached until the state changes

    def fill_bitmask(self, row: np.ndarray) -> None:
        backend = self._backend
        backend.check_row(row)
        if self._matcher.is_terminated():
            np.copyto(row, backend.eos_only_row)
            return
        self._matcher.fill_next_token_bitmask(row.reshape(1, -1))
        backend.clear_padding(row)

    def accept_token(self, token_id: int) -> bool:
        m = self._matcher
        if m.is_terminated() or not 0 <= token_id < self._backend.tokenizer_vocab_size:
            return False
        accepted = m.accept_token(token_id)
        if accepted:
            self._only_eos = None
        return accepted

    def is_terminated(self) -> bool:
        m = self._matcher
        if m.is_terminated():
            return True
        if not m.is_completed():
            return False
        if self._only_eos is None:
            self._scratch[:] = 0
            m.fill_next_token_bitmask(self._scratch)
            self._backend.clear_padding(self._scratch[0])
            self._only_eos = bool(np.array_equal(self._scratch[0], self._backend.eos_only_row))
        return self._only_eos

    def forced_tokens(self) -> list[int]:
        m = self._matcher
        if m.is_terminated() or m.is_completed():
            return []
        forced = m.find_jump_forward_string().encode()
        return canonical_forced_tokens(self._backend.tokenizer, forced) if forced else []

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self._only_eos = None
