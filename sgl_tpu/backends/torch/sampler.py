"""Token sampler of the PyTorch backend: the semantics of `sgl_tpu.backends.jax.sampler` in torch.

    logits f32[B, V] ──┬─> raw log-softmax ─> chosen log-prob, top-K log-probs
                       │                      (only rows that asked: `logprob_rows`)
                       └─> penalties (counts) -> vocab bitmask -> greedy argmax
                           -> temperature -> top-k -> top-p -> min-p -> inverse-CDF draw

Same rules as the JAX sampler: a row is greedy when its temperature is below
`GREEDY_TEMPERATURE_EPS`, its top_k is 1 or its mask leaves nothing; truncation keeps every
token whose scaled logit reaches the row's threshold (top-k, then top-p over the renormalized
top-k set, then min-p relative to the top token); the draw uses one uniform per row that depends
only on (seed, step) (the step contract's rule, computed on the device by
`decode_state.row_uniforms`), so a seeded request reproduces in any batch, and draws what the
JAX backend draws for the same seed.

Sampling rows avoid full-vocabulary passes (`_sample_rows`):

    x [R, V] ─topk─> C candidates [R, C] ─> thresholds ─┬─ kept set inside them: draw over C
             (one selection; plus one exp-sum pass     └─ otherwise (top-k > C, nucleus wider
              when a row's nucleus needs all the mass)     than C, no truncation): draw over V,
                                                           exact thresholds by radix selection
                                                           (no sort) when the candidates could
                                                           not give them

Both draws walk the kept tokens in vocabulary order with bit-equal weights, so a row samples
the same token for the same uniform whichever path it takes.

`sample_static` is the same arithmetic for CUDA graphs (fixed shapes, no host synchronisation):
every row takes both draws and keeps the one `sample` would; the exact thresholds the
candidates cannot give come from one sort of each row instead of `_radix_select` (whose later
passes read only the tokens of the chosen digit: data-dependent shapes).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from sgl_tpu.executor.step import GREEDY_TEMPERATURE_EPS

DEFAULT_NUM_CANDIDATES = 128
_BITS_PER_WORD = 32
_SPARSE_MASK_WORDS = 4  # words per row with a disallowed token, at most, for the in-place ban
_MASK64 = (1 << 64) - 1


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """i32[B, W] packed allowed tokens (bit j of word w = token 32w + j) -> bool[B, V].

    On the CPU one numpy pass (the shifts below take several over [B, W, 32]): the words'
    little-endian bytes unpacked least significant bit first are bits 0 .. 31 of word 0, then
    word 1, ..."""
    if bitmask.device.type == "cpu":
        words = np.ascontiguousarray(bitmask.numpy(), dtype="<i4")
        bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")  # u8[B, 32W]
        return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def _banned_ids(bitmask: torch.Tensor, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(rows, token ids) a CPU bitmask disallows, when every row allows all but a few words
    of tokens (a min_new_tokens ban of EOS and stop ids, not a grammar); None otherwise."""
    if bitmask.device.type != "cpu":
        return None
    words = bitmask.numpy()  # i32[B, W]
    partial = words != -1
    per_row = partial.sum(axis=1)
    # every row keeps a whole word allowed (so it is not fully masked)
    if per_row.max(initial=0) > _SPARSE_MASK_WORDS or (per_row >= words.shape[1]).any():
        return None
    rows, cols = np.nonzero(partial)
    chosen = np.ascontiguousarray(words[rows, cols], dtype="<i4").view(np.uint8).reshape(-1, 4)
    word, bit = np.nonzero(np.unpackbits(chosen, axis=1, bitorder="little") == 0)
    ids = cols[word] * _BITS_PER_WORD + bit
    real = ids < vocab_size
    return rows[word][real], ids[real]


