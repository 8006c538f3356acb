"""The fused CPU attention (`torch-cpu-fused`) against a float64 reference and against
`torch-sdpa`: ragged, paged (scattered pages, contexts ending mid-page), shared-prefix decode
batches, GQA, sliding windows and soft-cap, float32 and bfloat16, float32 queries over
bfloat16 pools (`--kv-cache-dtype bfloat16` of a float32 model) and either over fp8 e5m2 pools
(`--kv-cache-dtype fp8_e5m2`) and int8 head rows with their scales (`--kv-cache-dtype int8`,
against the reference of the dequantized K/V and the int8 queries the kernel multiplies them
by); then the registry's `auto`
choice and its fallback, and greedy parity of two runners on a tiny model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import checkpoints as ck
import numpy as np
import pytest
import torch

from sgl_tpu.backends.torch import paged_attention as sdpa
from sgl_tpu.backends.torch.attention import products
from sgl_tpu.backends.torch.kernels import cpu_extension
from sgl_tpu.backends.torch.kv_pool import dequantize_int8, quantize_int8
from sgl_tpu.backends.torch.runner import TorchModelRunner
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.attention_registry import get_attention_backend, resolve_attention_backend
from sgl_tpu.executor.registry import create_model_runner, runner_config
from sgl_tpu.executor.step import ForwardMode, SeqStep, build_host_batch
from sgl_tpu.loader import load_model
from sgl_tpu.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_extension.load() is None,
                                reason=f"not built: {cpu_extension.why_unavailable()}")

PS, KVH, G = 4, 2, 3  # page size, KV heads, query heads per KV head
GREEDY = SamplingParams(temperature=0.0)
# max abs error against the float64 reference, per dtype (outputs are rounded to the dtype)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (query / output dtype, pool dtype): the kernel's combinations. Narrower pools have the query
# dtype's tolerance against the reference of the same rounded K/V
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e5m2),
          (torch.bfloat16, torch.float8_e5m2), (torch.float32, torch.int8),
          (torch.bfloat16, torch.int8)]
DTYPE_IDS = ["float32", "bfloat16", "f32q-bf16kv", "f32q-fp8kv", "bf16q-fp8kv", "f32q-int8kv",
             "bf16q-int8kv"]


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V values [slots, kvh, d] as a pool of `dtype` (int8: quantized head rows)."""
    return quantize_int8(x) if dtype == torch.int8 else x.to(dtype)


def widened(rows: torch.Tensor) -> torch.Tensor:
    """Pool rows as float64 (int8 head rows dequantized)."""
    return dequantize_int8(rows, torch.float64) if rows.dtype == torch.int8 else rows.double()


# torch-cpu-fused multiplies in float32; -bf16 in bfloat16 pairs over a bfloat16 pool where
# the build has AVX512-BF16 (queries and probabilities rounded)
BACKENDS = ["torch-cpu-fused", "torch-cpu-fused-bf16"]


def fused(name: str = "torch-cpu-fused"):
    return get_attention_backend(name)


# float32 outputs over an int8 pool where the build multiplies integers (`q8_dots`, AVX512-
# VNNI): decode's all-heads items take each probability times its V row's scale as a 16-bit
# integer (int8_probabilities_bound); what these tests' random K/V then show, well within it
TOL_INT8_POOL = 1e-4


def int8_probabilities_bound(v_pool: torch.Tensor) -> float:
    """The most a decode output over int8 V rows moves with its probabilities rounded to 16 bits
    (each within 2^-16 of the largest of its chunk of 256 keys, whose sum is at least 1): 2^-8
    of the largest |V|, as for bfloat16 probabilities."""
    return float(widened(v_pool).abs().max()) * 2.0 ** -8


def q8_dots() -> bool:
    return bool(getattr(cpu_extension.load(), "q8_dots", False))


def tol(name: str, dtype: torch.dtype, pool_dtype: torch.dtype) -> float:
    """The output's tolerance: the query dtype's, or bfloat16's where products are bfloat16,
    or TOL_INT8_POOL for float32 over an int8 pool."""
    pool = "bfloat16" if pool_dtype == torch.bfloat16 else "other"
    if products(name, pool) == "bfloat16":
        return TOL[torch.bfloat16]
    int8_products = pool_dtype == torch.int8 and dtype == torch.float32 and q8_dots()
    return TOL_INT8_POOL if int8_products else TOL[dtype]


