"""Tests for the samplers of both backends (sgl_tpu.backends.jax.sampler in JAX and
sgl_tpu.backends.torch.sampler): greedy, filters, seeding, penalties, logprobs, bitmask. Every
behavioural test runs on both (the autouse `backend` fixture); the JAX-only ones (host packing,
compilation) pin it.

The JAX sampler is jitted once per shape: (4096, V) for the statistical tests (one row per draw, the
draw index is `step`), with the default and with a tiny candidate count (forces the bisection
fallback), and (8, V) with 5 top logprobs for the rest. V = 100 is not a multiple of 32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sampling_helpers as H

from sgl_tpu.backends.jax import sampler as S
from sgl_tpu.executor.step import row_uniforms

V = 100
NUM_DRAWS = 4096
UNIT_BATCH = 8
TOP_K = 5

_sample = jax.jit(S.sample, static_argnames=("num_top_logprobs", "num_candidates"))


@dataclasses.dataclass(frozen=True)
class Params:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = 0


_BACKEND = {"name": "jax"}


@pytest.fixture(autouse=True, params=["jax", "torch"])
def backend(request) -> str:
    _BACKEND["name"] = request.param
    return request.param


def jax_only(test):
    return pytest.mark.parametrize("backend", ["jax"], indirect=True)(test)


def run(
    logits: np.ndarray,
    params: list[Params],
    steps: list[int] | None = None,
    counts: np.ndarray | None = None,
    allowed: np.ndarray | None = None,
    num_top_logprobs: int = TOP_K,
    num_candidates: int = S.DEFAULT_NUM_CANDIDATES,
    logprob_rows: np.ndarray | None = None,
) -> S.SampleOutput:
    """Sample with padded_batch = logits.shape[0]; rows past len(params) are padding.
    `logprob_rows` bool[B]: the rows that ask for log-probs (None: every row)."""
    batch, vocab = logits.shape
    arrays = H.build_sampling_arrays(params, batch, steps)
    if logprob_rows is not None:
        arrays = dataclasses.replace(arrays, return_logprob=jnp.asarray(logprob_rows))
    counts = np.zeros((batch, vocab), np.int32) if counts is None else counts
    mask = H.full_bitmask(batch, vocab) if allowed is None else H.pack_bitmask(allowed)
    if _BACKEND["name"] == "torch":
        return _run_torch(logits, jax.tree.map(np.asarray, arrays), counts, mask,
                          num_top_logprobs, num_candidates)
    out = _sample(
        jnp.asarray(logits, jnp.float32),
        arrays,
        jnp.asarray(counts),
        jnp.asarray(mask),
        num_top_logprobs=num_top_logprobs,
        num_candidates=num_candidates,
    )
    return jax.tree.map(np.asarray, out)


def _run_torch(logits, a: S.SamplingArrays, counts, mask, num_top_logprobs, num_candidates
               ) -> S.SampleOutput:
    import torch

    from sgl_tpu.backends.torch import sampler as TS

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a))

    ids, lp, top_ids, top_lp = TS.sample(
        t(np.ascontiguousarray(logits, np.float32)),
        temperature=t(a.temperature), top_p=t(a.top_p), top_k=t(a.top_k).long(),
        min_p=t(a.min_p), uniforms=t(row_uniforms(a.seed, a.step)),
        penalties=(t(counts), t(a.frequency_penalty), t(a.presence_penalty),
                   t(a.repetition_penalty)),
        bitmask=t(mask), num_top_logprobs=num_top_logprobs, num_candidates=num_candidates,
        logprob_rows=None if a.return_logprob is None else t(a.return_logprob))
    return S.SampleOutput(token_ids=ids.int().numpy(), logprobs=lp.numpy(),
                          top_ids=top_ids.int().numpy(), top_logprobs=top_lp.numpy())


def draw(
    row: np.ndarray,
    params: Params,
    allowed: np.ndarray | None = None,
    num_candidates: int = S.DEFAULT_NUM_CANDIDATES,
) -> np.ndarray:
    """NUM_DRAWS samples of one request: the same row at steps 0..NUM_DRAWS-1."""
    logits = np.broadcast_to(row, (NUM_DRAWS, V))
    if allowed is not None:
        allowed = np.broadcast_to(allowed, (NUM_DRAWS, V))
    out = run(
        logits,
        [params] * NUM_DRAWS,
        steps=list(range(NUM_DRAWS)),
        allowed=allowed,
        num_top_logprobs=0,
        num_candidates=num_candidates,
    )
    return out.token_ids


def reference_probs(row: np.ndarray, p: Params, allowed: np.ndarray | None = None) -> np.ndarray:
    """SGLang order in float64: mask -> temperature -> top-k -> top-p -> min-p."""
    x = row.astype(np.float64)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    probs = np.exp(x / p.temperature - np.max(x / p.temperature))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        probs[order[p.top_k :]] = 0.0
        probs /= probs.sum()
    sorted_probs = probs[order]
    exclusive_cum = np.cumsum(sorted_probs) - sorted_probs
    probs[order[exclusive_cum >= p.top_p]] = 0.0
    probs[probs < p.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def assert_matches(ids: np.ndarray, expected: np.ndarray) -> None:
    """Zero-probability tokens never drawn; the others within 5 sigma of their probability.

    Tokens expected fewer than 5 times are pooled into one bucket (as for a chi-square test):
    one draw of a token of probability 1e-6 is 15 sigma on its own, and such tails hold ~1e-4
    of the mass, so a fair sampler would fail per-token z-tests for some seeds.
    """
    freq = np.bincount(ids, minlength=V) / len(ids)
    never = expected == 0
    assert not freq[never].any(), f"drew excluded tokens {np.nonzero(freq * never)[0]}"
    rare = ~never & (expected * len(ids) < 5)
    freq = np.append(freq[~rare], freq[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    sigma = np.sqrt(expected * (1 - expected) / len(ids))
    z = np.abs(freq - expected) / np.maximum(sigma, 1e-12)
    assert z.max() < 5.0, f"token {z.argmax()}: freq {freq[z.argmax()]} vs {expected[z.argmax()]}"


@pytest.fixture(scope="module")
def row() -> np.ndarray:
    """Distinct logits spread over [-3, 3], shuffled so that rank != index."""
    return np.random.default_rng(0).permutation(np.linspace(3.0, -3.0, V)).astype(np.float32)


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = np.random.default_rng(1).normal(size=(UNIT_BATCH, V)).astype(np.float32)
    logits[3, [7, 40]] = 10.0  # tie: first index wins, like np.argmax
    params = [Params(seed=s) for s in range(UNIT_BATCH)]
    out = run(logits, params, steps=list(range(UNIT_BATCH)))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    reseeded = run(logits, [Params(seed=1000 + s) for s in range(UNIT_BATCH)])
    np.testing.assert_array_equal(reseeded.token_ids, out.token_ids)
    top_k_one = run(logits, [Params(temperature=1.0, top_k=1, seed=s) for s in range(8)])
    np.testing.assert_array_equal(top_k_one.token_ids, out.token_ids)


# --- distributions --------------------------------------------------------------------------


def test_temperature_one_matches_softmax(row: np.ndarray) -> None:
    p = Params(temperature=1.0, seed=7)
    assert_matches(draw(row, p), reference_probs(row, p))


def test_lower_temperature_sharpens(row: np.ndarray) -> None:
    hot, cold = Params(temperature=1.0, seed=3), Params(temperature=0.5, seed=3)
    cold_ids = draw(row, cold)
    assert_matches(cold_ids, reference_probs(row, cold))
    top = int(row.argmax())
    assert np.mean(cold_ids == top) > np.mean(draw(row, hot) == top) + 0.05


@pytest.mark.parametrize(
    "params",
    [
        Params(temperature=1.0, top_k=5, seed=11),
        Params(temperature=1.0, top_p=0.5, seed=12),
        Params(temperature=1.0, min_p=0.2, seed=13),
        Params(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=14),
    ],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_filters_match_reference(row: np.ndarray, params: Params) -> None:
    assert_matches(draw(row, params), reference_probs(row, params))


@pytest.mark.parametrize(
    "params",
    [
        Params(temperature=1.0, top_k=30, seed=21),
        Params(temperature=1.0, top_p=0.9, seed=22),
        Params(temperature=0.8, top_k=40, top_p=0.95, seed=23),
        Params(temperature=1.0, top_k=3, top_p=0.99, seed=24),
    ],
    ids=["top_k", "top_p", "both", "small_k"],
)
def test_bisection_fallback_equals_candidate_path(row: np.ndarray, params: Params) -> None:
    """With 4 candidates every row above needs the exact bisection; same thresholds, same ids."""
    fast = draw(row, params)
    np.testing.assert_array_equal(draw(row, params, num_candidates=4), fast)
    assert_matches(fast, reference_probs(row, params))


# --- candidate set and its fallback ---------------------------------------------------------
# With 8 candidates of V = 100, each row below needs the exact fallback (JAX: bisection; torch:
# radix selection and a draw over the whole vocabulary); the default (128 >= V) never does.
SMALL_CANDIDATES = 8


@pytest.mark.parametrize(
    "params",
    [
        Params(temperature=1.0, top_p=0.97, seed=31),  # nucleus wider than the candidates
        Params(temperature=1.0, top_k=60, seed=32),  # top_k larger than the candidate count
        Params(temperature=1.0, top_k=60, top_p=0.9, seed=33),
        Params(temperature=1.3, min_p=0.02, seed=34),  # min-p keeps more than 8 tokens
        Params(temperature=0.9, seed=35),  # no truncation: every token kept
    ],
    ids=["wide_nucleus", "top_k_over_candidates", "top_k_then_top_p", "min_p", "no_truncation"],
)
def test_fallback_rows_match_reference_and_candidate_path(row: np.ndarray, params: Params
                                                          ) -> None:
    wide = draw(row, params, num_candidates=SMALL_CANDIDATES)
    np.testing.assert_array_equal(wide, draw(row, params))  # the path never changes a sample
    assert_matches(wide, reference_probs(row, params))


@pytest.mark.parametrize("num_candidates", [SMALL_CANDIDATES, S.DEFAULT_NUM_CANDIDATES])
def test_flat_logits_keep_every_tied_token(num_candidates: int) -> None:
    """All logits equal: every token reaches any threshold, so top-p / top-k keep them all
    (ties are kept whole) and the draw is uniform."""
    flat = np.full(V, 0.25, np.float32)
    for params in (Params(temperature=0.7, top_p=0.9, seed=41),
                   Params(temperature=1.0, top_k=20, top_p=0.5, seed=42)):
        ids = draw(flat, params, num_candidates=num_candidates)
        assert_matches(ids, np.full(V, 1.0 / V))


def test_masked_row_with_wide_nucleus(row: np.ndarray) -> None:
    allowed = np.random.default_rng(12).random(V) < 0.6  # ~60 tokens, more than 8 candidates
    p = Params(temperature=1.2, top_p=0.95, seed=43)
    ids = draw(row, p, allowed=allowed, num_candidates=SMALL_CANDIDATES)
    np.testing.assert_array_equal(ids, draw(row, p, allowed=allowed))
    assert_matches(ids, reference_probs(row, p, allowed))


def test_seeded_row_same_whichever_path_its_batch_takes() -> None:
    """One seeded request at one step: the same token alone, among rows that fit the
    candidates, among rows that need the fallback, and with either candidate count."""
    rng = np.random.default_rng(13)
    target_row = rng.normal(size=V).astype(np.float32)
    target = Params(temperature=1.0, top_p=0.95, seed=99)
    narrow = Params(temperature=0.5, top_k=3, seed=1)  # fits any candidate set
    wide = Params(temperature=2.0, seed=2)  # never fits a small one
    expected = None
    for mates in (narrow, wide):
        for num_candidates in (SMALL_CANDIDATES, S.DEFAULT_NUM_CANDIDATES):
            logits = rng.normal(size=(UNIT_BATCH, V)).astype(np.float32)
            logits[5] = target_row
            params = [mates] * UNIT_BATCH
            params[5] = target
            steps = [int(s) for s in rng.integers(0, 50, UNIT_BATCH)]
            steps[5] = 23
            got = run(logits, params, steps=steps, num_candidates=num_candidates).token_ids[5]
            alone = np.zeros((UNIT_BATCH, V), np.float32)  # the rest is greedy padding
            alone[0] = target_row
            assert got == run(alone, [target], steps=[23],
                              num_candidates=num_candidates).token_ids[0]
            expected = got if expected is None else expected
            assert got == expected


def test_candidate_and_fallback_paths_agree_on_a_larger_vocabulary() -> None:
    """48 rows of V = 2000 (peaked, flat, tied, masked; every knob): 4 candidates against the
    whole vocabulary as candidates give the same tokens for the same uniforms."""
    rng = np.random.default_rng(14)
    vocab, batch = 2000, 48
    scale = rng.choice([0.2, 1.0, 4.0], batch)[:, None]
    logits = (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)
    logits[::7, :40] = 2.5  # a run of tied top logits
    allowed = rng.random((batch, vocab)) < 0.9
    allowed[1::2] = True
    params = [Params(temperature=float(rng.choice([0.5, 0.7, 1.0, 1.5])),
                     top_p=float(rng.choice([1.0, 0.5, 0.9, 0.99])),
                     top_k=int(rng.choice([-1, 5, 200, 900])),
                     min_p=float(rng.choice([0.0, 0.0, 0.05])), seed=int(i))
              for i in range(batch)]
    steps = list(range(batch))
    few = run(logits, params, steps=steps, allowed=allowed, num_candidates=4,
              num_top_logprobs=0)
    every = run(logits, params, steps=steps, allowed=allowed, num_candidates=vocab,
                num_top_logprobs=0)
    np.testing.assert_array_equal(few.token_ids, every.token_ids)
    assert allowed[np.arange(batch), few.token_ids].all()


def test_bitmask_restricts_sampling(row: np.ndarray) -> None:
    allowed = np.random.default_rng(2).random(V) < 0.3
    allowed[int(row.argmax())] = False  # the mask must matter for the top token too
    p = Params(temperature=1.0, top_p=0.9, seed=5)
    assert_matches(draw(row, p, allowed=allowed), reference_probs(row, p, allowed))


def test_few_banned_tokens_restrict_sampling(row: np.ndarray) -> None:
    """A mask that bans a few ids (min_new_tokens' EOS and stop ids; the torch sampler's
    in-place path) keeps the distribution of the rest."""
    allowed = np.ones(V, bool)
    allowed[np.argsort(-row)[[0, 2]]] = False  # the top token and the third
    allowed[V - 1] = False  # in the last, partial word
    p = Params(temperature=1.0, top_p=0.9, seed=6)
    assert_matches(draw(row, p, allowed=allowed), reference_probs(row, p, allowed))


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_torch_ban_path_leaves_the_logits_and_logprobs_raw(backend) -> None:
    """The torch sampler writes a few banned ids to -inf in place and puts them back: greedy and
    sampled rows avoid them, the caller's logits come back unchanged and the log-probs are
    the raw ones; a batch mixing a grammar-like mask takes the unpacked mask and agrees."""
    import torch

    from sgl_tpu.backends.torch import sampler as TS

    rng = np.random.default_rng(12)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    allowed = np.ones((4, V), bool)
    top = logits.argmax(-1)
    allowed[np.arange(4), top] = False
    allowed[:, 5] = False
    words = H.pack_bitmask(allowed)
    assert TS._banned_ids(torch.from_numpy(words), V) is not None  # the in-place path
    x = torch.from_numpy(logits.copy())

    def sample(x: torch.Tensor, mask: np.ndarray) -> tuple[torch.Tensor, ...]:
        temps = torch.tensor([0.0, 0.0, 1.0, 1.0])
        return TS.sample(x, temperature=temps, top_p=torch.ones(4),
                         top_k=torch.zeros(4, dtype=torch.long), min_p=torch.zeros(4),
                         uniforms=torch.rand(4), penalties=None, bitmask=torch.from_numpy(mask),
                         num_top_logprobs=3)

    ids, lp, top_ids, _ = sample(x, words)
    np.testing.assert_array_equal(x.numpy(), logits)
    assert allowed[np.arange(4), ids.numpy()].all()
    np.testing.assert_array_equal(ids[:2].numpy(), np.where(allowed, logits, -np.inf)[:2]
                                  .argmax(-1))
    raw_lp = torch.log_softmax(torch.from_numpy(logits), -1)
    np.testing.assert_allclose(lp.numpy(), raw_lp[torch.arange(4), ids].numpy(), rtol=1e-5)
    np.testing.assert_array_equal(top_ids[:, 0].numpy(), top)  # banned, but raw log-probs
    dense = allowed.copy()
    dense[3, 10:] = False  # many words partial: the unpacked-mask path for the batch
    dense_words = H.pack_bitmask(dense)
    assert TS._banned_ids(torch.from_numpy(dense_words), V) is None
    ids_dense = sample(torch.from_numpy(logits.copy()), dense_words)[0]
    np.testing.assert_array_equal(ids_dense[:2].numpy(), ids[:2].numpy())
    assert dense[np.arange(4), ids_dense.numpy()].all()


# --- seeding --------------------------------------------------------------------------------


def test_seeded_row_independent_of_batch() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(UNIT_BATCH, V)).astype(np.float32)
    target = Params(temperature=1.0, top_p=0.95, seed=1234)
    others = [
        Params(),
        Params(temperature=0.5, seed=1),
        Params(temperature=1.0, top_k=3, seed=2),
        Params(temperature=2.0, min_p=0.1, seed=3),
    ]
    step = 17
    alone = np.zeros((NUM_DRAWS, V), np.float32)  # another padded batch size, all padding
    alone[0] = logits[0]
    expected = int(run(alone, [target], steps=[step], num_top_logprobs=0).token_ids[0])
    for pos in (0, 3, 7):
        batch_logits = rng.normal(size=(UNIT_BATCH, V)).astype(np.float32)
        batch_logits[pos] = logits[0]
        params = [others[i % len(others)] for i in range(UNIT_BATCH)]
        params[pos] = target
        steps = [int(s) for s in rng.integers(0, 100, UNIT_BATCH)]
        steps[pos] = step
        out = run(batch_logits, params, steps=steps)
        assert out.token_ids[pos] == expected
    assert run(logits, [target], steps=[step]).token_ids[0] == expected


def test_seeds_and_steps_differ(row: np.ndarray) -> None:
    a = draw(row, Params(temperature=1.0, seed=1))
    b = draw(row, Params(temperature=1.0, seed=2))
    assert np.mean(a == b) < 0.2
    assert len(np.unique(a[:50])) > 10  # steps of one request differ too


# --- penalties ------------------------------------------------------------------------------


def penalized_choice(logit_0: float, logit_1: float, count_0: int, params: Params) -> int:
    """Greedy pick between tokens 0 and 1 (the rest far below) when token 0 was seen count_0x."""
    logits = np.full((UNIT_BATCH, V), -20.0, np.float32)
    logits[:, 0], logits[:, 1] = logit_0, logit_1
    counts = np.zeros((UNIT_BATCH, V), np.int32)
    counts[:, 0] = count_0
    counts[:, 5] = 3  # a seen token that stays irrelevant
    return int(run(logits, [params], counts=counts).token_ids[0])


@pytest.mark.parametrize(
    ("logits", "count", "params", "expected"),
    [
        ((2.0, 1.5), 2, Params(frequency_penalty=0.3), 1),  # 2.0 - 0.6 < 1.5
        ((2.0, 1.5), 2, Params(frequency_penalty=0.2), 0),  # 2.0 - 0.4 > 1.5
        ((2.0, 1.5), 5, Params(presence_penalty=0.6), 1),  # count does not matter
        ((2.0, 1.5), 5, Params(presence_penalty=0.4), 0),
        ((2.0, 1.5), 0, Params(presence_penalty=5.0, frequency_penalty=5.0), 0),  # unseen
        ((2.0, 1.5), 1, Params(repetition_penalty=1.5), 1),  # 2.0 / 1.5 < 1.5
        ((2.0, 1.5), 1, Params(repetition_penalty=1.2), 0),  # 2.0 / 1.2 > 1.5
        ((-1.0, -1.3), 1, Params(repetition_penalty=1.5), 1),  # -1.0 * 1.5 < -1.3
        ((-1.0, -1.3), 1, Params(repetition_penalty=1.2), 0),  # -1.0 * 1.2 > -1.3
        # repetition first, then frequency: 2/2 - 0.1 = 0.90 < 0.92 (other order: 0.95)
        ((2.0, 0.92), 1, Params(repetition_penalty=2.0, frequency_penalty=0.1), 1),
    ],
)
def test_penalties(logits: tuple[float, float], count: int, params: Params, expected: int) -> None:
    assert penalized_choice(*logits, count, params) == expected


# --- logprobs -------------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_are_raw() -> None:
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(UNIT_BATCH, V)) * 3).astype(np.float32)
    counts = rng.integers(0, 3, size=(UNIT_BATCH, V)).astype(np.int32)
    allowed = rng.random((UNIT_BATCH, V)) < 0.5
    params = [Params(temperature=0.7, top_p=0.9, frequency_penalty=0.5, seed=i) for i in range(6)]
    out = run(logits, params, counts=counts, allowed=allowed)
    assert allowed[np.arange(6), out.token_ids[:6]].all()
    ref = log_softmax(logits)
    rows = np.arange(UNIT_BATCH)
    np.testing.assert_allclose(out.logprobs, ref[rows, out.token_ids], atol=1e-5)
    ref_top_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :TOP_K]
    np.testing.assert_array_equal(out.top_ids, ref_top_ids)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(ref, ref_top_ids, -1), atol=1e-5
    )
    assert (np.diff(out.top_logprobs, axis=-1) <= 0).all()
    assert out.top_ids.shape == (UNIT_BATCH, TOP_K) and out.top_ids.dtype == np.int32


def test_logprobs_only_for_rows_that_ask() -> None:
    rng = np.random.default_rng(15)
    logits = (rng.normal(size=(UNIT_BATCH, V)) * 3).astype(np.float32)
    params = [Params(temperature=0.8, top_p=0.9, seed=i) for i in range(UNIT_BATCH)]
    every = run(logits, params)
    asks = np.zeros(UNIT_BATCH, bool)
    asks[[1, 6]] = True
    some = run(logits, params, logprob_rows=asks)
    np.testing.assert_array_equal(some.token_ids, every.token_ids)  # sampling unaffected
    np.testing.assert_allclose(some.logprobs[asks], every.logprobs[asks], atol=1e-6)
    np.testing.assert_array_equal(some.top_ids[asks], every.top_ids[asks])
    np.testing.assert_allclose(some.top_logprobs[asks], every.top_logprobs[asks], atol=1e-6)
    none = run(logits, params, logprob_rows=np.zeros(UNIT_BATCH, bool))
    np.testing.assert_array_equal(none.token_ids, every.token_ids)
    assert not none.logprobs.any() and not none.top_logprobs.any()
    assert none.top_ids.shape == (UNIT_BATCH, TOP_K)


def test_no_top_logprobs_has_empty_shape(row: np.ndarray) -> None:
    out = run(np.broadcast_to(row, (NUM_DRAWS, V)), [Params()], num_top_logprobs=0)
    assert out.top_ids.shape == (NUM_DRAWS, 0) and out.top_logprobs.shape == (NUM_DRAWS, 0)


# --- bitmask --------------------------------------------------------------------------------


def test_pack_unpack_round_trip_and_bit_order(backend) -> None:
    if backend == "torch":  # the CPU's numpy unpacking
        import torch

        from sgl_tpu.backends.torch import sampler as TS

        def unpack(words: np.ndarray) -> np.ndarray:
            return TS.unpack_bitmask(torch.from_numpy(words), V).numpy()
    else:
        def unpack(words: np.ndarray) -> np.ndarray:
            return np.asarray(S.unpack_bitmask(jnp.asarray(words), V))

    allowed = np.random.default_rng(8).random((3, V)) < 0.5
    packed = H.pack_bitmask(allowed)
    assert packed.shape == (3, 4) and packed.dtype == np.int32
    np.testing.assert_array_equal(unpack(packed), allowed)
    words = np.zeros((2, 4), np.int32)
    words[0, 0] = 1 << 3  # little-endian: bit 3 of word 0 is token 3
    words[1, 1] = np.int32(-(2**31))  # the sign bit of word 1 is token 63
    unpacked = unpack(words)
    assert np.nonzero(unpacked[0])[0].tolist() == [3]
    assert np.nonzero(unpacked[1])[0].tolist() == [63]
    assert (H.full_bitmask(2, V) == -1).all() and H.full_bitmask(2, V).shape == (2, 4)


def test_bitmask_greedy_and_fully_masked_row() -> None:
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(UNIT_BATCH, V)).astype(np.float32)
    allowed = rng.random((UNIT_BATCH, V)) < 0.2
    allowed[:, 96:] = False  # the last, partial word
    allowed[1, 97] = True
    logits[1, 97] = 50.0
    allowed[2] = False  # no token allowed: fall back to the raw argmax, no NaN
    params = [Params(), Params(), Params(temperature=1.0, seed=3)]
    out = run(logits, params, allowed=allowed)
    expected = np.where(allowed, logits, -np.inf).argmax(-1)
    np.testing.assert_array_equal(out.token_ids[[0, 1]], expected[[0, 1]])
    assert out.token_ids[1] == 97
    assert out.token_ids[2] == logits[2].argmax()
    assert np.isfinite(out.logprobs).all() and np.isfinite(out.top_logprobs).all()


# --- torch radix selection ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_radix_select_equals_sorted_definition(backend) -> None:
    """The largest v with sum(w[x >= v]) >= target, on rows with negative and positive values,
    ties, -inf and zero weights, against the definition over a sorted row."""
    import torch

    from sgl_tpu.backends.torch import sampler as TS

    rng = np.random.default_rng(16)
    x = (rng.standard_normal((6, 5000)) * np.array([[0.01], [1], [30], [1], [1], [5]])
         ).astype(np.float32)
    x[3, :2000] = 0.5  # ties
    x[4, rng.random(5000) < 0.5] = -np.inf
    w = np.where(np.isneginf(x), 0.0, rng.random(x.shape)).astype(np.float32)
    w[5] = 1.0  # counts (top-k)
    target = np.array([0.3, 0.9, 0.5, 0.7, 0.99, 0.0], np.float64) * w.astype(np.float64).sum(1)
    target[5] = 777
    got = TS._radix_select(torch.from_numpy(x), torch.from_numpy(w),
                           torch.from_numpy(target)).numpy()
    for i in range(len(x)):
        order = np.argsort(-x[i], kind="stable")
        cum = np.cumsum(w[i, order].astype(np.float64))
        expected = x[i, order[np.argmax(cum >= target[i])]]
        assert got[i] == expected, (i, got[i], expected)


# --- host builder and compilation -----------------------------------------------------------


@jax_only
def test_build_sampling_arrays_pads_greedy_and_validates(backend) -> None:
    arrays = H.build_sampling_arrays(
        [Params(temperature=0.5, top_k=0, seed=-1), Params(seed=2**32 + 5)], 4, steps=[3, 9]
    )
    np.testing.assert_array_equal(arrays.temperature, [0.5, 0, 0, 0])
    np.testing.assert_array_equal(arrays.top_k, [-1, -1, -1, -1])
    np.testing.assert_array_equal(arrays.seed, [2**32 - 1, 5, 0, 0])
    np.testing.assert_array_equal(arrays.step, [3, 9, 0, 0])
    assert arrays.seed.dtype == jnp.uint32 and arrays.top_k.dtype == jnp.int32
    for bad in (
        Params(temperature=-1.0),
        Params(top_p=0.0),
        Params(min_p=1.5),
        Params(repetition_penalty=0.0),
        Params(seed=None),
    ):
        with pytest.raises(ValueError):
            H.build_sampling_arrays([bad], 1)
    with pytest.raises(ValueError):
        H.build_sampling_arrays([Params(), Params()], 1)


@jax_only
def test_parameter_values_do_not_recompile(row: np.ndarray, backend) -> None:
    logits = np.broadcast_to(row, (UNIT_BATCH, V))
    run(logits, [Params()])
    size = _sample._cache_size()
    for params in (
        Params(temperature=1.0, seed=1),
        Params(temperature=1.0, top_p=0.5, top_k=3, min_p=0.1, seed=2),
        Params(frequency_penalty=1.0, repetition_penalty=1.3),
    ):
        run(logits, [params] * UNIT_BATCH, allowed=np.ones((UNIT_BATCH, V), bool))
    assert _sample._cache_size() == size


def test_jax_uniforms_follow_the_contract():
    """The JAX sampler's uniforms (uint32 halves) are the step contract's seed-to-uniform rule
    bit for bit, so the same seed draws the same token on both backends."""
    import jax

    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 2**31 - 1, 512).astype(np.int32)
    seeds[:2], steps[:2] = (0, 2**32 - 1), (0, 2**31 - 1)
    got = jax.jit(S._row_uniforms)(seeds, steps.astype(np.uint32))
    np.testing.assert_array_equal(np.asarray(got), row_uniforms(seeds, steps))


@jax_only
def test_the_same_seed_draws_the_same_tokens_on_both_backends(row: np.ndarray) -> None:
    """One request's draws under several truncations, seeds 0..NUM_DRAWS-1 at steps
    0..NUM_DRAWS-1: the JAX and torch samplers pick the same tokens (same uniforms, kept
    tokens walked in vocabulary order). A draw whose target falls within float rounding of a
    token boundary may part; with these seeds none does."""
    for params in (Params(temperature=1.0, seed=5), Params(temperature=0.8, top_k=40, seed=6),
                   Params(temperature=1.2, top_p=0.9, min_p=0.01, seed=7)):
        by_backend = {}
        for name in ("jax", "torch"):
            _BACKEND["name"] = name
            by_backend[name] = draw(row, params)
        np.testing.assert_array_equal(by_backend["jax"], by_backend["torch"])