def _dense_mask(x: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] with the tokens `bitmask` disallows at -inf, rows it disallows entirely left
    as `raw` (they decode greedily); -> (x, fully_masked bool[B])."""
    allowed = unpack_bitmask(bitmask, raw.shape[1])  # bool[B, V]
    fully_masked = ~allowed.any(dim=-1)
    masked = torch.where(allowed, x, -torch.inf)
    return torch.where(fully_masked[:, None], raw, masked), fully_masked


def sample(
    logits: torch.Tensor,  # f32[B, V]
    *,
    temperature: torch.Tensor,  # f32[B]
    top_p: torch.Tensor,  # f32[B]
    top_k: torch.Tensor,  # i64[B]; <= 0 off
    min_p: torch.Tensor,  # f32[B]
    uniforms: torch.Tensor,  # f32[B]
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    bitmask: torch.Tensor | None,  # i32[B, W]
    num_top_logprobs: int,
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
    logprob_rows: torch.Tensor | None = None,  # bool[B]; None = every row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> token_ids i64[B], logprobs f32[B], top_ids i64[B, K], top_logprobs f32[B, K].

    `penalties` = (counts i32[B, V], frequency f32[B], presence f32[B], repetition f32[B]).
    Log-probs are of the raw logits, computed only for `logprob_rows` (the other rows get
    zeros).
    """
    raw = logits.float()
    fully_masked = torch.zeros(raw.shape[0], dtype=torch.bool, device=raw.device)
    x = raw if penalties is None else _penalize(raw, penalties)
    banned = None if bitmask is None else _banned_ids(bitmask, raw.shape[1])
    if banned is not None:
        # a few ids per row: set to -inf in place and put back once the tokens are chosen (no
        # [B, V] copy, whose fresh pages cost more than the masking here)
        banned_at = (torch.from_numpy(banned[0]), torch.from_numpy(banned[1]))
        kept = x[banned_at]
        x[banned_at] = -torch.inf
    elif bitmask is not None:
        x, fully_masked = _dense_mask(x, raw, bitmask)

    greedy = (temperature < GREEDY_TEMPERATURE_EPS) | (top_k == 1) | fully_masked
    rows = (~greedy).nonzero().flatten()
    sample_rows = partial(_sample_rows, num_candidates=num_candidates)
    if rows.numel() == 0:
        token_ids = x.argmax(dim=-1)
    elif rows.numel() == x.shape[0]:  # every row samples: no argmax, no row copy
        token_ids = sample_rows(x, temperature, top_p, top_k, min_p, uniforms)
    else:
        token_ids = x.argmax(dim=-1)
        token_ids[rows] = sample_rows(x[rows], temperature[rows], top_p[rows], top_k[rows],
                                      min_p[rows], uniforms[rows])
    if banned is not None:
        x[banned_at] = kept
    return (token_ids, *_logprobs(raw, token_ids, logprob_rows, num_top_logprobs))


