"""Token sampler, traced inside the caller's jit (runner.py: its own program after the model
step, `_sample`, or part of the decode-state step).

Data flow for one decode step (B = padded batch, V = vocab size):

    host: step.sampling_columns(steps) -> SamplingArrays  (numpy, packed with the ForwardBatch)
    device, inside the caller's jit:
        logits f32[B, V] ──┬─> raw log-softmax ──> SampleOutput.logprobs / top_logprobs
                           │                           skipped unless a row asks
                           └─> penalties (token_counts)        skipped unless a row sets one
                               -> vocab bitmask (grammar)      skipped unless a row is constrained
                               -> greedy argmax                rows with temperature 0 / top_k 1
                               -> temperature -> top-k -> top-p -> min-p -> categorical draw
                                                               skipped unless a row samples

Every stage is row-independent and the random draw of a row depends only on its own
(seed, step), through the step contract's seed-to-uniform rule (`_row_uniforms`), so a seeded
request reproduces whatever batch it lands in and at whatever position, and draws what the
torch backend draws for the same seed.

CPU cost notes (XLA:CPU, B=64, V=49152): a full `sort` of the logits costs about a second and
`jax.random.categorical` (one Gumbel per vocab entry) about 200 ms, so neither is used:

* top-k / top-p thresholds come from `lax.top_k` over `num_candidates` candidates; only when a
  row's top-k exceeds that or its nucleus does not fit in it does an exact bisection over the
  float bit patterns run (`_bisect_threshold`, ~30 masked [B, V] reductions), behind a cond.
* the draw is an inverse-CDF lookup with one uniform per row, done in two levels (block sums,
  then one block) so no cumulative sum over the whole vocabulary is needed.
* argmax is done in the same two levels; XLA:CPU's variadic argmax reduce is ~8x slower.
* every `lax.cond` returns [B]-sized results; one returning a [B, V] array costs a copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from sgl_tpu.executor.step import GREEDY_TEMPERATURE_EPS, MASK_BITS_PER_WORD, SPLITMIX64

# Candidates taken with lax.top_k for the top-k / top-p thresholds before falling back to bisection.
DEFAULT_NUM_CANDIDATES = 128
# Vocabulary block for the two-level argmax and inverse-CDF draw.
_BLOCK_SIZE = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-sequence sampling parameters for one batch; all arrays have leading dim B (padded)."""

    temperature: jax.Array  # f32[B]; < GREEDY_TEMPERATURE_EPS means greedy (argmax)
    top_p: jax.Array  # f32[B]; 1.0 = off
    top_k: jax.Array  # i32[B]; <= 0 = off (SGLang's -1); 1 = greedy
    min_p: jax.Array  # f32[B]; 0.0 = off
    frequency_penalty: jax.Array  # f32[B]; logits -= freq * count
    presence_penalty: jax.Array  # f32[B]; logits -= pres * (count > 0)
    repetition_penalty: jax.Array  # f32[B]; 1.0 = off; seen tokens: l > 0 ? l / p : l * p
    seed: jax.Array  # u32[B]; per-request seed
    step: jax.Array  # i32[B]; index of the output token being sampled (0 = first)
    # bool[B]; rows whose log-probs are read. None = every row. The log-prob work (logsumexp
    # and top-K over [B, V]) runs only when some row asks (a cond: static shapes).
    return_logprob: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What one sampling step returns; log-probabilities are of the raw (unprocessed) logits."""

    token_ids: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]; raw log-softmax at token_ids
    top_ids: jax.Array  # i32[B, K]; K = num_top_logprobs (may be 0)
    top_logprobs: jax.Array  # f32[B, K]; descending


# ---------------------------------------------------------------------------------------------
# Device side (traceable; call from inside jit)
# ---------------------------------------------------------------------------------------------


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """i32[B, W] packed mask -> bool[B, vocab_size]; little-endian bits within each word."""
    batch, num_words = bitmask.shape
    shifts = jnp.arange(MASK_BITS_PER_WORD, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(batch, num_words * MASK_BITS_PER_WORD)[:, :vocab_size] != 0


def sample(
    logits: jax.Array,
    arrays: SamplingArrays,
    token_counts: jax.Array | None,
    vocab_bitmask: jax.Array | None,
    *,
    num_top_logprobs: int,
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
) -> SampleOutput:
    """Pick one token per row and report raw log-probabilities.

    logits        f32/bf16[B, V]
    token_counts  i32[B, V]  occurrences of each token in the request's output so far; None when
                  the batch has no penalties (skips the [B, V] transfer)
    vocab_bitmask i32[B, ceil(V/32)]  packed allowed tokens (-1 words = unconstrained); None = off
    num_top_logprobs, num_candidates: static.

    A row whose mask leaves no finite logit falls back to the argmax of its raw logits.
    """
    raw = logits.astype(jnp.float32)  # [B, V]
    batch, vocab_size = raw.shape
    if not 0 <= num_top_logprobs <= vocab_size:
        raise ValueError(f"num_top_logprobs={num_top_logprobs} not in [0, {vocab_size}]")
    if num_candidates < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")

    no_row_masked = jnp.zeros((batch,), jnp.bool_)
    choose = functools.partial(_choose_tokens, arrays=arrays, num_candidates=num_candidates)
    if token_counts is None and vocab_bitmask is None:
        token_ids = choose(raw, no_row_masked)
    else:
        needs_processing = jnp.bool_(False)
        if token_counts is not None:
            needs_processing |= jnp.any(
                (arrays.frequency_penalty != 0)
                | (arrays.presence_penalty != 0)
                | (arrays.repetition_penalty != 1)
            )
        if vocab_bitmask is not None:
            needs_processing |= jnp.any(vocab_bitmask != -1)
        token_ids = lax.cond(
            needs_processing,
            lambda: choose(*_process_logits(raw, token_counts, vocab_bitmask, arrays)),
            lambda: choose(raw, no_row_masked),
        )

    token_ids = token_ids.astype(jnp.int32)
    logprob_fn = functools.partial(_logprobs, raw, token_ids, num_top_logprobs)
    if arrays.return_logprob is None:
        logprobs, top_ids, top_logprobs = logprob_fn()
    else:
        logprobs, top_ids, top_logprobs = lax.cond(
            jnp.any(arrays.return_logprob), logprob_fn,
            lambda: (jnp.zeros((batch,), jnp.float32),
                     jnp.zeros((batch, num_top_logprobs), jnp.int32),
                     jnp.zeros((batch, num_top_logprobs), jnp.float32)))
    return SampleOutput(
        token_ids=token_ids, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs
    )


@jax.named_scope("logprobs")
def _logprobs(
    raw: jax.Array, token_ids: jax.Array, num_top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log-softmax of raw [B, V] at token_ids [B], and the top-`num_top` ids [B, K] and
    log-probs [B, K] of each row."""
    batch = raw.shape[0]
    row_max = jnp.max(raw, axis=-1)  # [B]
    lse = row_max + jnp.log(jnp.sum(jnp.exp(raw - row_max[:, None]), axis=-1))  # [B]
    logprobs = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - lse  # [B]
    if num_top > 0:
        top_vals, top_ids = lax.top_k(raw, num_top)  # [B, K]
        return logprobs, top_ids.astype(jnp.int32), top_vals - lse[:, None]
    return logprobs, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.float32)