class Pool:
    """Random K/V pools with pages handed out in a scattered order (page 0 reserved)."""

    def __init__(self, d: int, dtype: torch.dtype, num_pages: int = 96, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.k = to_pool(torch.randn(num_pages * PS, KVH, d, generator=g), dtype)
        self.v = to_pool(torch.randn(num_pages * PS, KVH, d, generator=g), dtype)
        self.free = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()

    def pages(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // PS)
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out, np.int64)


def int8_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel multiplies an int8 pool's keys by: each scaled query row q * scale as
    int8 values (ties to even) times their scale max |x| / 127, in float32; as float64."""
    x = q.float() * scale
    qs = x.abs().amax(-1, keepdim=True) / 127
    qi = torch.where(qs > 0, x / qs, 0.0).round().clamp(-127, 127)
    return qi.double() * qs.double()


def reference(q, pool, slots, q_pos, scale, window=None, cap=None, group=G) -> torch.Tensor:
    """float64 attention of queries q [n, H, d] at positions q_pos over the keys in `slots`
    (key j at position j); over an int8 pool, of the int8 queries the kernel takes."""
    if pool.k.dtype == torch.int8:
        q, scale = int8_queries(q, scale), 1.0
    k = widened(pool.k[slots]).repeat_interleave(group, dim=1)  # [L, H, d]
    v = widened(pool.v[slots]).repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    k_pos = torch.arange(len(slots))[None, :]
    ok = k_pos <= q_pos[:, None]
    if window is not None:
        ok &= k_pos > q_pos[:, None] - window
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


VARIANTS = [dict(), dict(sliding_window=7), dict(logit_cap=3.0),
            dict(sliding_window=5, logit_cap=3.0)]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=["plain", "window", "softcap", "both"])
def test_extend_matches_reference_on_a_ragged_paged_batch(name, dtypes, variant):
    d, scale = 32, 32 ** -0.5
    dtype, pool_dtype = dtypes
    pool = Pool(d, pool_dtype)
    # (prefix_len, num_new): fresh, cached prefix ending mid-page, one token on a long prefix,
    # more new tokens than one query block (120 / G tokens with AVX2, 128 / G elsewhere)
    shapes = [(0, 37), (13, 5), (40, 1), (6, 90)]
    seqs, start = [], 0
    for prefix, new in shapes:
        pages = pool.pages(prefix + new)
        seqs.append(sdpa.ExtendSeq(start=start, num_new=new, prefix_len=prefix,
                                   slots=sdpa.context_slots(pages, PS, prefix + new)))
        start += new
    q = torch.randn(start + 3, KVH * G, d).to(dtype)  # 3 padding rows
    out = fused(name).extend_attention(q, pool.k, pool.v, seqs, scale, **variant)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out[start:] == 0).all()
    for s in seqs:
        pos = torch.arange(s.prefix_len, s.prefix_len + s.num_new)
        want = reference(q[s.start : s.start + s.num_new], pool, s.slots, pos, scale,
                         variant.get("sliding_window"), variant.get("logit_cap"))
        got = out[s.start : s.start + s.num_new].double()
        assert (got - want).abs().max() < tol(name, dtype, pool_dtype)
    if pool_dtype != dtype:
        return
    # and the gathered-SDPA backend agrees with both
    base = sdpa.extend_attention(q, pool.k, pool.v, seqs, scale, **variant)
    assert (out.double() - base.double()).abs().max() < 2 * tol(name, dtype, pool_dtype)


@pytest.mark.parametrize("group,d,window", [(1, 16, None), (4, 48, 40), (7, 32, 19)],
                         ids=["mha", "g4-window", "g7-window"])
def test_extend_register_tile_edges(group, d, window):
    """Row counts per item that fill the kernel's register tiles (3 vectors of 8 or 16 rows)
    partly or exactly (G = 1: 128 rows; 4: 128; 7: 126 and a remainder), context lengths off
    the 4-key and 16-key tiles, and a window whose edge crosses key tiles, so that a row tile
    sees some tiles whole, some in part and some not at all (skipped) in one item."""
    kvh, scale = 2, d ** -0.5
    g = torch.Generator().manual_seed(group)
    num_pages = 120
    pool = SimpleNamespace(k=torch.randn(num_pages * PS, kvh, d, generator=g),
                           v=torch.randn(num_pages * PS, kvh, d, generator=g))
    free = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
    seqs, start = [], 0
    for prefix, new in [(0, 133), (101, 70), (5, 3)]:
        n_pages = -(-(prefix + new) // PS)
        pages, free = np.asarray(free[:n_pages], np.int64), free[n_pages:]
        seqs.append(sdpa.ExtendSeq(start=start, num_new=new, prefix_len=prefix,
                                   slots=sdpa.context_slots(pages, PS, prefix + new)))
        start += new
    q = torch.randn(start, kvh * group, d, generator=g)
    out = fused().extend_attention(q, pool.k, pool.v, seqs, scale, sliding_window=window)
    for s in seqs:
        pos = torch.arange(s.prefix_len, s.prefix_len + s.num_new)
        want = reference(q[s.start : s.start + s.num_new], pool, s.slots, pos, scale, window,
                         group=group)
        assert (out[s.start : s.start + s.num_new].double() - want).abs().max() < TOL[q.dtype]


def decode_batch(steps: list[SeqStep], num_rows: int, window: int | None,
                 dtype: torch.dtype):
    """The runner's own DECODE description (shared-prefix split, own slots, bias)."""
    fake = SimpleNamespace(config=SimpleNamespace(page_size=PS),
                           model_config=SimpleNamespace(sliding_window=window),
                           attn=fused(), device=torch.device("cpu"), dtype=dtype)
    host = build_host_batch(ForwardMode.DECODE, steps, num_tokens=num_rows,
                            num_seqs=len(steps), page_size=PS, max_pages=1 << 16,
                            num_mask_words=1, trim_pages=True)
    return TorchModelRunner._decode_batch(fake, host)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ["shared", "model_window", *["window", "softcap"]])