def sample_static(
    logits: torch.Tensor,  # f32[S, V]
    *,
    temperature: torch.Tensor,  # f32[S]
    top_p: torch.Tensor,  # f32[S]
    top_k: torch.Tensor,  # i64[S]; <= 0 off
    min_p: torch.Tensor,  # f32[S]
    uniforms: torch.Tensor,  # f32[S]
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    num_top_logprobs: int,
    logprob_rows: torch.Tensor,  # bool[S]
    bitmask: torch.Tensor | None = None,  # i32[S, W]; None: no mask
    num_candidates: int = DEFAULT_NUM_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample` in fixed shapes with no host synchronisation and no data-dependent Python: the
    function a CUDA graph records (backends/torch/static_decode.py).

    Every row goes through every stage: penalties (neutral values leave a row bit-equal); the
    mask, dense (a row it disallows entirely decodes its raw logits greedily, as in `sample`);
    thresholds from the candidates and exact ones from the sorted row (`_sorted_threshold`), a
    row keeping the latter where the candidates did not suffice (a top-k above them, a nucleus
    wider than them); both draws of `_sample_rows` (over the candidates, and over the whole
    vocabulary), each row keeping the one `_sample_rows` would take (greedy rows run them with
    temperature 1 and keep the argmax); log-probs of all rows (zeros where not asked).
    -> token_ids i64[S], logprobs f32[S], top_ids i64[S, K], top_logprobs f32[S, K]: `sample`'s
    (the sorted thresholds are the values `_radix_select` selects; `_sorted_threshold` names
    the one caveat).
    """
    raw = logits.float()
    x = _penalize(raw, penalties)
    vocab_size = x.shape[1]
    num_cand = min(num_candidates, vocab_size)
    greedy = (temperature < GREEDY_TEMPERATURE_EPS) | (top_k == 1)
    if bitmask is not None:
        x, fully_masked = _dense_mask(x, raw, bitmask)
        greedy = greedy | fully_masked
    inv = torch.where(greedy, 1.0, temperature)[:, None]  # [S, 1]
    cand_x, cand_idx = torch.topk(x, num_cand, dim=-1)  # [S, C] descending
    cand = cand_x / inv
    row_max = cand[:, 0]
    cand_w = (cand - row_max[:, None]).exp()
    k_on = (top_k > 0) & (top_k < vocab_size)
    p_on = top_p < 1.0
    scaled = x / inv  # [S, V]; once, for the weights and the whole-vocabulary thresholds
    weights = (scaled - row_max[:, None]).exp()  # bit-equal to _weights(x, inv, row_max)
    thr, resolved = _thresholds(cand, cand_w, weights.sum(dim=-1), top_k, top_p, k_on, p_on,
                                complete=num_cand == vocab_size)
    exact = _sorted_threshold(scaled, weights, top_k, top_p, k_on, p_on)
    thr = torch.maximum(torch.where(resolved, thr, exact), _min_p_threshold(row_max, min_p))
    last = cand[:, -1]
    fits = resolved & ((thr > last) | torch.isneginf(last) | (num_cand == vocab_size))
    in_cand = _draw_candidates(cand, cand_w, cand_idx, thr, uniforms, fixed=True)
    kept = torch.where(scaled >= thr[:, None], weights, 0.0)  # [S, V]
    in_vocab = _draw(kept, uniforms, fixed=True)
    drawn = torch.where(fits, in_cand, in_vocab)
    token_ids = torch.where(greedy, x.argmax(dim=-1), drawn)
    return token_ids, *logprobs_static(raw, token_ids, logprob_rows, num_top_logprobs)


def logprobs_static(raw: torch.Tensor, token_ids: torch.Tensor, want: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_logprobs` in fixed shapes: every row computed, zeros where `want` [S] is False."""
    lse = torch.logsumexp(raw, dim=-1)  # [S]
    chosen = raw.gather(1, token_ids[:, None])[:, 0] - lse
    top_lp, top_ids = torch.topk(raw, num_top, dim=-1)
    return (torch.where(want, chosen, 0.0), torch.where(want[:, None], top_ids, 0),
            torch.where(want[:, None], top_lp - lse[:, None], 0.0))


def _penalize(raw: torch.Tensor, penalties: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Repetition, frequency and presence penalties from token counts i32[B, V]; a row with
    neutral values (1, 0, 0) comes out bit-equal."""
    counts, freq, pres, rep = penalties
    c = counts.float()
    seen = c > 0
    x = torch.where(seen, torch.where(raw > 0, raw / rep[:, None], raw * rep[:, None]), raw)
    return x - freq[:, None] * c - pres[:, None] * seen.float()


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, want: torch.Tensor | None,
              num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-softmax at token_ids [B] and the top-`num_top` ids / log-probs [B, K] of the
    rows in `want` (None: all); zeros elsewhere, and no vocabulary pass when no row asks."""
    batch = raw.shape[0]
    if want is None or bool(want.all()):
        rows, sub, ids = None, raw, token_ids
    else:
        rows = want.nonzero().flatten()
        if rows.numel() == 0:
            return (torch.zeros(batch, device=raw.device),
                    torch.zeros(batch, num_top, dtype=torch.long, device=raw.device),
                    torch.zeros(batch, num_top, device=raw.device))
        sub, ids = raw[rows], token_ids[rows]
    lse = torch.logsumexp(sub, dim=-1)  # [R]
    chosen = sub.gather(1, ids[:, None])[:, 0] - lse
    top_lp, top_ids = torch.topk(sub, num_top, dim=-1)
    top_lp = top_lp - lse[:, None]
    if rows is None:
        return chosen, top_ids, top_lp
    logprobs = torch.zeros(batch, device=raw.device).index_copy_(0, rows, chosen)
    all_ids = torch.zeros(batch, num_top, dtype=torch.long, device=raw.device)
    all_lp = torch.zeros(batch, num_top, device=raw.device)
    return logprobs, all_ids.index_copy_(0, rows, top_ids), all_lp.index_copy_(0, rows, top_lp)


def _sample_rows(x, temperature, top_p, top_k, min_p, u, num_candidates: int) -> torch.Tensor:
    """Draw one token per row of x [R, V] (all rows sample); i64[R].

    One partial selection gives each row's top C logits; thresholds come from them, and a row
    whose kept set lies inside them (its threshold above the C-th logit) draws from them alone.
    The other rows (top-k > C, a nucleus wider than C, or no truncation at all) draw over the
    whole vocabulary, with exact thresholds from `_radix_select` where the candidates did not
    give them. Both draws walk the kept tokens in vocabulary order with the same float32
    weights, so they pick the same token for the same uniform: which path a row takes never
    changes its sample.
    """
    vocab_size = x.shape[1]
    num_cand = min(num_candidates, vocab_size)
    inv = temperature[:, None]
    cand_x, cand_idx = torch.topk(x, num_cand, dim=-1)  # [R, C] descending
    cand = cand_x / inv  # [R, C]; bit-equal to x / T at those tokens
    row_max = cand[:, 0]  # [R]
    cand_w = (cand - row_max[:, None]).exp()  # [R, C]; the top token weighs 1

    k_on = (top_k > 0) & (top_k < vocab_size)
    p_on = top_p < 1.0
    weights_all = total = None  # [R, V], [R]
    if bool((p_on & ~(k_on & (top_k <= num_cand))).any()):  # the nucleus needs all the mass
        weights_all = _weights(x, inv, row_max)
        total = weights_all.sum(dim=-1)
    thr, resolved = _thresholds(cand, cand_w, total, top_k, top_p, k_on, p_on,
                                complete=num_cand == vocab_size)
    thr = torch.maximum(thr, _min_p_threshold(row_max, min_p))
    last = cand[:, -1]  # [R]; no token outside the candidates lies above it
    fits = resolved & ((thr > last) | torch.isneginf(last) | (num_cand == vocab_size))

    if bool(fits.all()):
        return _draw_candidates(cand, cand_w, cand_idx, thr, u)
    token_ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if bool(fits.any()):
        f = fits.nonzero().flatten()
        token_ids[f] = _draw_candidates(cand[f], cand_w[f], cand_idx[f], thr[f], u[f])
    wide, pick = _row_picker(~fits)
    scaled = pick(x) / pick(inv)  # [R', V]; bit-equal to what the weights were made from
    weights = _weights(pick(x), pick(inv), pick(row_max)) if weights_all is None \
        else pick(weights_all)
    thr_w = pick(thr)
    if not bool(resolved[wide].all()):  # top-k beyond C or a nucleus wider than C
        redo, sub = _row_picker(~pick(resolved))
        exact = _exact_threshold(sub(scaled), sub(weights), sub(pick(top_k)), sub(pick(top_p)),
                                 sub(pick(k_on)), sub(pick(p_on)))
        thr_w[redo] = torch.maximum(exact, _min_p_threshold(sub(pick(row_max)),
                                                            sub(pick(min_p))))
    token_ids[wide] = _draw(torch.where(scaled >= thr_w[:, None], weights, 0.0), pick(u))
    return token_ids


def _exact_threshold(scaled, weights, top_k, top_p, k_on, p_on) -> torch.Tensor:
    """The threshold of `_thresholds` over whole rows [R, V], without sorting: the k-th largest
    scaled logit, then the largest logit whose kept mass (over the top-k set) reaches top_p."""
    top_k_thr = torch.full_like(scaled[:, 0], -torch.inf)
    if bool(k_on.any()):
        k = torch.where(k_on, top_k, 1).to(torch.float64)
        top_k_thr = torch.where(k_on, _radix_select(scaled, torch.ones_like(weights), k),
                                -torch.inf)
    if not bool(p_on.any()):
        return top_k_thr
    in_k = weights  # [R, V]
    if bool(k_on.any()):
        in_k = torch.where(scaled >= top_k_thr[:, None], weights, 0.0)
    target = top_p.double() * in_k.double().sum(dim=-1)
    top_p_thr = torch.where(p_on, _radix_select(scaled, in_k, target), -torch.inf)
    return torch.maximum(top_k_thr, top_p_thr)


def _sorted_threshold(scaled, weights, top_k, top_p, k_on, p_on) -> torch.Tensor:
    """`_exact_threshold` of every row [R, V] in fixed shapes (-inf where neither knob is on):
    each row sorted once, descending; the top-k threshold is its k-th value, the top-p one
    the first value at which the running mass of the top-k set (float64, in that order)
    reaches `_exact_threshold`'s target (the same expression, so the same float64 number).

    These are the values `_radix_select` selects (a value, never a sum), except where a
    partial mass lies within float64 rounding of the target: the histogram sums the same
    weights in another order."""
    vocab_size = scaled.shape[1]
    ordered, order = scaled.sort(dim=-1, descending=True)  # [R, V]
    k_idx = (top_k - 1).clamp(0, vocab_size - 1)[:, None]
    top_k_thr = torch.where(k_on, ordered.gather(1, k_idx)[:, 0], -torch.inf)  # [R]
    in_k = torch.where(scaled >= top_k_thr[:, None], weights, 0.0)  # [R, V]
    target = top_p.double() * in_k.double().sum(dim=-1)  # [R]
    mass = in_k.gather(1, order).double().cumsum(dim=-1)  # [R, V] mass of the top i + 1
    first = (mass < target[:, None]).sum(dim=-1).clamp_max(vocab_size - 1)[:, None]
    top_p_thr = torch.where(p_on, ordered.gather(1, first)[:, 0], -torch.inf)
    return torch.maximum(top_k_thr, top_p_thr)


# Radix digits of the 32-bit order key, most significant first: (shift, bits).
_RADIX_DIGITS = ((20, 12), (10, 10), (0, 10))


def _radix_select(values: torch.Tensor, weights: torch.Tensor, target: torch.Tensor
                  ) -> torch.Tensor:
    """Per row, the largest v among values [R, V] (f32, no NaN) whose weight at or above it,
    sum(weights[values >= v]), reaches target [R] (<= the row's whole weight); f32[R].

    Each float maps to a signed 32-bit key with the same order. Three digit passes, most
    significant first, each build a weighted histogram (float64) of one digit over the tokens
    that match the digits chosen so far and keep the highest digit whose mass from there up
    (plus the mass above the chosen prefix) reaches the target. The first pass reads [R, V];
    the later ones only the tokens of the chosen top digit. No sort.
    """
    rows = values.shape[0]
    bits = values.contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # [R, V] signed, float order
    row_ids = torch.arange(rows, dtype=torch.int32, device=values.device)
    (shift, width), *lower = _RADIX_DIGITS
    n = 1 << width
    bins = (key >> shift) + (row_ids[:, None] * n + (n >> 1))  # [R, V] top digit in [0, n)
    w = weights.double()
    d, above = _pick_digit(bins, w, rows, n, target, torch.zeros_like(target))
    r, c = (bins == (row_ids * n + d)[:, None]).nonzero(as_tuple=True)
    rows_m, keys_m, w_m = r.to(torch.int32), key[r, c], w[r, c]  # [M] tokens of that digit
    prefix = (d - (n >> 1)).to(torch.int32)  # [R] = key >> shift of the kept tokens
    for i, (shift, width) in enumerate(lower):
        n = 1 << width
        bins = ((keys_m >> shift) & (n - 1)) + rows_m * n  # [M]
        d, above = _pick_digit(bins, w_m, rows, n, target, above)
        prefix = prefix * n + d.to(torch.int32)
        if i + 1 < len(lower):
            keep = (keys_m >> shift) == prefix[rows_m.long()]
            rows_m, keys_m, w_m = rows_m[keep], keys_m[keep], w_m[keep]
    return torch.where(prefix < 0, prefix ^ 0x7FFFFFFF, prefix).view(torch.float32)


def _pick_digit(bins, w, rows: int, n: int, target, above) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram w (f64) over bins (row * n + digit), then per row the highest digit whose
    mass from there up plus `above` [R] reaches target [R]; -> (digit i64[R], the mass above
    that digit f64[R])."""
    mass = torch.bincount(bins.flatten(), w.flatten(), minlength=rows * n).view(rows, n)
    suffix = mass.flip(-1).cumsum(-1).flip(-1) + above[:, None]  # [R, n] mass >= digit
    d = ((suffix >= target[:, None]).sum(dim=-1) - 1).clamp_min(0)
    return d, torch.cat([suffix, above[:, None]], dim=-1).gather(1, (d + 1)[:, None])[:, 0]


def _row_picker(mask: torch.Tensor):
    """(index, take): the rows where mask [R] holds, and a function taking them from a tensor
    of R rows; no copy (index = all, take = identity) when every row is picked."""
    if bool(mask.all()):
        return slice(None), lambda t: t
    index = mask.nonzero().flatten()
    return index, partial(torch.index_select, dim=0, index=index)


def _weights(x: torch.Tensor, inv: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """exp(x / T - row_max) [R, V] in one buffer (a large fresh tensor costs page faults);
    the top token weighs 1."""
    w = x / inv
    return w.sub_(row_max[:, None]).exp_()


def _min_p_threshold(row_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); f32[R]."""
    return torch.where(min_p > 0, row_max + torch.log(min_p.clamp_min(1e-30)), -torch.inf)


def _thresholds(cand, cand_w, total, top_k, top_p, k_on, p_on, *, complete: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept scaled logit per row (top-k, then top-p over the renormalized top-k set)
    from the C largest scaled logits `cand` [R, C] (descending) and their weights, and whether
    they sufficed (the top-k set inside them, the nucleus reached within them). `total` [R]
    is each row's whole weight (needed by rows with top-p and no top-k inside the candidates);
    `complete`: the candidates are the whole row. A top-k threshold tied with the last
    candidate may have tied tokens outside them, so such a row is not resolved either.
    """
    num_cand = cand.shape[1]
    k_fits = k_on & (top_k <= num_cand)
    k_idx = (top_k - 1).clamp(0, num_cand - 1)
    top_k_thr = torch.where(k_fits, cand.gather(1, k_idx[:, None])[:, 0], -torch.inf)
    cum = torch.where(cand >= top_k_thr[:, None], cand_w, 0.0).cumsum(dim=-1)  # [R, C]
    mass = cum[:, -1] if total is None else torch.where(k_fits, cum[:, -1], total)
    reached = cum >= (top_p * mass)[:, None]
    found = reached.any(dim=-1)
    first = reached.int().argmax(dim=-1)
    top_p_thr = torch.where(p_on & found, cand.gather(1, first[:, None])[:, 0], -torch.inf)
    last = cand[:, -1]
    k_whole = k_fits & (complete | (top_k_thr > last) | torch.isneginf(last))
    ok = (~k_on | k_whole) & (~p_on | found)
    return torch.maximum(top_k_thr, top_p_thr), ok


def _draw_candidates(cand, cand_w, cand_idx, thr, u, fixed: bool = False) -> torch.Tensor:
    """The draw of `_draw` over the kept candidates only (every kept token is one); i64[R]."""
    idx, order = cand_idx.sort(dim=-1)  # [R, C] vocabulary order
    kept = torch.where(cand >= thr[:, None], cand_w, 0.0).gather(1, order)
    return idx.gather(1, _draw(kept, u, fixed)[:, None])[:, 0]


def _draw(kept: torch.Tensor, u: torch.Tensor, fixed: bool = False) -> torch.Tensor:
    """Inverse-CDF draw over kept weights [R, N] (>= 0, a positive sum per row): the first
    position whose running sum exceeds u * total (a token of positive weight), or, when
    rounding puts u * total at the total, the last token of positive weight; i64[R].
    `fixed`: the same without a host synchronisation (the last kept token of every row)."""
    cum = kept.cumsum(dim=-1)
    target = u * cum[:, -1]
    idx = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    iota = torch.arange(kept.shape[1], device=kept.device)
    if fixed:
        return torch.where(idx >= kept.shape[1],
                           torch.where(kept > 0, iota, 0).max(dim=-1).values, idx)
    over = (idx >= kept.shape[1]).nonzero().flatten()
    if over.numel():
        idx[over] = torch.where(kept[over] > 0, iota, 0).max(dim=-1).values
    return idx
