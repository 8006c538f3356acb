"""N-gram drafting for speculative decoding: guess a request's next tokens from its own context.

Agents copy: tool outputs into answers, JSON keys and values between turns, code and
identifiers, the format of earlier steps. When the last few tokens of a request also occur
earlier in its prompt or output, the tokens that followed them there are a cheap guess of
what follows now (SGLang's `--speculative-algorithm NGRAM`, "prompt lookup decoding").

    tokens   [ . . a b c x y z . . . . . a b c ]      last n tokens: (a b c), n = max..min
                     └─┬─┘ └─┬─┘             └─┬─┘
                   earlier  continuation    suffix
    draft    [ x y z ... ]                            up to num_tokens of them

`NgramIndex` keeps, for every n-gram size in [min_n, max_n], the position that followed the
n-gram's latest occurrence (a dict from token tuples to positions), updated as tokens are
appended: a lookup costs max_n - min_n + 1 dict probes, not a scan of the context. The longest
matching n-gram wins. A continuation that runs into the suffix itself (a repeating pattern of
period p = len - position) is extended periodically, so "a b a b a b" drafts "a b a b ...".

Cost: (max_n - min_n + 1) dict entries per context token, built at a request's first draft
(about 10k entries for a 1,300-token agent prompt with the default windows 1..8).

Drafts are only guesses: the scheduler verifies them against the model (speculative.py), so
a stale or wrong index can lower the acceptance rate but never change an output.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Latest-occurrence index of one request's tokens (prompt + output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position that followed it

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with `tokens`, which normally extend what was indexed; rebuild when they
        do not (the request's output was cut back: a rejected grammar draft)."""
        have = len(self.tokens)
        if have > len(tokens) or (have and tokens[have - 1] != self.tokens[-1]):
            self.tokens, self._next = [], {}
            have = 0
        for t in tokens[have:]:
            self._push(int(t))

    def _push(self, token: int) -> None:
        toks, p = self.tokens, len(self.tokens)
        for n in range(self.min_n, min(self.max_n, p) + 1):
            self._next[tuple(toks[p - n : p])] = p
        toks.append(token)

    def propose(self, num_tokens: int) -> tuple[list[int], int]:
        """(draft of at most `num_tokens` tokens, length of the matched n-gram); ([], 0) when
        no suffix of the tokens occurred before."""
        toks, length = self.tokens, len(self.tokens)
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            pos = self._next.get(tuple(toks[length - n :]))
            if pos is not None:
                period = length - pos
                return [toks[pos + i % period] for i in range(num_tokens)], n
        return [], 0