def test_decode_matches_reference_with_a_shared_prefix(name, dtypes, case):
    """Forks of one prefix (its pages read once for the whole batch) plus an unrelated
    sequence; contexts ending mid-page and on a page boundary; one padding row."""
    d, scale = 64, 0.125
    dtype, pool_dtype = dtypes
    pool = Pool(d, pool_dtype, num_pages=160, seed=1)
    window = 6 if case == "window" else None
    model_window = 9 if case == "model_window" else None  # Mistral: in the bias, no shared
    cap = 2.5 if case == "softcap" else None
    prefix = pool.pages(300)  # 75 whole pages, longer than one kernel chunk of 256 keys
    lens = [300 + 1, 300 + 17, 300 + 40]
    tables = [np.concatenate([prefix, pool.pages(n - 300)]) for n in lens]
    # the first row's cache is not a fork: it breaks the shared prefix unless case == shared
    steps = [SeqStep(token_ids=[0], prefix_len=n - 1, pages=t, sampling=GREEDY, seed=0,
                     num_output_tokens=1) for n, t in zip(lens, tables, strict=True)]
    if case != "shared":
        solo = pool.pages(23)
        steps.append(SeqStep(token_ids=[0], prefix_len=22, pages=solo, sampling=GREEDY,
                             seed=0, num_output_tokens=1))
    batch = decode_batch(steps, len(steps) + 1, model_window, dtype)
    if case == "shared":  # whole chunks of the 300-key prefix: batch-invariant rows
        assert batch.shared_slots.shape[0] == sdpa.DECODE_CHUNK_KEYS
    q = torch.randn(len(steps) + 1, KVH * G, d).to(dtype)
    out = fused(name).decode_attention(q, pool.k, pool.v, batch, scale, sliding_window=window,
                                       logit_cap=cap)
    for i, st in enumerate(steps):
        n = st.prefix_len + 1
        slots = sdpa.context_slots(st.pages, PS, n)
        want = reference(q[i : i + 1], pool, slots, torch.tensor([n - 1]), scale,
                         window or model_window, cap)
        assert (out[i : i + 1].double() - want).abs().max() < tol(name, dtype, pool_dtype)
    if pool_dtype != dtype:
        return
    base = sdpa.decode_attention(q, pool.k, pool.v, batch, scale, sliding_window=window,
                                 logit_cap=cap)
    assert (out.double() - base.double()).abs().max() < 2 * tol(name, dtype, pool_dtype)


@pytest.mark.parametrize("kvh,group,d,window,cap,pool_dtype", [
    (3, 1, 16, None, None, torch.float32), (2, 2, 48, 37, None, torch.float32),
    (3, 3, 64, None, 2.5, torch.bfloat16), (1, 4, 80, 200, None, torch.float32),
    (2, 5, 32, None, None, torch.float32), (40, 4, 16, None, None, torch.float32),
    (3, 3, 64, 200, None, torch.float8_e5m2), (2, 6, 32, None, None, torch.float8_e5m2),
    (3, 3, 64, 200, None, torch.int8), (2, 6, 32, None, None, torch.int8)],
    ids=["mha", "g2-d48-window", "g3-softcap-bf16kv", "g4-d80-window", "g5-per-head",
         "160-heads-per-head", "g3-window-fp8kv", "g6-per-head-fp8kv", "g3-window-int8kv",
         "g6-per-head-int8kv"])
