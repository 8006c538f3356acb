"""SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model == "llama"`) as a
`tokenizers.Tokenizer`, built the way transformers builds Gemma's from the same file.

    tokens + token types (+ bos / add_bos_token)
      --respell space runs--> pieces  ("  " -> "\u2581\u2581": the text normalizer writes spaces
                                       as \u2581, so a piece of real spaces would never match)
      --merges from the vocabulary--> BPE(byte_fallback, fuse_unk)
      normalizer " " -> "\u2581", no prefix space; decoder \u2581 -> " ", <0xNN> bytes fused

The file lists no merges. A piece that can be cut into two pieces of the vocabulary is reachable
by merging them; Gemma's merge priority is the order of the merged pieces in the file (earlier
first: their scores do not follow the merge order), and among the cuts of one piece the longer
left part first. CONTROL tokens become special added tokens (matched whole, dropped from
decoded text), USER_DEFINED ones plain added tokens (matched whole, kept in text), except the
respelled space runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

_SPACE = "\u2581"
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def respell(tokens: Sequence[str]) -> list[str]:
    """Pieces made only of spaces are stored with real spaces; spell them with \u2581."""
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def merges_from_vocab(pieces: Sequence[str]) -> list[tuple[str, str]]:
    """Every (left, right) cut of a piece into two pieces, highest priority first.

    Priority: the merged piece's position in the vocabulary (earlier first), then the longer
    left part, then the longer right part.
    """
    vocab = {p: i for i, p in enumerate(pieces)}
    ranked = []  # (position of the merged piece, -len(left), -len(right), left, right)
    for piece, pos in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((pos, -len(left), -len(right), left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(r[3], r[4]) for r in ranked]


def build_spm_backend(
    *,
    tokens: Sequence[str],
    token_types: Sequence[int],
    bos_token_id: int | None,
    add_bos: bool,
) -> Backend:
    """A BPE `tokenizers.Tokenizer` equivalent to the GGUF's SentencePiece vocabulary."""
    pieces = respell(tokens)
    unk = next((pieces[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_UNKNOWN),
               "<unk>")
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, merges_from_vocab(pieces),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Backend(bpe)
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    special = {i for i, t in enumerate(token_types)
               if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN)}
    # Respelled space runs stay ordinary pieces, reached by merges (as transformers keeps them).
    added = [AddedToken(pieces[i], special=i in special, normalized=False)
             for i, t in enumerate(token_types)
             if i in special or (t == _TOKEN_TYPE_USER_DEFINED and pieces[i] == tokens[i])]
    backend.add_tokens(added)  # keeps ids: each content is already in the vocabulary
    if add_bos and bos_token_id is not None:
        bos = pieces[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_token_id)])
    return backend
