"""The benchmarks' interleaved timer: every function runs once per round, and the order rotates,
so each function takes every place equally often and runs after each of the others."""

from __future__ import annotations

from collections import Counter

from sgl_tpu.bench.timing import interleaved


def test_interleaved_rotates_the_order_every_round():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "ABC"}
    times = interleaved(fns, repeats=6)
    assert {name: len(t) for name, t in times.items()} == {"A": 6, "B": 6, "C": 6}
    timed = calls[3:]  # after one untimed warm-up call of each
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert rounds[:3] == [list("ABC"), list("BCA"), list("CAB")]
    places = Counter((name, i) for r in rounds for i, name in enumerate(r))
    assert set(places.values()) == {2}  # 6 rounds: each function twice in each place
    follows = Counter(zip(timed, timed[1:], strict=False))
    assert all(follows[(a, b)] > 0 for a in "ABC" for b in "ABC" if a != b)
