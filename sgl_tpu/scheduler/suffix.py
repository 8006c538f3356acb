"""Suffix decoding's shared index: what followed a pattern in the outputs of recent requests.

Agents repeat themselves across turns and across agents: the same tool-call JSON, field names,
observation formats, closing phrases. `SuffixTree` counts every run of up to `max_depth`
tokens in the outputs of the last `max_cached_requests` requests (running ones included, as
they generate) in a trie: a node is one run of tokens, its count how often the run occurred.
A draft starts at the node of the longest suffix of the request's context that occurred before
and has a continuation, then follows the most frequent child while the path's probability
(the product of count(child) / count(parent)) stays at or above `min_token_prob`, for at most
`max_spec_factor` x the matched length tokens (SGLang's / Arctic Inference's suffix decoding).

    outputs   {"name": "search", "arguments": {"query": "...   (agent 1, turn 3)
              {"name": "search", "arguments": {"query": "...   (agent 5, turn 2)
    context   ... {"name": "sea                                  (agent 2, now)
    draft     rch", "arguments": {"                               (the runs that followed)

Every run of length <= max_depth of a cached output is in the trie, so a run's count is exact
and removing a request (oldest first, past `max_cached_requests` requests or
`max_cached_tokens` output tokens) subtracts exactly what it added. Appending a token costs
max_depth child steps: the request keeps the nodes of its last max_depth - 1 runs ("open").

Memory: at most max_depth nodes per cached output token, fewer where outputs repeat (which is
what makes them worth drafting from).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

# Output tokens the tree holds at most (oldest requests removed first): with max_depth 24 at
# most about 0.8M nodes, ~150 MB of Python objects for outputs that never repeat.
MAX_CACHED_TOKENS = 32_768


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counted runs of tokens of recent outputs, keyed by request."""

    def __init__(self, max_depth: int, max_cached_requests: int,
                 max_cached_tokens: int = MAX_CACHED_TOKENS) -> None:
        if max_depth < 2 or max_cached_requests < 1:
            raise ValueError(f"need max_depth >= 2 and max_cached_requests >= 1, got "
                             f"{max_depth}, {max_cached_requests}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.root = _Node()
        self._outputs: OrderedDict[Hashable, list[int]] = OrderedDict()  # oldest first
        self._open: dict[Hashable, list[_Node]] = {}  # running: nodes of its last runs
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def output(self, key: Hashable) -> list[int] | None:
        return self._outputs.get(key)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to the output of request `key` (a new key starts a request)."""
        if not tokens:
            return
        out = self._outputs.get(key)
        if out is None:
            out = self._outputs[key] = []
            self._open[key] = []
        opened = self._open.get(key, [])
        for token in tokens:
            token = int(token)
            ends = []
            for node in (self.root, *opened):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                ends.append(child)
            opened = ends[: self.max_depth - 1]
            out.append(token)
        self._open[key] = opened
        self.num_tokens += len(tokens)
        while len(self._outputs) > 1 and (len(self._outputs) > self.max_cached_requests
                                          or self.num_tokens > self.max_cached_tokens):
            self.remove(next(k for k in self._outputs if k != key))  # the oldest other

    def close(self, key: Hashable) -> None:
        """Request `key` ended: its output stays counted until it is removed."""
        self._open.pop(key, None)

    def remove(self, key: Hashable) -> None:
        """Subtract every run of `key`'s output (the runs `extend` added)."""
        out = self._outputs.pop(key, None)
        self._open.pop(key, None)
        if out is None:
            return
        self.num_tokens -= len(out)
        for start in range(len(out)):
            node = self.root
            for token in out[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # so is every run below it: drop the subtree
                    del node.children[token]
                    break
                node = child

    def match(self, context: Sequence[int], max_len: int) -> tuple[_Node | None, int]:
        """(node, length) of the longest suffix of `context`, at most `max_len` tokens, that
        occurred with a continuation; (None, 0) when none did. A running request's own last
        tokens always occurred (they are in the tree) but have no continuation yet, so the
        longest run found is not always the answer."""
        for length in range(min(max_len, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(int(token))
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def propose(self, context: Sequence[int], num_tokens: int, min_token_prob: float,
                max_spec_factor: float) -> tuple[list[int], int]:
        """(draft, matched length): the most frequent continuation of the context's longest
        matching suffix, at most num_tokens and max_spec_factor x the matched length tokens,
        cut where the path's probability falls below min_token_prob."""
        node, length = self.match(context, self.max_depth - max(1, num_tokens))
        if node is None:
            return [], 0
        limit = min(num_tokens, int(length * max_spec_factor))
        draft: list[int] = []
        prob = 1.0
        while len(draft) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            draft.append(token)
            node = child
        return draft, length