def test_decode_own_keys_over_group_sizes(kvh, group, d, window, cap, pool_dtype):
    """Decode rows over their own keys only (no shared prefix): GQA groups of 1 to 4 rows take
    the all-heads items (keys in vector lanes; chunks of 128 keys, tails off the 8-key folds
    and the 16-key P @ V blocks, head dims off the 4-vector column blocks), a window moving
    the first chunk's start, soft-cap; groups of 5 and more than 128 query heads take the
    per-head items. Contexts of 1, 9, 130 and 301 keys on scattered pages."""
    scale = d ** -0.5
    g = torch.Generator().manual_seed(kvh * 10 + group)
    num_pages = 130
    pool = SimpleNamespace(k=to_pool(torch.randn(num_pages * PS, kvh, d, generator=g), pool_dtype),
                           v=to_pool(torch.randn(num_pages * PS, kvh, d, generator=g), pool_dtype))
    free = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
    steps = []
    for n in (1, 9, 130, 301):
        pages, free = np.asarray(free[: -(-n // PS)], np.int64), free[-(-n // PS):]
        steps.append(SeqStep(token_ids=[0], prefix_len=n - 1, pages=pages, sampling=GREEDY,
                             seed=0, num_output_tokens=1))
    # the batch's own description; the window is the kernel's (Gemma's local layers), so the
    # keys before it are in the bias and the kernel skips them
    batch = decode_batch(steps, len(steps), None, torch.float32)
    q = torch.randn(len(steps), kvh * group, d, generator=g)
    out = fused().decode_attention(q, pool.k, pool.v, batch, scale, sliding_window=window,
                                   logit_cap=cap)
    for i, st in enumerate(steps):
        n = st.prefix_len + 1
        want = reference(q[i : i + 1], pool, sdpa.context_slots(st.pages, PS, n),
                         torch.tensor([n - 1]), scale, window, cap, group=group)
        err = (out[i : i + 1].double() - want).abs().max()
        assert err < tol("torch-cpu-fused", torch.float32, pool_dtype)


@pytest.mark.parametrize("window", [None, 30])
def test_decode_many_rows_share_a_prefix(window):
    """13 forks of one prefix: 13 sequences' rows per shared-prefix item (all-heads items:
    one holds at most 14 sequences' 6 heads), or, under a window, 39 query rows per per-head
    item (register tiles of 3 vectors plus a remainder); own contexts of 5 to 29 tokens, the
    window leaving some rows' view of a shared key tile whole, partial or empty."""
    d, scale = 32, 32 ** -0.5
    pool = Pool(d, torch.float32, num_pages=200, seed=2)
    prefix = pool.pages(260)  # 65 whole pages: 256 keys shared, whole chunks
    lens = [260 + n for n in range(1, 26, 2)]
    steps = [SeqStep(token_ids=[0], prefix_len=n - 1,
                     pages=np.concatenate([prefix, pool.pages(n - 260)]), sampling=GREEDY,
                     seed=0, num_output_tokens=1) for n in lens]
    batch = decode_batch(steps, len(steps), None, torch.float32)
    assert batch.shared_slots.shape[0] == sdpa.DECODE_CHUNK_KEYS
    q = torch.randn(len(steps), KVH * G, d)
    out = fused().decode_attention(q, pool.k, pool.v, batch, scale, sliding_window=window)
    for i, st in enumerate(steps):
        n = st.prefix_len + 1
        want = reference(q[i : i + 1], pool, sdpa.context_slots(st.pages, PS, n),
                         torch.tensor([n - 1]), scale, window)
        assert (out[i : i + 1].double() - want).abs().max() < TOL[torch.float32]


def pool_of_16_slot_pages(num_pages: int, kvh: int, d: int, dtype: torch.dtype,
                          g: torch.Generator):
    """Random K/V pools on pages of 16 slots (the server's default page size), and a function
    that returns the slots of n new keys on pages taken in a scattered order (page 0 kept)."""
    page = 16
    pool = SimpleNamespace(k=to_pool(torch.randn(num_pages * page, kvh, d, generator=g), dtype),
                           v=to_pool(torch.randn(num_pages * page, kvh, d, generator=g), dtype))
    free = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()

    def slots_on_new_pages(n: int) -> torch.Tensor:
        pages = [free.pop() for _ in range(-(-n // page))]
        return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])[:n]

    return pool, slots_on_new_pages


@pytest.mark.parametrize("dots", [True, False], ids=["dots", "f32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window,cap", [(None, None), (100, None), (None, 2.5)],
                         ids=["plain", "window", "softcap"])
def test_decode_shared_prefix_on_pages_of_16(dtype, window, cap, dots):
    """The kernel's decode call over a shared prefix on pages of 16 slots (a key tile's rows
    consecutive in the pool, as the server's default page size lays them out) ending
    mid-page; 7 forks x 3 group heads = 21 rows per shared item, own tails of 1 to 37 keys,
    a window that hides part of the prefix, soft-cap."""
    d, scale, kvh, group = 64, 0.125, 2, 3
    g = torch.Generator().manual_seed(5)
    pool, slots_on_new_pages = pool_of_16_slot_pages(64, kvh, d, dtype, g)
    shared = slots_on_new_pages(327)
    own_lens = [1, 6, 11, 16, 17, 30, 37]
    own = torch.zeros(len(own_lens), max(own_lens), dtype=torch.int64)
    for b, n in enumerate(own_lens):
        own[b, :n] = slots_on_new_pages(n)
    q = torch.randn(len(own_lens), kvh * group, d, generator=g).to(dtype)
    out = cpu_extension.load().decode(
        q, pool.k, pool.v, shared, own, torch.zeros(len(own_lens), dtype=torch.int64),
        torch.tensor(own_lens), scale, window or 0, cap or 0.0, dots)
    name = BACKENDS[1 if dots else 0]
    for b, n in enumerate(own_lens):
        slots = torch.cat([shared, own[b, :n]])
        want = reference(q[b : b + 1], pool, slots, torch.tensor([len(slots) - 1]), scale,
                         window, cap, group=group)
        assert (out[b : b + 1].double() - want).abs().max() < tol(name, dtype, dtype)


@pytest.mark.parametrize("dots", [True, False], ids=["dots", "f32"])
@pytest.mark.parametrize("pool_dtype",
                         [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int8],
                         ids=["float32", "bf16kv", "fp8kv", "int8kv"])
@pytest.mark.parametrize("kvh,group,d,window,cap", [
    (3, 3, 64, None, None), (2, 3, 64, 20, None), (3, 3, 64, None, 2.5), (1, 8, 64, 300, None),
    (4, 1, 64, None, None), (1, 4, 64, None, None), (2, 3, 80, None, None)],
    ids=["g3", "g3-window", "g3-softcap", "g8-window", "mha", "g4-one-kv-head", "g3-d80"])
def test_decode_verify_rows_share_their_own_keys(kvh, group, d, window, cap, pool_dtype, dots):
    """Speculative verify rows (a request's rows, each reading its predecessor's own keys plus
    one more) read their keys once per request: runs of 5 and 50 rows (all-heads items, or
    per-head row tiles for the long run, split where an item would pass 128 rows), a lone
    row, a row whose keys start where the run's do and reach further but lie on other pages
    (not a member), all after a shared prefix; every row matches the float64 reference of
    its own context. Head dims of 64 and 80 (a partial block of dim pairs, a single-vector
    column tail), one KV head and several."""
    scale = 0.125
    g = torch.Generator().manual_seed(kvh * 100 + group)
    pool, slots_on_new_pages = pool_of_16_slot_pages(160, kvh, d, pool_dtype, g)
    shared = slots_on_new_pages(40)
    rows = []  # own slots of each row
    for base, n in [(300, 5), (5, 1), (12, 50), (70, 1)]:
        keys = slots_on_new_pages(base + n - 1)
        rows += [keys[: base + j] for j in range(n)]
    own = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
    for b, r in enumerate(rows):
        own[b, : len(r)] = r
    # queries bfloat16 can hold (the scale is a power of two): rounded products differ from
    # float32 ones by the probabilities' rounding only
    q = torch.randn(len(rows), kvh * group, d, generator=g).bfloat16().float()
    out = cpu_extension.load().decode(
        q, pool.k, pool.v, shared, own, torch.zeros(len(rows), dtype=torch.int64),
        torch.tensor([len(r) for r in rows]), scale, window or 0, cap or 0.0, dots)
    dots_taken = dots and pool_dtype == torch.bfloat16 and cpu_extension.load().bf16_dots
    bound = float(pool.v.abs().max().float()) * 2.0 ** -8 if dots_taken else TOL[torch.float32]
    if pool_dtype == torch.int8 and q8_dots():
        bound = int8_probabilities_bound(pool.v)
    for b, r in enumerate(rows):
        slots = torch.cat([shared, r])
        want = reference(q[b : b + 1], pool, slots, torch.tensor([len(slots) - 1]), scale,
                         window, cap, group=group)
        assert (out[b : b + 1].double() - want).abs().max() < bound, b


@pytest.mark.skipif(not getattr(cpu_extension.load(), "bf16_dots", False),
                    reason="this build has no AVX512-BF16: bfloat16 products are not built")
def test_bfloat16_products_round_only_queries_and_probabilities():
    """Over a bfloat16 pool, torch-cpu-fused-bf16's row-tiled items (EXTEND; DECODE over a shared
    prefix) multiply bfloat16 pairs: against the float64 reference of the queries rounded to
    bfloat16, what remains is the probabilities' rounding, at most 2^-8 of the largest |V|;
    and the results are not float32 products' (the path is taken)."""
    d, scale = 64, 0.125  # a power of two: the kernel's rounded q * scale is q rounded, scaled
    pool = Pool(d, torch.bfloat16, num_pages=160, seed=3)
    bound = float(pool.v.abs().max()) * 2.0 ** -8
    seqs, start = [], 0
    for prefix, new in [(0, 70), (150, 33)]:
        seqs.append(sdpa.ExtendSeq(start=start, num_new=new, prefix_len=prefix,
                                   slots=sdpa.context_slots(pool.pages(prefix + new), PS,
                                                            prefix + new)))
        start += new
    q = torch.randn(start, KVH * G, d)
    out = fused("torch-cpu-fused-bf16").extend_attention(q, pool.k, pool.v, seqs, scale)
    f32 = fused().extend_attention(q, pool.k, pool.v, seqs, scale)
    assert not torch.equal(out, f32)
    for s in seqs:
        rows = slice(s.start, s.start + s.num_new)
        pos = torch.arange(s.prefix_len, s.prefix_len + s.num_new)
        want = reference(q[rows].bfloat16(), pool, s.slots, pos, scale)
        assert (out[rows].double() - want).abs().max() < bound
        assert (f32[rows].double() - reference(q[rows], pool, s.slots, pos, scale)
                ).abs().max() < TOL[torch.float32]
    prefix = pool.pages(200)
    steps = [SeqStep(token_ids=[0], prefix_len=200 + n - 1,
                     pages=np.concatenate([prefix, pool.pages(n)]), sampling=GREEDY, seed=0,
                     num_output_tokens=1) for n in (3, 11, 20)]
    batch = decode_batch(steps, len(steps), None, torch.float32)
    q = torch.randn(len(steps), KVH * G, d)
    out = fused("torch-cpu-fused-bf16").decode_attention(q, pool.k, pool.v, batch, scale)
    assert not torch.equal(out, fused().decode_attention(q, pool.k, pool.v, batch, scale))
    for i, st in enumerate(steps):
        n = st.prefix_len + 1
        want = reference(q[i : i + 1].bfloat16(), pool, sdpa.context_slots(st.pages, PS, n),
                         torch.tensor([n - 1]), scale)
        assert (out[i : i + 1].double() - want).abs().max() < bound


@pytest.mark.parametrize("dots", [True, False], ids=["dots", "f32"])
def test_a_query_gets_the_same_attention_on_every_path(dots):
    """Queries over one context by three paths: a DECODE row whose keys are all its own (keys
    in vector lanes), a DECODE row whose context is a shared prefix (row-tiled items) plus own
    keys, and the last row of an EXTEND. With bfloat16 products every path takes each score
    as the same chain of pair products, and a base-2 softmax with whole maxima gives a key's
    probability the same significand whatever max it was taken against, so every probability
    rounds to bfloat16 alike and the paths differ by float32 summation order only, as float32
    products do. (A probability rounded differently on two paths moves an output by about
    1e-3 of |V|: over 48 queries some would.)"""
    ext = cpu_extension.load()
    kvh, group, d, n, split = 3, 3, 64, 700, 512
    g = torch.Generator().manual_seed(11)
    k = torch.randn(2048, kvh, d, generator=g).bfloat16()
    v = torch.randn(2048, kvh, d, generator=g).bfloat16()
    slots = torch.randperm(2048, generator=g)[:n].contiguous()
    scale, zero = d ** -0.5, torch.zeros(1, dtype=torch.int64)
    own = slots[split:].repeat(2, 1)  # two rows share the prefix; the second sees one own key
    worst = 0.0
    for _ in range(48):
        q = 3 * torch.randn(1, kvh * group, d, generator=g)
        own_only = ext.decode(q, k, v, torch.zeros(0, dtype=torch.int64), slots[None].clone(),
                              zero, torch.tensor([n]), scale, 0, 0.0, dots)
        shared = ext.decode(q.repeat(2, 1, 1), k, v, slots[:split].contiguous(), own,
                            torch.zeros(2, dtype=torch.int64), torch.tensor([n - split, 1]),
                            scale, 0, 0.0, dots)[:1]
        qe = torch.cat([torch.randn(4, kvh * group, d, generator=g), q])
        extend = ext.extend(qe, k, v, [slots], [0], [5], [n - 5], scale, 0, 0.0, dots)[-1:]
        # a shared prefix of whole chunks (512 keys): the same bits as a row of own keys
        assert torch.equal(own_only, shared)
        for a, b in [(own_only, extend), (shared, extend)]:
            worst = max(worst, float((a - b).abs().max()))
    assert worst < 2e-5
    if dots and ext.bf16_dots:  # the bfloat16 path is the one taken
        f32 = ext.extend(qe, k, v, [slots], [0], [5], [n - 5], scale, 0, 0.0, False)[-1:]
        assert (f32 - extend).abs().max() > 1e-4


def test_refuses_mixed_dtypes_other_than_float32_over_bfloat16():
    ext = cpu_extension.load()
    q32, pool32 = torch.zeros(1, 2, 16), torch.zeros(8, 1, 16)
    slots = [torch.arange(1, dtype=torch.int64)]
    for q, k, v in [(q32.bfloat16(), pool32, pool32), (q32, pool32.bfloat16(), pool32),
                    (q32.half(), pool32.half(), pool32.half())]:
        with pytest.raises(RuntimeError, match="paged_attention_cpu: (the pools|q must)"):
            ext.extend(q, k, v, slots, [0], [1], [0], 1.0, 0, 0.0, True)


def test_auto_picks_fused_on_cpu_and_falls_back_when_missing(monkeypatch, caplog):
    bf16 = cpu_extension.load().bf16_dots  # an AVX512-BF16 build: bfloat16 products
    want = "torch-cpu-fused-bf16" if bf16 else "torch-cpu-fused"
    assert resolve_attention_backend("auto", "torch", "cpu") == want
    assert resolve_attention_backend("auto", "torch", "cuda") == "torch-sdpa"
    monkeypatch.setattr(cpu_extension, "_load", lambda: (None, "not built (test)"))
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend("auto", "torch", "cpu") == "torch-sdpa"
    assert "not built (test)" in caplog.text
    with pytest.raises(ValueError, match="torch-cpu-fused.*not built"):
        resolve_attention_backend("torch-cpu-fused", "torch", "cpu")
    with pytest.raises(ValueError, match="CPU"):
        resolve_attention_backend("torch-cpu-fused", "torch", "cuda")


def test_runner_greedy_parity_with_sdpa(tmp_path):
    """Two float32 torch runners of one tiny model, `torch-sdpa` and `torch-cpu-fused`: the
    same logits on a ragged EXTEND batch over a cached prefix and the same greedy tokens over
    decode steps of a batch whose forks share prefix pages (bfloat16: the kernel tests)."""
    loaded = load_model(ck.make_tiny_hf_checkpoint(tmp_path / "m", "llama"))
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (41, 9, 26)]
    runs = {}
    for attn in ("torch-sdpa", "torch-cpu-fused"):
        args = ServerArgs(skip_warmup=True, backend="torch", torch_compile="off", dtype="float32",
                          attention_backend=attn, page_size=PS, max_total_tokens=1024,
                          max_running_requests=8)
        runner = create_model_runner(loaded.config, loaded.params, runner_config(args, 1024))
        assert runner.config.attention_backend == attn
        info = runner.compute_info()  # float32 pools: float32 products on either
        assert info["attention"] == attn and info["attention_products"] == "float32"
        # prompt 0's first 40 tokens are cached (10 pages), then forked three ways: every
        # decode row shares those pages
        shared = np.arange(1, 11)
        tables = [np.concatenate([shared, own]) for own in
                  (np.arange(11, 16), np.arange(16, 21), np.arange(21, 30))]
        mk = lambda ids, prefix, pages: SeqStep(  # noqa: E731
            token_ids=ids, prefix_len=prefix, pages=pages, sampling=GREEDY, seed=0,
            num_output_tokens=0)
        runner.forward(ForwardMode.EXTEND, [mk(prompts[0][:40], 0, tables[0])])
        res = runner.forward(ForwardMode.EXTEND, [
            mk(prompts[0][40:], 40, tables[0]), mk(prompts[1], 40, tables[1]),
            mk(prompts[2], 40, tables[2])])
        logits = runner.row_logits(res.hidden, np.arange(res.hidden.shape[0]))
        tokens, lens = [list(res.token_ids)], [41, 49, 66]
        for _ in range(6):
            res = runner.forward(ForwardMode.DECODE, [
                mk([int(t)], n, tb) for t, n, tb in zip(tokens[-1], lens, tables, strict=True)])
            tokens.append(list(res.token_ids))
            lens = [n + 1 for n in lens]
        runs[attn] = (logits, tokens)
    (l_sdpa, t_sdpa), (l_fused, t_fused) = runs["torch-sdpa"], runs["torch-cpu-fused"]
    np.testing.assert_allclose(l_fused, l_sdpa, atol=1e-4)
    assert t_fused == t_sdpa


@pytest.mark.isa_invariance
@pytest.mark.parametrize("dots", [True, False], ids=["dots", "f32"])
@pytest.mark.parametrize("pool_dtype",
                         [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int8],
                         ids=["float32", "bf16kv", "fp8kv", "int8kv"])
@pytest.mark.parametrize("kvh,group", [(3, 3), (1, 4), (2, 8)], ids=["g3", "g4", "g8"])
def test_decode_rows_are_batch_invariant(kvh, group, pool_dtype, dots):
    """A decode row's output has the same bits whatever rows share its step: alone (every key
    its own), as one of a speculative verify's rows (5, and 20: more than one all-heads item
    holds), beside other requests, and with a shared prefix of whole chunks
    (`DECODE_CHUNK_KEYS`, as the runner cuts it). This is what makes drafts lossless: a
    verify row computes the token a one-row decode computes."""
    ext = cpu_extension.load()
    assert ext.decode_chunk_keys == sdpa.DECODE_CHUNK_KEYS
    d, scale = 64, 0.125
    g = torch.Generator().manual_seed(kvh * 10 + group)
    pool, slots_on_new_pages = pool_of_16_slot_pages(200, kvh, d, pool_dtype, g)
    prefix = slots_on_new_pages(2 * sdpa.DECODE_CHUNK_KEYS)  # every request's system prompt
    contexts = []  # each row's whole context
    for tail, num_rows in [(300, 5), (7, 1), (40, 20), (150, 1)]:
        keys = torch.cat([prefix, slots_on_new_pages(tail + num_rows - 1)])
        contexts += [keys[: len(prefix) + tail + j] for j in range(num_rows)]
    q = torch.randn(len(contexts), kvh * group, d, generator=g).bfloat16().float()
    zero = torch.zeros(1, dtype=torch.int64)
    none = torch.zeros(0, dtype=torch.int64)
    alone = torch.cat([ext.decode(q[b : b + 1], pool.k, pool.v, none, c[None].clone(), zero,
                                  torch.tensor([len(c)]), scale, 0, 0.0, dots)
                       for b, c in enumerate(contexts)])

    def batched(shared_len: int) -> torch.Tensor:
        own = torch.zeros(len(contexts), max(len(c) for c in contexts) - shared_len,
                          dtype=torch.int64)
        for b, c in enumerate(contexts):
            own[b, : len(c) - shared_len] = c[shared_len:]
        return ext.decode(q, pool.k, pool.v, prefix[:shared_len].contiguous(), own,
                          torch.zeros(len(contexts), dtype=torch.int64),
                          torch.tensor([len(c) - shared_len for c in contexts]), scale, 0,
                          0.0, dots)

    for shared_len in (0, sdpa.DECODE_CHUNK_KEYS, 2 * sdpa.DECODE_CHUNK_KEYS):
        out = batched(shared_len)
        for b in range(len(contexts)):
            assert torch.equal(out[b], alone[b]), (shared_len, b)


@pytest.mark.isa_invariance
def test_int8_verify_rows_over_v_rows_of_varied_scales():
    """An int8 pool at the default model's shapes (3 KV heads of 64, groups of 3) whose V rows
    span three decades of magnitude: each V row's scale is folded into its probabilities, which
    the all-heads decode items take as 16-bit integers where the build multiplies integers
    (`q8_dots`). A speculative verify's 5 rows after a shared prefix of three whole chunks give
    the bits of one-row decodes, and each is within the 16-bit probabilities' bound of the
    float64 reference (float32 products' tolerance without them)."""
    ext = cpu_extension.load()
    kvh, group, d, scale, num_rows = 3, 3, 64, 0.125, 5
    g = torch.Generator().manual_seed(8)
    num_pages = 60  # of 16 slots
    magnitude = 10.0 ** (3 * torch.rand(num_pages * 16, kvh, 1, generator=g) - 2)
    pool = SimpleNamespace(
        k=quantize_int8(torch.randn(num_pages * 16, kvh, d, generator=g)),
        v=quantize_int8(torch.randn(num_pages * 16, kvh, d, generator=g) * magnitude))
    pages = 1 + torch.randperm(num_pages - 1, generator=g)
    slots = (pages[:, None] * 16 + torch.arange(16)).reshape(-1)
    shared_len = 3 * sdpa.DECODE_CHUNK_KEYS
    contexts = [slots[: shared_len + 40 + j] for j in range(num_rows)]  # row j: one key more
    q = torch.randn(num_rows, kvh * group, d, generator=g)
    zero, none = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    alone = torch.cat([ext.decode(q[b : b + 1], pool.k, pool.v, none, c[None].clone(), zero,
                                  torch.tensor([len(c)]), scale, 0, 0.0, False)
                       for b, c in enumerate(contexts)])
    own = torch.stack([contexts[-1][shared_len:]] * num_rows)
    verify = ext.decode(q, pool.k, pool.v, slots[:shared_len].clone(), own,
                        torch.zeros(num_rows, dtype=torch.int64),
                        torch.tensor([len(c) - shared_len for c in contexts]), scale, 0, 0.0,
                        False)
    bound = int8_probabilities_bound(pool.v) if q8_dots() else TOL[torch.float32]
    for b, c in enumerate(contexts):
        assert torch.equal(verify[b], alone[b]), b
        want = reference(q[b : b + 1], pool, c, torch.tensor([len(c) - 1]), scale, group=group)
        assert (alone[b : b + 1].double() - want).abs().max() < bound, b