@jax.named_scope("penalties_mask")
def _process_logits(
    raw: jax.Array,
    token_counts: jax.Array | None,
    vocab_bitmask: jax.Array | None,
    arrays: SamplingArrays,
) -> tuple[jax.Array, jax.Array]:
    """Penalties then the vocab mask; returns (logits f32[B, V], fully_masked bool[B]).

    Penalties follow vLLM: repetition (multiplicative, on seen tokens) then frequency and
    presence. A row whose mask leaves no finite logit gets its raw logits back and is flagged.
    """
    x = raw
    if token_counts is not None:
        counts = token_counts.astype(jnp.float32)  # [B, V]
        seen = counts > 0
        rep = arrays.repetition_penalty[:, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - arrays.frequency_penalty[:, None] * counts
        x = x - arrays.presence_penalty[:, None] * seen.astype(jnp.float32)
    fully_masked = jnp.zeros((raw.shape[0],), jnp.bool_)
    if vocab_bitmask is not None:
        allowed = unpack_bitmask(vocab_bitmask, raw.shape[1])  # [B, V]
        x = jnp.where(allowed, x, -jnp.inf)
        fully_masked = jnp.max(x, axis=-1) == -jnp.inf  # [B]
        x = jnp.where(fully_masked[:, None], raw, x)
    return x, fully_masked


def _choose_tokens(
    x: jax.Array, fully_masked: jax.Array, arrays: SamplingArrays, num_candidates: int
) -> jax.Array:
    """Greedy rows take the argmax of x; the rest sample (skipped when no row samples); i32[B]."""
    greedy = (arrays.temperature < GREEDY_TEMPERATURE_EPS) | (arrays.top_k == 1) | fully_masked
    greedy_ids = _argmax(x)  # [B]
    return lax.cond(
        jnp.all(greedy),
        lambda: greedy_ids,
        lambda: jnp.where(greedy, greedy_ids, _sample_random(x, arrays, greedy, num_candidates)),
    )


def _sample_random(
    x: jax.Array, arrays: SamplingArrays, greedy: jax.Array, num_candidates: int
) -> jax.Array:
    """Temperature -> top-k -> top-p -> min-p -> inverse-CDF draw; i32[B] (greedy rows: junk).

    The [B, V] temperature-scaled logits are never passed between stages: each stage scales
    x itself (always as x * inv_temperature, so every stage sees bit-identical values), which
    lets XLA fuse the scaling into its consumers instead of writing and re-reading [B, V].
    """
    vocab_size = x.shape[1]
    inv_temperature = 1.0 / jnp.where(greedy, 1.0, arrays.temperature)  # [B]
    row_max = jnp.max(x, axis=-1) * inv_temperature  # [B]; scaling by c > 0 keeps the max

    active = ~greedy
    k_on = active & (arrays.top_k > 0) & (arrays.top_k < vocab_size)
    p_on = active & (arrays.top_p < 1.0)
    threshold = lax.cond(
        jnp.any(k_on | p_on),
        functools.partial(_top_k_top_p_threshold, num_candidates=num_candidates),
        lambda *_: jnp.full(row_max.shape, -jnp.inf),
        x,
        inv_temperature,
        row_max,
        arrays.top_k,
        arrays.top_p,
        k_on,
        p_on,
    )
    # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); independent of renormalizing.
    min_p_threshold = jnp.where(
        arrays.min_p > 0, row_max + jnp.log(jnp.maximum(arrays.min_p, 1e-30)), -jnp.inf
    )
    threshold = jnp.maximum(threshold, min_p_threshold)  # [B]; never above row_max

    def weights(v: jax.Array) -> jax.Array:
        """Unnormalized kept probabilities of logits v [B, ...]; the top token weighs 1."""
        per_row = (-1,) + (1,) * (v.ndim - 1)
        scaled = v * inv_temperature.reshape(per_row)
        kept = scaled >= threshold.reshape(per_row)
        return jnp.where(kept, jnp.exp(scaled - row_max.reshape(per_row)), 0.0)

    return _inverse_cdf(x, weights, _row_uniforms(arrays.seed, arrays.step))


@jax.named_scope("top_k_top_p")
def _top_k_top_p_threshold(
    x: jax.Array,
    inv_temperature: jax.Array,
    row_max: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    k_on: jax.Array,
    p_on: jax.Array,
    num_candidates: int,
) -> jax.Array:
    """Smallest kept logit per row, f32[B] (-inf = keep all); tokens with logit >= it survive.

    top-k keeps the k largest; top-p then keeps, of those, the shortest prefix (by descending
    probability, renormalized over the top-k set) whose mass reaches top_p.
    """
    vocab_size = x.shape[1]
    num_cand = min(num_candidates, vocab_size)
    # Scaling by a positive factor keeps the order, so the candidates are picked on x and the
    # [B, V] scaled logits are never materialized on this path.
    cand_x, _ = lax.top_k(x, num_cand)  # [B, C] descending
    cand = cand_x * inv_temperature[:, None]  # [B, C]
    cand_w = jnp.exp(cand - row_max[:, None])  # [B, C]

    k_fast = k_on & (top_k <= num_cand)
    k_idx = jnp.clip(top_k - 1, 0, num_cand - 1)
    top_k_thr = jnp.where(k_fast, _take(cand, k_idx), -jnp.inf)  # [B]
    cum = jnp.cumsum(jnp.where(cand >= top_k_thr[:, None], cand_w, 0.0), axis=-1)  # [B, C]
    total = jnp.sum(jnp.exp(x * inv_temperature[:, None] - row_max[:, None]), axis=-1)  # [B]
    mass_k = jnp.where(k_fast, cum[:, -1], total)
    reached = cum >= (top_p * mass_k)[:, None]  # [B, C]
    found = jnp.any(reached, axis=-1)
    top_p_thr = jnp.where(p_on & found, _take(cand, jnp.argmax(reached, axis=-1)), -jnp.inf)
    threshold = jnp.maximum(top_k_thr, top_p_thr)

    k_slow = k_on & ~k_fast
    slow = k_slow | (p_on & ~found)
    return lax.cond(
        jnp.any(slow),
        lambda: jnp.where(
            slow,
            _bisect_threshold(
                x * inv_temperature[:, None], row_max, top_k, top_p, p_on, top_k_thr, k_slow, slow
            ),
            threshold,
        ),
        lambda: threshold,
    )


@jax.named_scope("bisect")
def _bisect_threshold(
    scaled: jax.Array,
    row_max: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    p_on: jax.Array,
    top_k_thr: jax.Array,
    k_slow: jax.Array,
    slow: jax.Array,
) -> jax.Array:
    """Exact thresholds of the `slow` rows by binary search over float bit patterns, f32[B].

    top-k: the largest logit t with count(scaled >= t) >= k (32 halvings of the key range).
    top-p: the largest weight w with mass(weights >= w) >= top_p * mass(top-k set), searched
    on the weights alone (one [B, V] read per halving; weights lie in [0, 1], a key range
    under 2**30) and then mapped back to the smallest logit whose weight reaches it; weights
    are monotone in logits, so both describe the same kept set.

    A halving is one masked [B, V] reduction (~1.5-3 ms at B=64, V=49152 on CPU). Searching
    values instead of bit patterns took more passes on real logits, and k-ary steps (several
    thresholds per pass) do not vectorize on XLA:CPU.
    """
    weights = jnp.exp(scaled - row_max[:, None])  # [B, V] in [0, 1]

    def count_at_least(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(scaled >= t[:, None], 1.0, 0.0), axis=-1) >= top_k

    top_k_thr = lax.cond(
        jnp.any(k_slow),
        lambda: jnp.where(
            k_slow,
            _largest_true(count_at_least, jnp.full_like(row_max, -jnp.inf), row_max, 32),
            top_k_thr,
        ),
        lambda: top_k_thr,
    )

    def top_p_threshold() -> jax.Array:
        target = top_p * jnp.sum(jnp.where(scaled >= top_k_thr[:, None], weights, 0.0), axis=-1)

        def mass_at_least(w: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(weights >= w[:, None], weights, 0.0), axis=-1) >= target

        w_thr = _largest_true(mass_at_least, jnp.zeros_like(row_max), jnp.ones_like(row_max), 30)
        return jnp.min(jnp.where(weights >= w_thr[:, None], scaled, jnp.inf), axis=-1)

    top_p_thr = lax.cond(
        jnp.any(slow & p_on), top_p_threshold, lambda: jnp.full_like(row_max, -jnp.inf)
    )
    return jnp.maximum(top_k_thr, jnp.where(p_on, top_p_thr, -jnp.inf))


def _largest_true(
    pred: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array, num_steps: int
) -> jax.Array:
    """Per row, the largest float t in [lo, hi] with pred(t) true; f32[B].

    pred maps f32[B] -> bool[B], monotone (true below some point); pred(lo) must hold. Each
    step halves [key(lo), key(hi)], so num_steps >= log2 of that key range makes it exact.
    """

    def body(_: int, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = carry
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # upper middle: lo < hi => mid > lo
        ok = pred(_key_to_float(mid))
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, num_steps, body, (_float_to_key(lo), _float_to_key(hi)))
    return _key_to_float(lo)


def _float_to_key(x: jax.Array) -> jax.Array:
    """f32 -> u32 whose unsigned order is the float order (-inf .. inf; NaN excluded)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of _float_to_key."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _row_uniforms(seed: jax.Array, step: jax.Array) -> jax.Array:
    """u32 seed, step [B] -> f32[B] in [0, 1): the step contract's seed-to-uniform rule
    (`step.row_uniforms`, splitmix64), in uint32 halves (JAX runs without 64-bit integers):

        z = (hi, lo) = (seed, step)     z + c, z ^ (z >> s), z * c on the pair, mod 2^64
    """
    hi, lo = seed.astype(jnp.uint32), step.astype(jnp.uint32)
    hi, lo = _add64(hi, lo, SPLITMIX64[0])
    hi, lo = _mul64(*_xor_shift64(hi, lo, 30), SPLITMIX64[1])
    hi, lo = _mul64(*_xor_shift64(hi, lo, 27), SPLITMIX64[2])
    hi, _ = _xor_shift64(hi, lo, 31)
    return (hi >> 8).astype(jnp.float32) / float(1 << 24)  # z >> 40: 24 bits, exact


def _halves(c: int) -> tuple[jax.Array, jax.Array]:
    return jnp.uint32(c >> 32), jnp.uint32(c & 0xFFFFFFFF)


def _add64(hi: jax.Array, lo: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    c_hi, c_lo = _halves(c)
    out_lo = lo + c_lo
    return hi + c_hi + (out_lo < lo).astype(jnp.uint32), out_lo


def _xor_shift64(hi: jax.Array, lo: jax.Array, s: int) -> tuple[jax.Array, jax.Array]:
    """z ^ (z >> s) for 0 < s < 32."""
    return hi ^ (hi >> s), lo ^ ((lo >> s) | (hi << (32 - s)))


def _mul32_wide(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 64-bit product of two u32 as (hi, lo), from 16-bit pieces."""
    mask = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & mask, a >> 16, b & mask, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & mask) + (p10 & mask)  # < 3 * 2^16
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (p00 & mask) | (mid << 16)


