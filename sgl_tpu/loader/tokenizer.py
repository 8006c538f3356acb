"""Text <-> token ids and chat-template rendering, for GGUF files and Hugging Face directories.

Both sources end up as one `tokenizers.Tokenizer` (the Rust backend) plus a little metadata:

    GGUF tokenizer.ggml.* (tokens, merges, types, pre) --build_gguf_backend--+
                                                                             +--> Tokenizer
    HF dir (tokenizer.json, tokenizer_config.json, chat_template.jinja) -----+

BOS policy: `encode(text)` adds exactly the special tokens the backend's post-processor adds, as
HF's `tokenizer(text)` does. For a GGUF the post-processor prepends BOS only when
`tokenizer.ggml.add_bos_token` is true; the default SmolLM2 GGUF says false (and so do
transformers' GGUF loader and SmolLM2's own HF tokenizer), so nothing is prepended for it. Text
rendered by `apply_chat_template` already carries the template's own markers (`<|im_start|>`,
or `{{ bos_token }}` for Llama-3), so callers encode it with `add_special_tokens=False` to
avoid a doubled BOS on models whose post-processor adds one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# llama.cpp token types (gguf.TokenType); CONTROL tokens are special, USER_DEFINED are added
# tokens that stay visible in decoded text (e.g. Qwen's <tool_call>).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Strings that close an assistant turn in common templates, most specific first.
_TURN_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder"/"refact": `\p{N}` split off one at a time, then GPT-2's.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        _gpt2_pre(),
    ])


def _regex_then_bytes_pre(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> pre-tokenizer equivalent to llama.cpp's regex list for it.
_GGUF_PRE_TOKENIZERS = {
    "default": _gpt2_pre,
    "gpt-2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "llama-bpe": lambda: _regex_then_bytes_pre(_LLAMA3_REGEX),
    "qwen2": lambda: _regex_then_bytes_pre(_QWEN2_REGEX),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def build_gguf_backend(
    *,
    tokenizer_model: str,
    pre: str,
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    bos_token_id: int | None,
    add_bos: bool,
) -> Backend:
    """Rebuild a byte-level BPE `tokenizers.Tokenizer` from GGUF `tokenizer.ggml.*` metadata."""
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {tokenizer_model!r}; "
            "supported: 'gpt2' (byte-level BPE)"
        )
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(_GGUF_PRE_TOKENIZERS)}"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab, merge_pairs, ignore_merges=(pre == "llama-bpe"))
    backend = Backend(bpe)
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
    backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(token_types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_tokens(added)  # keeps ids: each content is already in the vocabulary
    if add_bos and bos_token_id is not None:
        bos = tokens[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)],
        )
    return backend


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile like transformers does, so Hub templates behave the same way."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """Copy a message, joining OpenAI-style text parts into one string (newline-separated)."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}; only 'text' parts")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids, strings and chat template the server needs."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("tokenizer: at least one eos token id is required")
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self._template = _compile_chat_template(chat_template) if chat_template else None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_token_ids = frozenset(added)

    # ---- serialisation (the GGUF cache stores this instead of re-reading the file) ----
    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self._backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
        return cls(
            Backend.from_str(d["backend"]),
            bos_token_id=d["bos_token_id"],
            eos_token_ids=d["eos_token_ids"],
            chat_template=d["chat_template"],
        )

    # ---- ids and strings ----
    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the embedding may have more rows).

        Cached: the backend builds its whole vocabulary to count it (about 0.1 s for Gemma's
        262k pieces), and callers ask per token id."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def eos_token(self) -> str:
        return self._backend.id_to_token(self.eos_token_ids[0])

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @cached_property
    def chat_end_token(self) -> str | None:
        """The string that ends an assistant turn in the chat template (None without one)."""
        if self.chat_template is None:
            return None
        for marker in _TURN_END_MARKERS:
            if marker in self.chat_template and self._backend.token_to_id(marker) is not None:
                return marker
        return self.eos_token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) are matched.

        `add_special_tokens` lets the backend's post-processor add BOS where the model asks for it;
        pass False for text rendered by `apply_chat_template`.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Raw bytes of every id, computed once (about 0.1 s for a 50k vocabulary)."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        out = []
        for i in range(self.vocab_size):
            tok = self._backend.id_to_token(i)
            if tok is None:
                out.append(b"")
            elif i in self._added_token_ids:
                out.append(tok.encode("utf-8"))
            elif byte_level:
                out.append(bytes(_UNICODE_TO_BYTE[c] for c in tok))
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                out.append(bytes([int(tok[3:5], 16)]))  # sentencepiece byte fallback
            else:
                out.append(tok.replace("\u2581", " ").encode("utf-8"))
        return out

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """The bytes a token contributes to the text (special tokens: their literal text)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._token_bytes[token_id]

    # ---- chat ----
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render messages with the model's Jinja template, as transformers would (no tokenizing).

        Extra keyword arguments (e.g. Qwen3's `enable_thinking`) are passed to the template.
        Errors raised by the template (`raise_exception`) become ValueError.
        """
        if self._template is None:
            raise ValueError("model has no chat template (a base model): start the server "
                             "with --chat-template NAME_OR_FILE to serve chat requests")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token,
            **template_kwargs,
            "messages": [_flatten_content(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_hf_chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # transformers >= 4.50 writes it separately
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": ...}]
        by_name = {t.get("name"): t.get("template") for t in template}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template


def load_hf_tokenizer(
    model_dir: str | Path,
    *,
    bos_token_id: int | None = None,
    eos_token_ids: Sequence[int] = (),
) -> Tokenizer:
    """Tokenizer of an HF directory: `tokenizer.json` + `tokenizer_config.json` (+ template file).

    `bos_token_id` / `eos_token_ids` come from config.json / generation_config.json and fill in
    what tokenizer_config.json leaves out; eos ids of both sources are kept (tokenizer's first).
    """
    model_dir = Path(model_dir)
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
    backend = Backend.from_file(str(tok_file))
    config_file = model_dir / "tokenizer_config.json"
    tok_config = (
        json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    )

    def lookup(key: str) -> int | None:
        content = _token_content(tok_config.get(key))
        return None if content is None else backend.token_to_id(content)

    bos = lookup("bos_token")
    eos = lookup("eos_token")
    eos_ids = ([eos] if eos is not None else []) + list(eos_token_ids)
    if not eos_ids:
        raise ValueError(f"{model_dir}: no eos token in tokenizer_config.json or config.json")
    return Tokenizer(
        backend,
        bos_token_id=bos if bos is not None else bos_token_id,
        eos_token_ids=eos_ids,
        chat_template=_read_hf_chat_template(model_dir, tok_config),
    )
