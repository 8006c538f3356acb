"""Structured outputs: grammar backends that turn a regex, JSON schema or EBNF grammar into a
packed token mask per decode step (host side; the device only applies the mask).

    create_backend(name, tokenizer, vocab_size)    -- one per server, `--grammar-backend`
    GrammarManager(backend).request(kind, text)    -- Future[CompiledGrammar], cached
    compiled.new_matcher()                         -- per request: fill_bitmask / accept_token /
                                                      is_terminated / forced_tokens / rollback

Backends: "llguidance" (default; regex, JSON schema, GBNF/Lark), "outlines" (outlines-core;
regex and JSON schema, drops integer minimum/maximum), "xgrammar" (optional extra; needs torch).
See base.py for the mask layout and the matcher contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_tpu.constrained.base import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    allowed_token_ids,
    canonical_forced_tokens,
    mask_num_words,
)
from sgl_tpu.constrained.grammar_manager import GrammarManager
from sgl_tpu.constrained.llguidance_backend import LLGuidanceBackend
from sgl_tpu.constrained.outlines_backend import OutlinesBackend
from sgl_tpu.constrained.xgrammar_backend import XGrammarBackend

if TYPE_CHECKING:
    from sgl_tpu.loader import Tokenizer

GRAMMAR_BACKENDS: dict[str, type[GrammarBackend]] = {
    "llguidance": LLGuidanceBackend,
    "outlines": OutlinesBackend,
    "xgrammar": XGrammarBackend,
}
DEFAULT_BACKEND = "llguidance"


def create_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend:
    """Build the backend `name` for `tokenizer`; `vocab_size` is the model's (mask width)."""
    try:
        backend_cls = GRAMMAR_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown grammar backend {name!r}; choices: {', '.join(GRAMMAR_BACKENDS)}"
        ) from None
    return backend_cls(tokenizer, vocab_size)


__all__ = [
    "GRAMMAR_BACKENDS",
    "DEFAULT_BACKEND",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarManager",
    "GrammarMatcher",
    "LLGuidanceBackend",
    "OutlinesBackend",
    "XGrammarBackend",
    "allowed_token_ids",
    "canonical_forced_tokens",
    "create_backend",
    "mask_num_words",
]
