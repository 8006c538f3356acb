"""The interface every grammar backend implements, and the helpers they share.

One backend object per tokenizer compiles grammars; one matcher per request tracks its state:

    GrammarBackend(tokenizer, vocab_size)          built once; owns the backend's vocabulary
      .compile(kind, text) -> CompiledGrammar      slow (ms .. s): GrammarManager runs it off-thread
        .new_matcher() -> GrammarMatcher           cheap copy, one per request
          .fill_bitmask(row)                       mask for the next token   (every decode step)
          .accept_token(token_id)                  advance by the sampled token
          .is_terminated()                         done: only EOS may follow
          .forced_tokens()                         jump-forward: tokens the grammar forces
          .rollback(num_tokens)                    undo accepted tokens (draft verification)

Mask layout, shared by all backends and by the jitted function that applies it on device:

    mask: int32[batch, ceil(vocab_size / 32)]      vocab_size = the model's (embedding rows)
    token t is allowed  <=>  (mask[b, t // 32] >> (t % 32)) & 1     (little-endian within a word)

Ids the tokenizer does not have (vocab_size may exceed the tokenizer's) are never allowed;
special tokens other than EOS are never allowed. EOS is allowed exactly when the text so far is
a complete match. Matchers are not thread-safe: one thread at a time per matcher (a compiled
grammar may be shared across threads).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import jsonschema
import numpy as np

from sgl_tpu.constrained.errors import GrammarError, shorten
from sgl_tpu.constrained.schema_check import check_schema_is_finite

if TYPE_CHECKING:
    from sgl_tpu.loader import Tokenizer

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")

# "'" plus up to two characters may still become one pre-token ("'re", "'ll"); see
# canonical_forced_tokens.
_CONTRACTION_LOOKAHEAD_CHARS = 2


def mask_num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_token_ids(row: np.ndarray) -> np.ndarray:
    """Ids whose bit is set in one packed mask row (for tests and debugging, not the hot path)."""
    words = np.ascontiguousarray(row, dtype=np.int32)
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


class GrammarMatcher(ABC):
    """Per-request grammar state. Not thread-safe.

    EOS: allowed in the mask exactly when the text so far is complete. When nothing more may
    follow, `is_terminated()` is true and EOS is the only allowed token. Accepting EOS also
    terminates the matcher; after that every `accept_token` returns False.
    """

    @abstractmethod
    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed-token mask, int32[ceil(vocab_size / 32)], into `row` in place."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and no state change) if the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing more may follow (or EOS was accepted)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here, tokenized canonically; possibly empty.

        The caller appends them with `accept_token`. They are a prefix of the tokenizer's own
        encoding of the forced text that stays the same whatever text follows it.
        """

    def error(self) -> str | None:
        """Why the matcher cannot go on (a parser limit hit by a too complex grammar), or None.
        A matcher in error refuses every token; the scheduler ends the request with this."""
        return None

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (EOS counts as one)."""


class CompiledGrammar(ABC):
    """An immutable compiled grammar; safe to share across threads and requests."""

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start state."""


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer. `compile` may run on several threads at once."""

    name: str = ""
    supported_kinds: tuple[str, ...] = GRAMMAR_KINDS

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer.vocab_size
        self.num_mask_words = mask_num_words(vocab_size)
        self.eos_token_ids: frozenset[int] = frozenset(tokenizer.eos_token_ids)
        tokenizer.id_to_token_bytes(0)  # builds the byte table now (~0.2 s), not mid-request
        self.eos_only_row = np.zeros(self.num_mask_words, dtype=np.int32)
        for t in self.eos_token_ids:
            self.eos_only_row.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def compile(self, kind: str, text: str) -> CompiledGrammar:
        """Compile `text` of `kind` ("regex", "json_schema" or "ebnf"); raises GrammarError."""
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(
                f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}"
            )
        if kind not in self.supported_kinds:
            raise GrammarError(
                f"unsupported grammar feature: the {self.name} backend does not support {kind!r} "
                f"grammars (supported: {', '.join(self.supported_kinds)})"
            )
        return self._compile(kind, text)

    @abstractmethod
    def _compile(self, kind: str, text: str) -> CompiledGrammar: ...

    # Helpers for matchers.

    def check_row(self, row: np.ndarray) -> None:
        shape_ok = row.shape == (self.num_mask_words,)
        if row.dtype != np.int32 or not shape_ok or not row.flags.c_contiguous:
            raise ValueError(
                f"mask row must be a contiguous int32[{self.num_mask_words}], "
                f"got {row.dtype}{list(row.shape)}"
            )

    def clear_padding(self, row: np.ndarray) -> None:
        """Disallow ids at and above the tokenizer's vocabulary size (padded embedding rows)."""
        word, bit = divmod(self.tokenizer_vocab_size, 32)
        if word >= self.num_mask_words:
            return
        if bit:
            row.view(np.uint32)[word] &= np.uint32((1 << bit) - 1)
            word += 1
        row[word:] = 0