def _mul64(hi: jax.Array, lo: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """z * c mod 2^64: lo * c_lo in full, the cross terms' low halves into the high word."""
    c_hi, c_lo = _halves(c)
    p_hi, p_lo = _mul32_wide(lo, c_lo)
    return p_hi + hi * c_lo + lo * c_hi, p_lo


# Two-level layout used by _argmax and _inverse_cdf:
#
#   vocab   | 0 ........ 255 | 256 ...... 511 | ... | (NB-1)*256 ... V-1, padding |
#   block   |       0        |       1        | ... |             NB-1            |
#
# A per-block reduction ([B, NB]) picks the block, then one [B, 256] slice picks the token.


def _to_blocks(x: jax.Array, pad_value: float) -> jax.Array:
    """[B, V] -> [B, NB, _BLOCK_SIZE], padding the tail with pad_value."""
    batch, vocab_size = x.shape
    num_blocks = math.ceil(vocab_size / _BLOCK_SIZE)
    pad = num_blocks * _BLOCK_SIZE - vocab_size
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=pad_value)
    return x.reshape(batch, num_blocks, _BLOCK_SIZE)


def _take_block(blocks: jax.Array, block_idx: jax.Array) -> jax.Array:
    """[B, NB, S], i32[B] -> [B, S]."""
    return jnp.take_along_axis(blocks, block_idx[:, None, None], axis=1)[:, 0]


@jax.named_scope("argmax")
def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum, i32[B] (same ties as jnp.argmax)."""
    blocks = _to_blocks(x, -jnp.inf)  # [B, NB, S]
    block_idx = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # [B]
    inner = jnp.argmax(_take_block(blocks, block_idx), axis=-1)  # [B]
    return (block_idx * _BLOCK_SIZE + inner).astype(jnp.int32)


@jax.named_scope("draw")
def _inverse_cdf(
    x: jax.Array, weights: Callable[[jax.Array], jax.Array], u: jax.Array
) -> jax.Array:
    """Draw index i with probability weights(x)[i] / sum(weights(x)), i32[B].

    x f32[B, V]; `weights` maps logits of any [B, ...] shape elementwise to weights >= 0 (and
    -inf padding to 0), with a positive sum per row; u f32[B] uniform in [0, 1). Weights are
    recomputed for the chosen block rather than kept as a [B, V] array. A token of weight 0 is
    never returned, whatever the rounding.
    """
    blocks = _to_blocks(x, -jnp.inf)  # [B, NB, S]
    block_mass = jnp.sum(weights(blocks), axis=-1)  # [B, NB]
    block_cum = jnp.cumsum(block_mass, axis=-1)  # [B, NB]
    target = u * block_cum[:, -1]  # [B]
    block_idx = _first_above(block_cum, block_mass, target)
    prev = jnp.where(block_idx > 0, _take(block_cum, block_idx - 1), 0.0)
    inner = weights(_take_block(blocks, block_idx))  # [B, S]
    inner_idx = _first_above(jnp.cumsum(inner, axis=-1), inner, target - prev)
    return (block_idx * _BLOCK_SIZE + inner_idx).astype(jnp.int32)


def _first_above(cum: jax.Array, mass: jax.Array, target: jax.Array) -> jax.Array:
    """First j with cum[j] > target, capped at the last j with mass[j] > 0; i32[B]."""
    idx = jnp.sum(cum <= target[:, None], axis=-1, dtype=jnp.int32)
    iota = lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    last_positive = jnp.max(jnp.where(mass > 0, iota, 0), axis=-1)
    return jnp.minimum(idx, last_positive)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[b, idx[b]] for each row: [B, N], i32[B] -> [B]."""
    return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]