def canonical_forced_tokens(tokenizer: Tokenizer, forced: bytes) -> list[int]:
    """The tokens for forced bytes that the tokenizer produces whatever text follows them.

    The tokenizer splits text into pre-tokens (GPT-2-style regex pieces, e.g. `{"`, `name`,
    `":"`) and runs BPE inside each piece, so a piece's tokens depend only on the piece. The last
    piece may still grow (`":"` + `-` is one piece), so its tokens are dropped. The regex also
    looks past a piece's end: a contraction (`'` + `re`) or a whitespace run (`\\s*[\\r\\n]+`)
    at the very end can re-split what precedes it, so pieces reaching into trailing whitespace
    or past an apostrophe in the last two characters are dropped too. If the tokens do not
    spell the text byte for byte (normalizers, an added prefix space, special-token text),
    nothing is forced.
    """
    text = _valid_utf8_prefix(forced)
    pre_tokenizer = tokenizer.backend.pre_tokenizer
    if not text or pre_tokenizer is None:
        return []
    limit = len(text.rstrip())
    apostrophe = text.rfind("'", max(0, len(text) - _CONTRACTION_LOOKAHEAD_CHARS))
    if apostrophe >= 0:
        limit = min(limit, apostrophe)
    stable_chars = 0
    for _, (_, end) in pre_tokenizer.pre_tokenize_str(text)[:-1]:
        if end > limit:
            break
        stable_chars = end
    stable_bytes = len(text[:stable_chars].encode())
    tokens: list[int] = []
    num_bytes = 0
    for t in tokenizer.encode(text, add_special_tokens=False):
        piece = tokenizer.id_to_token_bytes(t)
        if t in tokenizer.special_token_ids or num_bytes + len(piece) > stable_bytes:
            break
        if forced[num_bytes:num_bytes + len(piece)] != piece:
            return []
        tokens.append(t)
        num_bytes += len(piece)
    return tokens


def _valid_utf8_prefix(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")


def parse_json_schema(text: str) -> Any:
    """Parse and check a JSON schema against its meta-schema; GrammarError names the problem."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid JSON schema: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(
            f"invalid JSON schema: expected an object, got {type(schema).__name__}"
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        suffix = f" (at {where})" if where else ""
        raise GrammarError(f"invalid JSON schema: {shorten(e.message)}{suffix}") from None
    except RecursionError:
        raise GrammarError("invalid JSON schema: nested too deeply") from None
    check_schema_is_finite(schema)
    return schema


def regex_error(backend_name: str, regex: str, detail: str) -> GrammarError:
    """Python's `re` decides: a regex it rejects is invalid, one it accepts is unsupported here."""
    try:
        re.compile(regex)
    except re.error as e:
        return GrammarError(f"invalid regex {shorten(regex)!r}: {e}")
    except (OverflowError, RecursionError):
        pass
    return GrammarError(
        f"unsupported grammar feature: the {backend_name} backend cannot compile regex "
        f"{shorten(regex)!r}: {shorten(detail)}"
    )
