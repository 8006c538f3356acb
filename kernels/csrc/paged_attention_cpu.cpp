// Fused paged attention for CPUs: the `torch-cpu-fused` attention backend's compiled half
// (`fused_*` of sgl_tpu/backends/torch/paged_attention.py are the Python half;
// sgl_tpu/backends/torch/kernels/cpu_extension.py builds it).
//
// Pool layout (token-major, as sgl_tpu/backends/torch/paged_attention.py):
//
//     pool [num_slots, kvh, d]      slot = page * page_size + offset
//
// A work item is a set of query rows and a range of key positions. Most items hold one KV
// head h and R query rows (R <= 128) that all read it; they walk their keys in tiles of 16:
// each tile's K/V rows are read from the pool once (by slot, no gather copy; bfloat16
// widened to float32, float32 read in place; the next tile's rows prefetched) and used by
// all R rows, rows in vector lanes:
//
//     Qt [d][R] (queries transposed once per item, pre-scaled), so S[key][rows] = sum_i
//     K[key][i] * Qt[i][rows] and accT[c][rows] += V[key][c] * P[key][rows] need no
//     horizontal sums, and the online softmax (max, rescale, exp, row sums) runs a vector of
//     rows per instruction. Per key tile, one row tile (3 row vectors) at a time runs
//     scores, softmax and P @ V while its slices of Qt, S and accT stay in L1, as 3 x 4
//     register tiles of FMAs; row tiles that see none of the tile's keys (past the causal
//     diagonal, before a window) are skipped, and masks are applied only where some row
//     sees part of the tile.
//
// A decode sequence's own keys with small GQA groups (G <= 4: a group would fill few lanes)
// are items of all its query heads instead, keys in vector lanes (attend_heads, below).
//
//     EXTEND  item = (sequence, kv head, block of query tokens); rows = tokens x GQA group;
//             keys = positions 0 .. last query (causal, sliding window); writes the output.
//     DECODE  item = (kv head, row group, chunk of the shared prefix): rows = every
//             (sequence, group head) of the batch, so shared pages are read once per step;
//             and (verify group, chunk of its own keys): rows = its rows' H query heads
//             (G <= 4), or (verify group, kv head, chunk of its own keys): rows = its rows'
//             GQA groups. A verify group is one row, or a request's speculative verify rows,
//             which read the same own keys one further each (decode_impl). Items write
//             (max, sum, acc) partials, merged per (sequence, head) afterwards.
//
// Accumulation is float32 (scores, softmax, P @ V); products are float32 too, except an int8
// pool's scores (int8 by int8, below) and over a bfloat16 pool in an AVX512-BF16 build when
// the caller asks for bf16_dots: the row-tiled items then multiply bfloat16 pairs
// (`vdpbf16ps`; see "bfloat16 dot products" below), the own-key items take each score as the
// same chain of pair products (heads_scores_dots) and the softmax runs in base 2 with whole
// maxima, so every path gives a key the same score and probability bits (see vexp2_rel).
// q and out (TQ)
// float32 or bfloat16, the pools (TKV) of q's dtype, or bfloat16 under float32 q (a bfloat16 KV
// cache of a float32 model), or fp8 e5m2 under either (`--kv-cache-dtype fp8_e5m2`: a quarter
// of float32's bytes), or int8 head rows under either (`--kv-cache-dtype int8`, Q8 below: d
// int8 values and their bfloat16 scale, pool [num_slots, kvh, d + 2]): the scores then take
// int8 query products (queries quantized per row, exact integer dot products times the two
// scales: "int8 query products" below), the same bits on every path; V rows are widened
// times their scale, except in the decode items of small GQA groups of an AVX512-VNNI build,
// which multiply them as stored by 16-bit integer probabilities ("int8 P @ V" below).
// Written with GCC/Clang vector extensions, one register wide (16 floats with AVX-512, else
// 8): -march=native picks the widest, a portable build gets the baseline ISA's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// int8 query products take `vpdpbusd` (AVX512-VNNI), else float32 FMAs of the integers
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SGL_Q8_DOTS 1
#else
#define SGL_Q8_DOTS 0
#endif

// One vector register of floats: 16 with AVX-512, else 8 (AVX2; narrower ISAs split it).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kTile = 16;         // keys per tile
constexpr int kMaxRows = 128;     // query rows per item
// DECODE keys per item (splits long contexts over threads), on every path alike (batch
// invariance, decode_impl); all-heads items of 256 against 128 keys: 0.90-0.96x the time from
// 1k keys, 1.1-1.2x at 300 (one item per thread fewer)
constexpr int64_t kChunk = 256;
constexpr int kScoreStride = kChunk + kLanes;  // a decode row's scores, whole vectors
constexpr int kNoWindow = 1 << 30;
constexpr int kTileRows = 3;  // row vectors per register tile
constexpr int kTileCols = 4;  // keys (scores) or output dims (P @ V) per register tile

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

// Broadcasts as brace lists (one vbroadcastss): `vf{} + x` costs a scalar add first, since
// 0.0f + x is not x for x = -0.0f.
template <size_t... I>
inline vf splat_lanes(float x, std::index_sequence<I...>) { return vf{((void)I, x)...}; }
template <size_t... I>
inline vi splati_lanes(int32_t x, std::index_sequence<I...>) { return vi{((void)I, x)...}; }
inline vf splat(float x) { return splat_lanes(x, std::make_index_sequence<kLanes>{}); }
inline vi splati(int32_t x) { return splati_lanes(x, std::make_index_sequence<kLanes>{}); }
inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vi loadi(const int32_t* p) { vi v; std::memcpy(&v, p, sizeof v); return v; }

inline vf load16(const float* p) { return loadf(p); }
// bfloat16 -> float32 is a 16-bit shift into the high half: one zero-extending load and one
// shift (the generic vector conversion compiles to 4 shuffles on AVX2).
inline vf load16(const at::BFloat16* p) {
  vf f;
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&f, &u, sizeof f);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&f, &u, sizeof f);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  std::memcpy(&f, &u, sizeof f);
#endif
  return f;
}
// fp8 e5m2 -> float32 (a --kv-cache-dtype fp8_e5m2 pool): e5m2 is the high byte of an IEEE
// half, so the bytes moved into the high half of 16-bit lanes convert exactly with F16C
// (subnormals included).
inline vf load16(const at::Float8_e5m2* p) {
  vf f;
#if defined(__AVX512F__)
  const __m256i h = _mm256_slli_epi16(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  const __m512 x = _mm512_cvtph_ps(h);
  std::memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i h = _mm_slli_epi16(
      _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  const __m256 x = _mm256_cvtph_ps(h);
  std::memcpy(&f, &x, sizeof f);
#else
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
#endif
  return f;
}
// A --kv-cache-dtype int8 pool's element (sgl_tpu/kv_dtypes.py): a head row is d of them and
// then its scale's two bfloat16 bytes, so rows are row_len<Q8>(d) elements apart.
struct Q8 {
  int8_t v;
};
template <typename T>
constexpr int64_t row_len(int64_t d) {
  return std::is_same_v<T, Q8> ? d + 2 : d;
}
inline vf load16(const Q8* p) {  // the int8 values as float32, unscaled
  vf f;
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__)
  const __m256 x = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&f, &x, sizeof f);
#else
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i].v);
#endif
  return f;
}
// the scale of the head row starting at row (d values)
inline float q8_scale(const Q8* row, int64_t d) {
  uint16_t h;
  std::memcpy(&h, row + d, sizeof h);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store16(float* p, vf v) { storef(p, v); }
inline void store16(at::BFloat16* p, vf v) {  // round to nearest even
  vu u;
  std::memcpy(&u, &v, sizeof u);
  u = u + 0x7FFFu + ((u >> 16) & 1u);
  vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// e^r for |r| <= ln(2) / 2: Cephes' expf polynomial (relative error ~2e-7)
inline vf exp_poly(vf r) {
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p;
}

// exp(x), Cephes' expf (exp_poly); x <= -87 gives ~1e-38, not 0: callers zero masked lanes
// themselves.
inline vf vexp(vf x) {
  x = x > 88.0f ? splat(88.0f) : x;
  x = x < -87.0f ? splat(-87.0f) : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf s;
  std::memcpy(&s, &e, sizeof s);
  return exp_poly(r) * s;
}

// Under bfloat16 products (with_dots, below), softmax in base 2 with whole-numbered maxima
// (float32 products keep exp against the running max). Scores are taken to log2 units (times
// log2(e), after the soft-cap; the queries carry the attention scale alone, so rounding them
// to bfloat16 stays exact for a power-of-two scale), and a row's running max m is rounded up
// to a whole number. A probability is then
//
//     2^(t - m) = 2^frac(t) * 2^(floor(t) - m)
//
// whose significand is a function of the score t alone, whatever m the keys before it set: it
// rounds to bfloat16 alike on every path that reaches the key (an EXTEND item, a shared-prefix
// or own-key DECODE item, any chunking), and rescaling a running sum by 2^(m_old - m_new), or
// merging partials, multiplies by an exact power of two.
constexpr float kLog2e = 1.44269504088896341f;

inline vf vfloor(vf x) {  // |x| < 2^22
  const float magic = 12582912.0f;
  const vf r = (x + magic) - magic;  // to nearest
  return r > x ? r - 1.0f : r;
}
inline vf vceil(vf x) { return -vfloor(-x); }

// 2^e for whole e <= 0: 0 below -126 (no subnormals)
inline vf vpow2(vf e) {
  vi bits = (__builtin_convertvector(e, vi) + 127) << 23;
  bits = e < -126.0f ? splati(0) : bits;
  vf out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// 2^f for f in [0, 1): a degree-5 polynomial fitted to the relative error, 1.6e-7 at most in
// float32
inline vf exp2_frac(vf f) {
  vf p = splat(1.8775691e-3f);
  p = p * f + 8.9893341e-3f;
  p = p * f + 5.5826347e-2f;
  p = p * f + 2.4015360e-1f;
  p = p * f + 6.9315308e-1f;
  return p * f + 0.99999994f;
}

// 2^(t - m) for a whole m >= t (module note above): 2^frac(t) scaled by 2^(floor(t) - m),
// exactly 0 below 2^-126 (no subnormals: they are slow to produce on some CPUs). Lanes of
// t = -inf give 0 with AVX-512 and garbage otherwise: callers zero masked lanes themselves.
inline vf vexp2_rel(vf t, vf m) {
#if defined(__AVX512F__)
  const __m512 tt = (__m512)t;
  const __m512 n = _mm512_roundscale_ps(tt, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 e = _mm512_sub_ps(n, (__m512)m);
  const __m512 p = _mm512_scalef_ps((__m512)exp2_frac((vf)_mm512_sub_ps(tt, n)),
                                    _mm512_max_ps(e, _mm512_set1_ps(-126.0f)));
  return (vf)_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, _mm512_set1_ps(-126.0f), _CMP_GE_OQ), p);
#else
  t = t < m - 127.0f ? m - 127.0f : t;  // 0 once scaled (vpow2)
  const vf n = vfloor(t);
  return exp2_frac(t - n) * vpow2(n - m);
#endif
}

// x rounded to the nearest bfloat16 (even on a tie), as float32; x finite
inline vf round_bf16(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// cap * tanh(x / cap) (Gemma 2's attention soft-cap)
inline vf vsoftcap(vf x, float cap) {
  vf y = x * (2.0f / cap);
  vf ay = y < 0.0f ? -y : y;
  vf t = 1.0f - 2.0f / (vexp(ay) + 1.0f);  // tanh(|x| / cap)
  return (y < 0.0f ? -t : t) * cap;
}

// Per-thread scratch of one work item (reused across items and calls: no allocation per
// step once grown). L = R rounded up to whole vectors.
struct Scratch {
  std::vector<float> buf;
  float* qt;     // [d][L]      queries, transposed and scaled
  float* qr;     // [L][d]      the same, row-major (attend_heads' layout; attend's
                 //             transpose buffer once its scores are done)
  float* acc;    // running P @ V: [L][d] in attend_heads, transposed [d][L] in attend
                 // (back to [R][d] when the item's keys are done)
  float* m;      // [L]         running max per row
  float* l;      // [L]         running sum of exp per row
  float* alpha;  // [L]         this tile's rescale per row
  float* sp;     // [kTile][L]  scores, then probabilities
  float* kf;     // [kTile][d]  the tile's K rows in float32
  float* vfl;    // [kTile][d]  the tile's V rows in float32
  float* scores;  // [L][kScoreStride]  a decode item's scores, then probabilities (own keys)
  // bfloat16 pairs, one per 32-bit lane (the bf16-dot path; kDots below):
  uint32_t* qtb;    // [d/2][L]      (Qt[2t][r], Qt[2t+1][r])
  uint32_t* pb;     // [kTile/2][L]  (P[2t][r], P[2t+1][r])
  uint32_t* vpair;  // [kTile/2][d]  (V[2t][c], V[2t+1][c])
  int32_t qpos[kMaxRows];  // position of each row's query; -1 for padding rows
  // int8 pools (int8 query products, quantize_query_row): each row's query scale and the sum
  // of its int8 values; the tile's K scales
  float qscale[kMaxRows];
  int32_t qsum[kMaxRows];
  float kscale[kTile + kTileCols];
  // int8 P @ V (q8_probs): each row's unit of its 16-bit probabilities
  float punit[kMaxRows];
  std::vector<float> keys8;  // [8][width]  8 keys' K rows of all heads in float32

  float* key_block(int64_t width) {
    if (keys8.size() < size_t(8 * width)) keys8.resize(8 * width);
    return keys8.data();
  }

  void setup(int d) {
    const size_t L = kMaxRows;
    const size_t need = 2 * d * L + L * d + 3 * L + kTile * L + 2 * kTile * d +
                        L * kScoreStride + d / 2 * L + kTile / 2 * L + kTile / 2 * d;
    if (buf.size() < need) buf.resize(need);
    float* p = buf.data();
    qt = p; p += d * L;
    qr = p; p += L * d;
    acc = p; p += L * d;
    m = p; p += L;
    l = p; p += L;
    alpha = p; p += L;
    sp = p; p += kTile * L;
    kf = p; p += kTile * d;
    vfl = p; p += kTile * d;
    scores = p; p += L * kScoreStride;
    qtb = reinterpret_cast<uint32_t*>(p); p += d / 2 * L;
    pb = reinterpret_cast<uint32_t*>(p); p += kTile / 2 * L;
    vpair = reinterpret_cast<uint32_t*>(p);
  }
};

Scratch& scratch(int d) {
  thread_local Scratch s;
  s.setup(d);
  return s;
}

// Where an item's keys come from: key index j in [begin, end) lies in pool slot slots[j], at
// position pos_base + j of its sequence.
struct Keys {
  const int64_t* slots;
  int64_t begin, end;
  int64_t pos_base;
};

// Vectors of rows an item of R rows uses (R <= kMaxRows: at most 8 with AVX-512, 16 with AVX2).
inline int row_vectors(int R) { return (R + kLanes - 1) / kLanes; }

#if defined(__AVX512F__)
// rows r[0 .. 16) of 16 32-bit words -> r[c] = column c: 32-bit and 64-bit unpacks within
// 128-bit lanes, then two rounds of lane shuffles
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

// The 16 x 16 floats at src (row k at src + k * src_stride) transposed to dst (row c at
// dst + c * dst_stride)
inline void transpose16_f32(float* dst, int64_t dst_stride, const float* src,
                            int64_t src_stride) {
  __m512i r[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(src + k * src_stride);
  transpose16(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + c * dst_stride, r[c]);
}
#endif

typedef float vf4 __attribute__((vector_size(16)));

inline float hsum(vf v) {
  vf4 a = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < kLanes; c += 4) {
    vf4 part;
    std::memcpy(&part, reinterpret_cast<const float*>(&v) + c, sizeof part);
    a += part;
  }
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// ---- int8 query products (an int8 pool) ----
// Over an int8 pool every path multiplies int8 queries by the stored int8 keys: a row's scaled
// query x (d values) becomes q = round(x / qs) in [-127, 127], ties to even, qs = max |x| /
// 127, once per item; a score is then
//
//     S = float(sum_i q[i] k[i]) * (qs * ks)          ks: the key's head-row scale
//
// The integer sum is exact in any order: vpdpbusd's int32 lanes (AVX512-VNNI, the keys'
// bytes offset to unsigned and the sum started at -128 sum_i q[i]) or float32 FMAs of the
// integers as floats (every partial sum is an integer below 512 * 127^2 < 2^24), so every
// path, ISA and chunking gives a key the same score bits. V rows stay float32 products (each
// row's scale moved onto its probabilities in the own-key items), but for the all-heads decode
// items of an AVX512-VNNI build ("int8 P @ V").

// x [d] (scaled queries) -> its int8 values as floats, in place; returns qs (0: a zero row)
inline float quantize_query_row(float* x, int d) {
  vf amax = splat(0.0f);
  for (int i = 0; i < d; i += kLanes) {
    const vf v = loadf(x + i);
    amax = vmax(amax, v < 0.0f ? -v : v);
  }
  float m = 0.0f;
  for (int i = 0; i < kLanes; ++i) m = std::max(m, amax[i]);
  const float qs = m / 127.0f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (even ties)
  for (int i = 0; i < d; i += kLanes) {
    vf q = qs > 0.0f ? (loadf(x + i) / qs + magic) - magic : splat(0.0f);
    q = q > 127.0f ? splat(127.0f) : q;
    q = q < -127.0f ? splat(-127.0f) : q;
    storef(x + i, q);
  }
  return qs;
}

// Start an item: rows' queries into Qt (times scale), running state reset.
// `q_row(r)` points at row r's query vector [d]. round_q (bfloat16 products): the scaled
// queries rounded to bfloat16, as the dot products take them, on every path alike. quant_q
// (an int8 pool): the scaled queries as int8 values (quantize_query_row), their scales and
// sums in s.qscale / s.qsum.
template <typename T, typename QRow>
void load_rows(Scratch& s, int R, int d, float scale, bool round_q, bool quant_q, QRow q_row) {
  const int L = row_vectors(R) * kLanes;
  for (int r = 0; r < L; ++r) {
    if (r >= R) s.qpos[r] = -1;
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.0f;
  }
  // Qr [L][d] row by row (padding rows zero), then Qt [d][L] as its transpose
  for (int r = 0; r < L; ++r)
    for (int i = 0; i < d; i += kLanes) {
      vf x = splat(0.0f);
      if (r < R) {
        x = load16(q_row(r) + i) * scale;
        if (round_q) x = round_bf16(x);
      }
      storef(s.qr + r * d + i, x);
    }
  if (quant_q)
    for (int r = 0; r < L; ++r) {
      s.qscale[r] = quantize_query_row(s.qr + r * d, d);
      vf sum = splat(0.0f);  // integers: exact in any order, |sum| <= 127 d
      for (int i = 0; i < d; i += kLanes) sum += loadf(s.qr + r * d + i);
      s.qsum[r] = static_cast<int32_t>(hsum(sum));
    }
#if defined(__AVX512F__)
  for (int r0 = 0; r0 < L; r0 += 16)
    for (int i0 = 0; i0 < d; i0 += 16)
      transpose16_f32(s.qt + i0 * L + r0, L, s.qr + r0 * d + i0, d);
#else
  for (int r = 0; r < L; ++r)
    for (int i = 0; i < d; ++i) s.qt[i * L + r] = s.qr[r * d + i];
#endif
  std::memset(s.acc, 0, sizeof(float) * L * d);
}

// Rows src[0 .. n) of d values as float32: the rows themselves when they are float32, else
// widened into buf [n][d] (int8 head rows: times their scale).
template <typename T>
inline void rows_f32(const float** rows, float* buf, const T* const* src, int n, int64_t d) {
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = src[j];
    } else if constexpr (std::is_same_v<T, Q8>) {
      const vf scale = splat(q8_scale(src[j], d));
      for (int64_t c = 0; c < d; c += kLanes) storef(buf + j * d + c, load16(src[j] + c) * scale);
      rows[j] = buf + j * d;
    } else {
      for (int64_t c = 0; c < d; c += kLanes) storef(buf + j * d + c, load16(src[j] + c));
      rows[j] = buf + j * d;
    }
  }
}

// Pool rows src[0 .. n) of all kvh heads as float32 [n][kvh * d] (rows_f32 per head row).
template <typename T>
inline void heads_rows_f32(const float** rows, float* buf, const T* const* src, int n, int kvh,
                           int64_t d) {
  if constexpr (!std::is_same_v<T, Q8>) {
    rows_f32(rows, buf, src, n, kvh * d);
  } else {
    for (int j = 0; j < n; ++j) {
      for (int h = 0; h < kvh; ++h) {
        const Q8* head = src[j] + h * row_len<Q8>(d);
        const vf scale = splat(q8_scale(head, d));
        for (int64_t c = 0; c < d; c += kLanes)
          storef(buf + (j * kvh + h) * d + c, load16(head + c) * scale);
      }
      rows[j] = buf + j * kvh * d;
    }
  }
}

// int8 head rows src[0 .. n) as their values in float32, unscaled, into buf [n][d]; their
// scales into scales[0 .. n) (int8 query products: the integers of the dot products)
inline void q8_rows_unscaled(const float** rows, float* buf, const Q8* const* src, int n,
                             int64_t d, float* scales) {
  for (int j = 0; j < n; ++j) {
    scales[j] = q8_scale(src[j], d);
    for (int64_t c = 0; c < d; c += kLanes) storef(buf + j * d + c, load16(src[j] + c));
    rows[j] = buf + j * d;
  }
}

// The tile's n K (or V) rows of one head (pool slots[j]) as float32 (rows_f32, buf [kTile][d]).
template <typename T>
inline void head_rows_f32(const float** rows, float* buf, const T* head, const int64_t* slots,
                          int n, int d, int64_t slot_stride) {
  const T* src[kTile];
  for (int j = 0; j < n; ++j) src[j] = head + slots[j] * slot_stride;
  rows_f32(rows, buf, src, n, d);
}

template <typename T>
inline void prefetch_row(const T* row, int d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < int64_t(d) * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Loads one word of each cache line of row[0 .. n): the lines start arriving while other work
// runs (demand loads, unlike prefetch hints, keep many misses in flight here: 1.3-1.5x less
// waiting than prefetcht0/t1 on this kernel's scattered pages).
// Every line the row spans is touched, its last one included (an int8 pool's rows of kvh x
// (d + 2) bytes start anywhere in a line).
template <typename T>
inline void touch_row(const T* row, int64_t n) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63);
  const uintptr_t end = reinterpret_cast<uintptr_t>(row + n);
  for (uintptr_t b = first; b < end; b += 64) {
    int32_t v;
    std::memcpy(&v, reinterpret_cast<const char*>(b), sizeof v);
    asm volatile("" : : "r"(v));
  }
}

// Pins a loaded vector in a register: without it GCC folds every use of a loaded row vector
// into its FMA as a memory operand (one load per FMA instead of one per NK FMAs), and the
// tile turns load-bound.
inline void in_register(vf& v) {
#if defined(__AVX__) && defined(__GNUC__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// The wide path's register tiles, rows in vector lanes (L floats per key / output dim):
//
//     scores  S[j][rows] = sum_i K[j][i] * Qt[i][rows]           NK keys x NV row vectors
//     P @ V   accT[c][rows] = accT[c][rows] * alpha[rows]
//                             + sum_j V[j][c] * P[j][rows]        NC dims x NV row vectors
//
// NK (or NC) broadcast scalars times NV loaded row vectors: NK * NV accumulators in registers
// (12 of AVX2's 16), NV + NK loads per NK * NV FMAs, no horizontal sums.
template <int NV, int NK>
inline void qk_tile(const float* qt, int L, const float* const* krows, int d, float* sp) {
  vf acc[NK][NV];
  for (int k = 0; k < NK; ++k)
    for (int u = 0; u < NV; ++u) acc[k][u] = splat(0.0f);
  for (int i = 0; i < d; ++i) {
    vf q[NV];
    for (int u = 0; u < NV; ++u) {
      q[u] = loadf(qt + i * L + u * kLanes);
      in_register(q[u]);
    }
    for (int k = 0; k < NK; ++k) {
      const vf b = splat(krows[k][i]);
      for (int u = 0; u < NV; ++u) acc[k][u] += b * q[u];
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int u = 0; u < NV; ++u) storef(sp + k * L + u * kLanes, acc[k][u]);
}

template <int NV, int NC>
inline void pv_tile(float* acc, const float* alpha, const float* sp, int L,
                    const float* const* vrows, int n, int c) {
  vf o[NC][NV], al[NV];
  for (int u = 0; u < NV; ++u) al[u] = loadf(alpha + u * kLanes);
  for (int k = 0; k < NC; ++k)
    for (int u = 0; u < NV; ++u) o[k][u] = loadf(acc + k * L + u * kLanes) * al[u];
  for (int j = 0; j < n; ++j) {
    vf p[NV];
    for (int u = 0; u < NV; ++u) {
      p[u] = loadf(sp + j * L + u * kLanes);
      in_register(p[u]);
    }
    const float* vrow = vrows[j] + c;
    for (int k = 0; k < NC; ++k) {
      const vf b = splat(vrow[k]);
      for (int u = 0; u < NV; ++u) o[k][u] += b * p[u];
    }
  }
  for (int k = 0; k < NC; ++k)
    for (int u = 0; u < NV; ++u) storef(acc + k * L + u * kLanes, o[k][u]);
}

#if SGL_Q8_DOTS
// The scores' register tile over an int8 pool with AVX512-VNNI: S[k][rows] = sum_t
// quad(K[k], t) . Qt4[t][rows], the key's 4 bytes of dims 4t .. 4t + 3 broadcast with their
// sign bits flipped (unsigned k + 128) against the rows' 4 int8 query values per lane; each
// chain starts at -128 x its row's query sum, so it ends at the exact integer dot product
// (module note on int8 query products), stored as float for row_tile's scaling.
template <int NV, int NK>
inline void qk_tile_q8(const uint32_t* qt4, const int32_t* qsum, int L, const Q8* const* krows,
                       int d, float* sp) {
  __m512i acc[NK][NV];
  for (int u = 0; u < NV; ++u) {
    const __m512i start = _mm512_mullo_epi32(
        _mm512_loadu_si512(qsum + u * kLanes), _mm512_set1_epi32(-128));
    for (int k = 0; k < NK; ++k) acc[k][u] = start;
  }
  for (int t = 0; t < d / 4; ++t) {
    __m512i q[NV];
    for (int u = 0; u < NV; ++u) {
      q[u] = _mm512_loadu_si512(qt4 + t * L + u * kLanes);
      asm("" : "+v"(q[u]));
    }
    for (int k = 0; k < NK; ++k) {
      uint32_t w;
      std::memcpy(&w, krows[k] + 4 * t, sizeof w);
      const __m512i b = _mm512_set1_epi32(static_cast<int>(w ^ 0x80808080u));
      for (int u = 0; u < NV; ++u) acc[k][u] = _mm512_dpbusd_epi32(acc[k][u], b, q[u]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int u = 0; u < NV; ++u)
      _mm512_storeu_ps(sp + k * L + u * kLanes, _mm512_cvtepi32_ps(acc[k][u]));
}

// Qt [d][L] (int8 values as floats) -> Qt4 [d/4][L]: dims 4t .. 4t + 3 of a row as the bytes
// of one word
inline void pack_queries_q8(uint32_t* qt4, const float* qt, int L, int d) {
  for (int t = 0; t < d / 4; ++t)
    for (int r = 0; r < L; r += kLanes) {
      __m512i w = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        const __m512i b = _mm512_and_si512(
            _mm512_cvtps_epi32(_mm512_loadu_ps(qt + (4 * t + i) * L + r)), _mm512_set1_epi32(0xff));
        w = _mm512_or_si512(w, _mm512_slli_epi32(b, 8 * i));
      }
      _mm512_storeu_si512(qt4 + t * L + r, w);
    }
}
#endif

// ---- bfloat16 dot products (AVX512-BF16: a bfloat16 pool with bf16_dots) ----
// The same register tiles with `vdpbf16ps`, which adds two products per 32-bit lane: scores
// pair query dims (Qt's pairs against a broadcast pair of K's bfloat16 row, read from the pool
// as it is: no widening), P @ V pairs keys (P rounded to bfloat16 pairs against a broadcast
// pair of two keys' V). Half the instructions of float32 FMAs; queries and probabilities are
// rounded to bfloat16 (accumulation stays float32).
#if defined(__AVX512BF16__)
constexpr bool kDots = true;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
// (through an integer vector: GCC 12 spills an __m512bh asm operand to the stack every time)
inline void in_register(__m512bh& v) {
  __m512i i = (__m512i)v;
  asm("" : "+v"(i));
  v = (__m512bh)i;
}
inline uint32_t load_u32(const void* p) { uint32_t v; std::memcpy(&v, p, sizeof v); return v; }

// 16 float pairs (lo[i], hi[i]) rounded to bfloat16 pairs, lo in the low half of each lane
inline __m512i pack_pairs(vf lo, vf hi) {
  __m512 a, b;
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
  const __m256bh ha = _mm512_cvtneps_pbh(a), hb = _mm512_cvtneps_pbh(b);
  return _mm512_or_si512(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(ha)),
                         _mm512_slli_epi32(
                             _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(hb)), 16));
}

// S[k][rows] = sum_t pair(K[k], t) . Qtb[t][rows]: krows are the pool's bfloat16 rows
template <int NV, int NK>
inline void qk_tile_dots(const uint32_t* qtb, int L, const at::BFloat16* const* krows, int d,
                         float* sp) {
  __m512 acc[NK][NV];
  for (int k = 0; k < NK; ++k)
    for (int u = 0; u < NV; ++u) acc[k][u] = _mm512_setzero_ps();
  for (int t = 0; t < d / 2; ++t) {
    __m512bh q[NV];
    for (int u = 0; u < NV; ++u) {
      q[u] = as_bh(_mm512_loadu_si512(qtb + t * L + u * kLanes));
      in_register(q[u]);
    }
    for (int k = 0; k < NK; ++k) {
      const __m512bh b = as_bh(_mm512_set1_epi32(static_cast<int>(load_u32(krows[k] + 2 * t))));
      for (int u = 0; u < NV; ++u) acc[k][u] = _mm512_dpbf16_ps(acc[k][u], b, q[u]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(sp + k * L + u * kLanes, acc[k][u]);
}

// accT[c..c+NC)[rows] = accT * alpha + sum_t pair(V, t)[c] . Pb[t][rows] over n2 key pairs
template <int NV, int NC>
inline void pv_tile_dots(float* acc, const float* alpha, const uint32_t* pb, int L,
                         const uint32_t* vpair, int d, int n2, int c) {
  __m512 o[NC][NV], al[NV];
  for (int u = 0; u < NV; ++u) al[u] = _mm512_loadu_ps(alpha + u * kLanes);
  for (int k = 0; k < NC; ++k)
    for (int u = 0; u < NV; ++u)
      o[k][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + k * L + u * kLanes), al[u]);
  for (int t = 0; t < n2; ++t) {
    __m512bh p[NV];
    for (int u = 0; u < NV; ++u) {
      p[u] = as_bh(_mm512_loadu_si512(pb + t * L + u * kLanes));
      in_register(p[u]);
    }
    for (int k = 0; k < NC; ++k) {
      const uint32_t pair = load_u32(vpair + t * d + c + k);
      const __m512bh b = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int u = 0; u < NV; ++u) o[k][u] = _mm512_dpbf16_ps(o[k][u], b, p[u]);
    }
  }
  for (int k = 0; k < NC; ++k)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + k * L + u * kLanes, o[k][u]);
}

// Qt [d][L] -> Qtb [d/2][L]
inline void pack_queries(uint32_t* qtb, const float* qt, int L, int d) {
  for (int t = 0; t < d / 2; ++t)
    for (int r = 0; r < L; r += kLanes)
      _mm512_storeu_si512(qtb + t * L + r, pack_pairs(loadf(qt + 2 * t * L + r),
                                                      loadf(qt + (2 * t + 1) * L + r)));
}

// The tile's n V rows (bfloat16, pool slots) -> vpair [n2][d], a zero row past an odd n
inline void pack_values(uint32_t* vpair, const at::BFloat16* head, const int64_t* slots, int n,
                        int d, int64_t slot_stride) {
  for (int t = 0; 2 * t < n; ++t) {
    const at::BFloat16* v0 = head + slots[2 * t] * slot_stride;
    const at::BFloat16* v1 = 2 * t + 1 < n ? head + slots[2 * t + 1] * slot_stride : nullptr;
    for (int c = 0; c < d; c += kLanes) {
      const __m512i lo = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c)));
      const __m512i hi = v1 == nullptr ? _mm512_setzero_si512() : _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c))),
          16);
      _mm512_storeu_si512(vpair + t * d + c, _mm512_or_si512(lo, hi));
    }
  }
}

// Row vector v's n probabilities (sp[j][v]) -> Pb [n2][L] (a zero past an odd n)
inline void pack_probs(uint32_t* pb, const float* sp, int L, int v, int n) {
  for (int t = 0; 2 * t < n; ++t) {
    const vf hi = 2 * t + 1 < n ? loadf(sp + (2 * t + 1) * L + v * kLanes) : splat(0.0f);
    const vf lo = loadf(sp + 2 * t * L + v * kLanes);
    _mm512_storeu_si512(pb + t * L + v * kLanes, pack_pairs(lo, hi));
  }
}
#else
constexpr bool kDots = false;
#endif

// whether bfloat16 dot products run: asked for, an AVX512-BF16 build, a bfloat16 pool
template <typename TKV>
constexpr bool with_dots(bool asked) {
  return asked && kDots && std::is_same_v<TKV, at::BFloat16>;
}

// How a row vector meets a key tile: no lane sees any key, every valid lane sees every key,
// or a mask is needed (causal diagonal, window edge, padding lanes of a partial view).
enum class Seen { kNone, kAll, kSome };

// Online softmax of row vector v over the tile's n scores (sp[j][v], L floats per key): mask
// (if `masked`), soft-cap, running max (whole), 2^(t - m) in place, then m, l and this tile's
// alpha.
template <bool Base2>
inline void softmax_rows(Scratch& s, int v, int L, int n, int64_t pos0, vi qp, vi ql,
                         float cap, bool masked) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* sp = s.sp + v * kLanes;
  vf mx = splat(neg_inf);
  for (int j = 0; j < n; ++j) {
    vf sc = loadf(sp + j * L);
    if (cap > 0.0f) sc = vsoftcap(sc, cap);
    if constexpr (Base2) sc *= kLog2e;
    if (masked) {
      const vi pos = splati(static_cast<int32_t>(pos0 + j));
      sc = (pos <= qp) & (pos >= ql) ? sc : neg_inf;
    }
    storef(sp + j * L, sc);
    mx = vmax(mx, sc);
  }
  const vf m_old = loadf(s.m + v * kLanes);
  const vf m_new = vmax(m_old, Base2 ? vceil(mx) : mx);
  const vf alpha = m_old == neg_inf ? splat(0.0f)
                   : Base2          ? vpow2(m_old - m_new)
                                    : vexp(m_old - m_new);
  vf sum = splat(0.0f);
  for (int j = 0; j < n; ++j) {
    const vf sc = loadf(sp + j * L);
    vf p = Base2 ? vexp2_rel(sc, m_new) : vexp(sc - m_new);
    if (masked) p = sc == neg_inf ? splat(0.0f) : p;
    storef(sp + j * L, p);
    sum += p;
  }
  storef(s.l + v * kLanes, loadf(s.l + v * kLanes) * alpha + sum);
  storef(s.m + v * kLanes, m_new);
  storef(s.alpha + v * kLanes, alpha);
}

// One register tile's rows (NV row vectors from v0) against the tile's n keys: scores,
// softmax, P @ V, all while these rows' Qt, scores and accT slices stay in L1 (the whole
// item's Qt and accT are 32 KB each at 128 rows x d 64: walking all rows per step would
// stream them from L2 for every 4 keys).
// kscale (int8 pools): the keys' scales; the rows' integer dot products times qs * ks.
// kq (int8 pools with AVX512-VNNI): the keys' pool rows, whose scores qk_tile_q8 takes.
template <int NV, int RV>
void row_tile(Scratch& s, int v0, const float* const* krows, const float* const* vrows, int n,
              int d, int64_t pos0, const vi* qp, const vi* ql, float cap, bool masked,
              const float* kscale, [[maybe_unused]] const Q8* const* kq) {
  constexpr int L = RV * kLanes;
#if SGL_Q8_DOTS
  if (kq != nullptr) {
    for (int j = 0; j < n; j += kTileCols)
      qk_tile_q8<NV, kTileCols>(s.qtb + v0 * kLanes, s.qsum + v0 * kLanes, L, kq + j, d,
                                s.sp + j * L + v0 * kLanes);
  } else
#endif
  {
    for (int j = 0; j < n; j += kTileCols)
      qk_tile<NV, kTileCols>(s.qt + v0 * kLanes, L, krows + j, d, s.sp + j * L + v0 * kLanes);
  }
  if (kscale != nullptr)
    for (int j = 0; j < n; ++j)
      for (int v = v0; v < v0 + NV; ++v) {
        float* sc = s.sp + j * L + v * kLanes;
        storef(sc, loadf(sc) * (loadf(s.qscale + v * kLanes) * kscale[j]));
      }
  for (int v = v0; v < v0 + NV; ++v)
    softmax_rows<false>(s, v, L, n, pos0, qp[v], ql[v], cap, masked);
  for (int c = 0; c < d; c += kTileCols)
    pv_tile<NV, kTileCols>(s.acc + c * L + v0 * kLanes, s.alpha + v0 * kLanes,
                           s.sp + v0 * kLanes, L, vrows, n, c);
}

#if defined(__AVX512BF16__)
// row_tile with bfloat16 dot products: krows are the pool's rows, V and queries in s as pairs
template <int NV, int RV>
void row_tile_dots(Scratch& s, int v0, const at::BFloat16* const* krows, int n, int d,
                   int64_t pos0, const vi* qp, const vi* ql, float cap, bool masked) {
  constexpr int L = RV * kLanes;
  for (int j = 0; j < n; j += kTileCols)
    qk_tile_dots<NV, kTileCols>(s.qtb + v0 * kLanes, L, krows + j, d, s.sp + j * L + v0 * kLanes);
  for (int v = v0; v < v0 + NV; ++v) {
    softmax_rows<true>(s, v, L, n, pos0, qp[v], ql[v], cap, masked);
    pack_probs(s.pb, s.sp, L, v, n);
  }
  for (int c = 0; c < d; c += kTileCols)
    pv_tile_dots<NV, kTileCols>(s.acc + c * L + v0 * kLanes, s.alpha + v0 * kLanes,
                                s.pb + v0 * kLanes, L, s.vpair, d, (n + 1) / 2, c);
}
#endif

// Walk the item's keys (rows R of s already loaded): online softmax into s.m / s.l / s.acc.
// Dots: bfloat16 dot products (a bfloat16 pool on an AVX512-BF16 build; see kDots).
template <typename T, int RV, bool Dots>
void attend(Scratch& s, int R, int d, const T* k_head, const T* v_head, int64_t slot_stride,
            Keys keys, int32_t window, float cap) {
  constexpr int L = RV * kLanes;
  static_assert(!Dots || (kDots && std::is_same_v<T, at::BFloat16>));
#if defined(__AVX512BF16__)
  if constexpr (Dots) pack_queries(s.qtb, s.qt, L, d);
#endif
#if SGL_Q8_DOTS
  if constexpr (std::is_same_v<T, Q8>) pack_queries_q8(s.qtb, s.qt, L, d);
#endif
  // the key positions any row can see: skip the rest without reading them
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  // per row vector, its valid rows' positions: which key tiles it sees whole or not at all
  int64_t vmin[RV], vmax_[RV];
  for (int v = 0; v < RV; ++v) {
    vmin[v] = std::numeric_limits<int64_t>::max();
    vmax_[v] = -1;
    for (int r = v * kLanes; r < (v + 1) * kLanes; ++r) {
      if (r >= R || s.qpos[r] < 0) continue;  // padding lanes: computed, never read
      vmin[v] = std::min<int64_t>(vmin[v], s.qpos[r]);
      vmax_[v] = std::max<int64_t>(vmax_[v], s.qpos[r]);
    }
    if (vmax_[v] >= 0) {
      lo = std::min<int64_t>(lo, vmin[v] - window + 1);
      hi = std::max<int64_t>(hi, vmax_[v]);
    }
  }
  const int64_t begin = std::max(keys.begin, lo - keys.pos_base);
  const int64_t end = std::min(keys.end, hi - keys.pos_base + 1);
  vi qp[RV], ql[RV];
  for (int v = 0; v < RV; ++v) {
    qp[v] = loadi(s.qpos + v * kLanes);
    ql[v] = qp[v] - (window - 1);
  }
  for (int64_t kb = begin; kb < end; kb += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - kb));
    const int64_t pos0 = keys.pos_base + kb, pos1 = pos0 + n - 1;  // the tile's positions
    // the next tile's K/V rows start arriving while this one computes (its pages are
    // scattered over the pool: the hardware prefetcher cannot guess them)
    const int64_t next_n = std::min<int64_t>(kTile, end - kb - n);
    for (int64_t j = 0; j < next_n; ++j) {
      prefetch_row(k_head + keys.slots[kb + n + j] * slot_stride, d);
      prefetch_row(v_head + keys.slots[kb + n + j] * slot_stride, d);
    }
    const float* krows[kTile + kTileCols];
    const float* vrows[kTile];
    [[maybe_unused]] const T* kpool[kTile + kTileCols];
    if constexpr (Dots) {
      for (int j = 0; j < n; ++j) kpool[j] = k_head + keys.slots[kb + j] * slot_stride;
      for (int j = n; j % kTileCols; ++j) kpool[j] = kpool[n - 1];
#if defined(__AVX512BF16__)
      pack_values(s.vpair, v_head, keys.slots + kb, n, d, slot_stride);
#endif
    } else if constexpr (std::is_same_v<T, Q8>) {  // int8 query products: K unscaled
      for (int j = 0; j < n; ++j) kpool[j] = k_head + keys.slots[kb + j] * slot_stride;
      for (int j = n; j % kTileCols; ++j) kpool[j] = kpool[n - 1];
      if constexpr (SGL_Q8_DOTS) {  // the pool's rows as they are, and their scales
        for (int j = 0; j < n; ++j) s.kscale[j] = q8_scale(kpool[j], d);
      } else {
        q8_rows_unscaled(krows, s.kf, kpool, n, d, s.kscale);
        for (int j = n; j % kTileCols; ++j) krows[j] = krows[n - 1];
      }
      head_rows_f32(vrows, s.vfl, v_head, keys.slots + kb, n, d, slot_stride);
    } else {
      head_rows_f32(krows, s.kf, k_head, keys.slots + kb, n, d, slot_stride);
      head_rows_f32(vrows, s.vfl, v_head, keys.slots + kb, n, d, slot_stride);
      // whole register tiles of keys: the padding keys repeat the last row (their scores are
      // computed, never read)
      for (int j = n; j % kTileCols; ++j) krows[j] = krows[n - 1];
    }
    Seen seen[RV];
    for (int v = 0; v < RV; ++v) {
      if (vmax_[v] < 0 || pos0 > vmax_[v] || pos1 < vmin[v] - window + 1)
        seen[v] = Seen::kNone;
      else if (pos1 <= vmin[v] && pos0 >= vmax_[v] - window + 1)
        seen[v] = Seen::kAll;
      else
        seen[v] = Seen::kSome;
    }
    // row tiles no row of which sees a key of this tile are skipped (the causal triangle)
    auto run = [&](auto nv_tag, int v0) {
      constexpr int NV = decltype(nv_tag)::value;
      bool any = false, all = true;
      for (int v = v0; v < v0 + NV; ++v) {
        any |= seen[v] != Seen::kNone;
        all &= seen[v] == Seen::kAll;
      }
      if (!any) return;
#if defined(__AVX512BF16__)
      if constexpr (Dots) {
        row_tile_dots<NV, RV>(s, v0, kpool, n, d, pos0, qp, ql, cap, !all);
        return;
      }
#endif
      if constexpr (std::is_same_v<T, Q8>)
        row_tile<NV, RV>(s, v0, krows, vrows, n, d, pos0, qp, ql, cap, !all, s.kscale,
                         SGL_Q8_DOTS ? kpool : nullptr);
      else
        row_tile<NV, RV>(s, v0, krows, vrows, n, d, pos0, qp, ql, cap, !all, nullptr, nullptr);
    };
    constexpr int full = RV / kTileRows * kTileRows;
    for (int v0 = 0; v0 < full; v0 += kTileRows)
      run(std::integral_constant<int, kTileRows>{}, v0);
    if constexpr (RV % kTileRows != 0)
      run(std::integral_constant<int, RV % kTileRows>{}, full);
  }
  // accT [d][L] -> acc [R][d], through qr (free once the scores are done)
#if defined(__AVX512F__)
  for (int c0 = 0; c0 < d; c0 += 16)
    for (int r0 = 0; r0 < L; r0 += 16)
      transpose16_f32(s.qr + r0 * d + c0, d, s.acc + c0 * L + r0, L);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < d; ++c) s.qr[r * d + c] = s.acc[c * L + r];
#endif
  std::memcpy(s.acc, s.qr, sizeof(float) * R * d);
}

// attend for R rows; dots: bfloat16 dot products where the build and the pool allow them
template <typename T>
void attend_rows(Scratch& s, int R, int d, const T* k_head, const T* v_head,
                 int64_t slot_stride, Keys keys, int32_t window, float cap, bool dots) {
  if constexpr (kDots && std::is_same_v<T, at::BFloat16>) {
    if (dots) {
      switch (row_vectors(R)) {
#define SGL_CASE(RV) \
  case RV: return attend<T, RV, true>(s, R, d, k_head, v_head, slot_stride, keys, window, cap);
        SGL_CASE(1) SGL_CASE(2) SGL_CASE(3) SGL_CASE(4) SGL_CASE(5) SGL_CASE(6) SGL_CASE(7)
        SGL_CASE(8)
#undef SGL_CASE
        default: TORCH_CHECK(false, "paged_attention_cpu: too many rows per item: ", R);
      }
    }
  }
  switch (row_vectors(R)) {
#define SGL_CASE(RV) \
  case RV: return attend<T, RV, false>(s, R, d, k_head, v_head, slot_stride, keys, window, cap);
    SGL_CASE(1) SGL_CASE(2) SGL_CASE(3) SGL_CASE(4) SGL_CASE(5) SGL_CASE(6) SGL_CASE(7)
    SGL_CASE(8) SGL_CASE(9) SGL_CASE(10) SGL_CASE(11) SGL_CASE(12) SGL_CASE(13) SGL_CASE(14)
    SGL_CASE(15) SGL_CASE(16)
#undef SGL_CASE
    default: TORCH_CHECK(false, "paged_attention_cpu: too many rows per item: ", R);
  }
}

// ---- DECODE, a sequence's own keys, GQA groups of G <= 4 rows: keys in vector lanes ----
// A decode item over one sequence's own keys holds all its H = KVH x G query heads: rows of
// one query position, so every key of the item's chunk (at most kChunk) is seen by every
// row (a window only moves where the chunk starts). It reads each key's K and V rows of all
// KV heads at once (contiguous in the pool: the cache lines of a page arrive as one stream,
// 1.6x the rate of one head's strided slice), then, with no online softmax and no masks,
// three passes over the chunk, keys or dims in vector lanes:
//
//     scores   S[r][j] = q[r] . K[j][head(r)]: per 8 keys (their bfloat16 K rows widened
//              once for all rows), 8 vectors of partial dot products folded into one vector
//              of the 8 scores (fold8); the K/V rows of the keys kAhead further on are
//              touched meanwhile (their pages are scattered)
//     softmax  m[r] = max_j S, P[r][j] = exp(S - m), l[r] = sum_j P: 8 (16) keys per exp
//     P @ V    acc[r][c] = sum_j P[r][j] V[j][head(r)][c]: per KV head, its rows x NC vectors
//              of d accumulated in registers per block of kTile keys, each V vector loaded
//              once for all the head's rows

// keys whose K/V rows are touched ahead of the score pass: 64 against 32 took a batch-1 decode
// step of the default model from 6.91 to 6.62 ms at 1k keys and from 12.46 to 11.97 ms at 4k
// (an in-process alternation; 2-core AVX-512 EPYC)
constexpr int kAhead = 64;
// an int8 pool's keys (rows of about half a bfloat16 pool's bytes): as many bytes ahead, 128
// keys (0.95-0.96x the kernel's thread time against 64 at 8k keys, batch 1 and a verify of 5
// rows, 30 layers of the default model's shapes on one thread)
template <typename T>
constexpr int keys_ahead() {
  return std::is_same_v<T, Q8> ? 2 * kAhead : kAhead;
}

typedef float vf8 __attribute__((vector_size(32)));

// v's lanes summed down to 8 (identity when a register holds 8 floats). Shuffles, not copies
// through memory: a memcpy of the accumulators made GCC keep them on the stack, and the
// score loop's FMAs then waited on store forwarding (2.2x the kernel's time at 1.6k keys).
inline vf8 to8(vf v) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

// One vector of the 8 sums of a[0..7]'s lanes, in the order kFold: three rounds of
// shuffle-and-add halve the partial sums per input while doubling the inputs per vector.
constexpr int kFold[8] = {0, 4, 2, 6, 1, 5, 3, 7};  // lane i holds the sum of a[kFold[i]]
inline vf8 fold8(const vf8* a) {
  vf8 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(u[0], u[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// sc[r][j] = q[r] . K[slots[j]][r / G] for j < n (queries in s.qr, scaled), then lanes up to
// the next whole vector set to 0. A pool row holds the kvh heads: width = kvh * d.
// The K and V pool rows (all heads: width values) of keys slots[0 .. n) touched kAhead keys
// ahead of a walk over them in blocks: first() before the walk, block(j, len) at each block
template <typename T>
struct TouchAhead {
  const T *kp, *vp;
  const int64_t* slots;
  int64_t width;
  int n;

  void key(int j) const {
    touch_row(kp + slots[j] * width, width);
    touch_row(vp + slots[j] * width, width);
  }
  void first() const {
    for (int j = 0; j < std::min(n, keys_ahead<T>()); ++j) key(j);
  }
  void block(int j, int len) const {
    for (int k = j + keys_ahead<T>(); k < std::min(n, j + keys_ahead<T>() + len); ++k) key(k);
  }
};

template <typename T>
void heads_scores(Scratch& s, int kvh, int G, int d, const T* kp, const T* vp,
                  const int64_t* slots, int n, float* sc) {
  const int64_t width = int64_t(kvh) * d, stride = kvh * row_len<T>(d);
  float* kbuf = std::is_same_v<T, float> ? nullptr : s.key_block(width);
  const TouchAhead<T> ahead{kp, vp, slots, stride, n};
  ahead.first();
  for (int j = 0; j < n; j += 8) {
    const int m = std::min(8, n - j);
    ahead.block(j, 8);
    const T* src[8];  // keys past n repeat the last one (their scores are overwritten)
    for (int k = 0; k < 8; ++k) src[k] = kp + slots[j + std::min(k, m - 1)] * stride;
    // the rows as float32, widened once for the G query rows of each head that read them
    // (int8 rows unscaled, their scales in ks [kvh][8]: int8 query products)
    const float* kr[8];
    float ks[kMaxRows * 8];
    if constexpr (std::is_same_v<T, Q8>) {
      for (int k = 0; k < 8; ++k) {
        for (int h = 0; h < kvh; ++h) {
          const Q8* head = src[k] + h * row_len<Q8>(d);
          ks[h * 8 + k] = q8_scale(head, d);
          for (int64_t c = 0; c < d; c += kLanes)
            storef(kbuf + (k * kvh + h) * d + c, load16(head + c));
        }
        kr[k] = kbuf + k * width;
      }
    } else {
      heads_rows_f32(kr, kbuf, src, 8, kvh, d);
    }
    for (int h = 0; h < kvh; ++h)
      for (int r = h * G; r < (h + 1) * G; ++r) {
        const float* q = s.qr + r * d;
        vf acc[8];
        for (int k = 0; k < 8; ++k) acc[k] = splat(0.0f);
        for (int c = h * d; c < (h + 1) * d; c += kLanes) {
          vf qv = loadf(q + c - h * d);
          in_register(qv);
          for (int k = 0; k < 8; ++k) acc[k] += qv * loadf(kr[k] + c);
        }
        vf8 a[8];
        for (int i = 0; i < 8; ++i) a[i] = to8(acc[kFold[i]]);
        vf8 scores = fold8(a);
        if constexpr (std::is_same_v<T, Q8>) {
          vf8 kscale;
          std::memcpy(&kscale, ks + h * 8, sizeof kscale);
          scores *= s.qscale[r] * kscale;
        }
        std::memcpy(sc + r * kScoreStride + j, &scores, sizeof scores);
      }
  }
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int r = 0; r < kvh * G; ++r)
    for (int j = n; j < padded; ++j) sc[r * kScoreStride + j] = 0.0f;
}

#if defined(__AVX512BF16__)
// heads_scores under bfloat16 products: each score exactly as the row-tiled items take it (one
// chain of `vdpbf16ps` over the query's dim pairs, from zero, in order: qk_tile_dots), so a
// key's score, and with it its probability, has the same bits on every path. Keys in lanes:
// per 32 keys and KV head, the keys' K rows (dim pairs as the pool holds them) are transposed
// to [pair][key] once for all the head's query rows, whose chains then run two vectors of 16
// keys side by side (a row's chain is sequential: with G = 3, one vector per row left the
// `vdpbf16ps` units waiting on its latency). s.qr holds the queries, already rounded to
// bfloat16.
inline void heads_scores_dots(Scratch& s, int kvh, int G, int d, const at::BFloat16* kp,
                              const at::BFloat16* vp, const int64_t* slots, int n, float* sc) {
  constexpr int kKeys = 32;  // keys per transposed block: two vectors
  const int64_t width = int64_t(kvh) * d;
  const int np = d / 2, R = kvh * G;
  uint32_t* qpairs = s.qtb;  // [R][np]
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < np; ++t)
      qpairs[r * np + t] = static_cast<uint32_t>(at::BFloat16(s.qr[r * d + 2 * t]).x) |
                           static_cast<uint32_t>(at::BFloat16(s.qr[r * d + 2 * t + 1]).x) << 16;
  // [np][32]: 16 d words (8 * width floats hold them from 2 KV heads up)
  uint32_t* kt = reinterpret_cast<uint32_t*>(s.key_block(std::max<int64_t>(width, 2 * d)));
  const TouchAhead<at::BFloat16> ahead{kp, vp, slots, width, n};
  ahead.first();
  for (int j = 0; j < n; j += kKeys) {
    const int m = std::min(kKeys, n - j);
    ahead.block(j, kKeys);
    // keys past n repeat the last one (their scores are padding, or past it and never read)
    const at::BFloat16* src[kKeys];
    for (int k = 0; k < kKeys; ++k) src[k] = kp + slots[j + std::min(k, m - 1)] * width;
    for (int h = 0; h < kvh; ++h) {
      for (int half = 0; half < 2; ++half)
        for (int b = 0; b < np; b += 16) {
          const __mmask16 words = static_cast<__mmask16>((1u << std::min(16, np - b)) - 1);
          __m512i rows[16];
          for (int k = 0; k < 16; ++k)
            rows[k] = _mm512_maskz_loadu_epi32(words, src[16 * half + k] + h * d + 2 * b);
          transpose16(rows);
          for (int t = 0; t < std::min(16, np - b); ++t)
            _mm512_storeu_si512(kt + (b + t) * kKeys + 16 * half, rows[t]);
        }
      // the head's rows, 4 at a time against each loaded pair of key vectors
      for (int r0 = h * G; r0 < (h + 1) * G; r0 += 4) {
        const int nr = std::min(4, (h + 1) * G - r0);
        __m512 acc[4][2];
        for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int t = 0; t < np; ++t) {
          __m512bh kv[2];
          for (int u = 0; u < 2; ++u) {
            kv[u] = as_bh(_mm512_loadu_si512(kt + t * kKeys + 16 * u));
            in_register(kv[u]);
          }
          for (int i = 0; i < nr; ++i) {
            const __m512bh q =
                as_bh(_mm512_set1_epi32(static_cast<int>(qpairs[(r0 + i) * np + t])));
            for (int u = 0; u < 2; ++u) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], q, kv[u]);
          }
        }
        for (int i = 0; i < nr; ++i)
          for (int u = 0; u < 2; ++u)
            _mm512_storeu_ps(sc + (r0 + i) * kScoreStride + j + 16 * u, acc[i][u]);
      }
    }
  }
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int r = 0; r < R; ++r)
    for (int j = n; j < padded; ++j) sc[r * kScoreStride + j] = 0.0f;
}
#endif

#if SGL_Q8_DOTS
// heads_scores over an int8 pool with AVX512-VNNI: `vpdpbusd` multiplies 4 unsigned bytes by 4
// signed ones per int32 lane. Per 32 keys and KV head, the keys' int8 rows (4-byte groups of
// dims) are transposed to [group][key] once for all the head's query rows, their sign bits
// flipped (k + 128, unsigned), and each row's chain starts at -128 x its query's sum, so it
// ends at the exact sum_i q[i] k[i] (module note on int8 query products).
// Scores of rows r0 .. r0 + NR against 32 keys: kt [nq][32] the keys' transposed biased bytes,
// ks their scales; sc[r][0 .. 32) written (scale: qs * ks)
template <int NR>
inline void q8_rows_dots(const Scratch& s, const uint32_t* qquads, int nq, const uint32_t* kt,
                         const float* ks, int r0, float* sc) {
  __m512i acc[NR][2];
  for (int i = 0; i < NR; ++i)
    acc[i][0] = acc[i][1] = _mm512_set1_epi32(-128 * s.qsum[r0 + i]);
  for (int t = 0; t < nq; ++t) {
    __m512i kv[2];
    for (int u = 0; u < 2; ++u) {
      kv[u] = _mm512_loadu_si512(kt + t * 32 + 16 * u);
      asm("" : "+v"(kv[u]));
    }
    for (int i = 0; i < NR; ++i) {
      const __m512i q = _mm512_set1_epi32(static_cast<int>(qquads[(r0 + i) * nq + t]));
      for (int u = 0; u < 2; ++u) acc[i][u] = _mm512_dpbusd_epi32(acc[i][u], kv[u], q);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int u = 0; u < 2; ++u) {
      const vf scale = splat(s.qscale[r0 + i]) * loadf(ks + 16 * u);
      const vf dot = __builtin_convertvector((vi)acc[i][u], vf);
      storef(sc + (r0 + i) * kScoreStride + 16 * u, dot * scale);
    }
}

inline void heads_scores_q8(Scratch& s, int kvh, int G, int d, const Q8* kp, const Q8* vp,
                            const int64_t* slots, int n, float* sc) {
  constexpr int kKeys = 32;  // keys per transposed block: two vectors
  const int64_t stride = int64_t(kvh) * row_len<Q8>(d);
  const int nq = d / 4, R = kvh * G;
  uint32_t* qquads = s.qtb;  // [R][nq]: each row's int8 values, 4 per word
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < nq; ++t) {
      uint32_t w = 0;
      for (int i = 0; i < 4; ++i)
        w |= uint32_t(uint8_t(static_cast<int8_t>(s.qr[r * d + 4 * t + i]))) << (8 * i);
      qquads[r * nq + t] = w;
    }
  uint32_t* kt = reinterpret_cast<uint32_t*>(s.key_block(d));  // [nq][32]
  const TouchAhead<Q8> ahead{kp, vp, slots, stride, n};
  ahead.first();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int j = 0; j < n; j += kKeys) {
    const int m = std::min(kKeys, n - j);
    ahead.block(j, kKeys);
    // keys past n repeat the last one (their scores are padding, or past it and never read)
    const Q8* src[kKeys];
    for (int k = 0; k < kKeys; ++k) src[k] = kp + slots[j + std::min(k, m - 1)] * stride;
    for (int h = 0; h < kvh; ++h) {
      const int64_t off = int64_t(h) * row_len<Q8>(d);
      alignas(64) float ks[kKeys];
      for (int k = 0; k < kKeys; ++k) ks[k] = q8_scale(src[k] + off, d);
      for (int half = 0; half < 2; ++half)
        for (int b = 0; b < nq; b += 16) {
          const __mmask16 words = static_cast<__mmask16>((1u << std::min(16, nq - b)) - 1);
          __m512i rows[16];
          for (int k = 0; k < 16; ++k)
            rows[k] = _mm512_xor_si512(
                _mm512_maskz_loadu_epi32(words, src[16 * half + k] + off + 4 * b), flip);
          transpose16(rows);
          for (int t = 0; t < std::min(16, nq - b); ++t)
            _mm512_storeu_si512(kt + (b + t) * kKeys + 16 * half, rows[t]);
        }
      // the head's rows, 4 at a time against each loaded pair of key vectors
      const int end = (h + 1) * G;
      int r = h * G;
      for (; r + 4 <= end; r += 4) q8_rows_dots<4>(s, qquads, nq, kt, ks, r, sc + j);
      switch (end - r) {
        case 3: q8_rows_dots<3>(s, qquads, nq, kt, ks, r, sc + j); break;
        case 2: q8_rows_dots<2>(s, qquads, nq, kt, ks, r, sc + j); break;
        case 1: q8_rows_dots<1>(s, qquads, nq, kt, ks, r, sc + j); break;
        default: break;
      }
    }
  }
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int r = 0; r < R; ++r)
    for (int j = n; j < padded; ++j) sc[r * kScoreStride + j] = 0.0f;
}

// ---- int8 P @ V (an int8 pool with AVX512-VNNI: the all-heads items) ----
// The probabilities become 16-bit integers and multiply the stored int8 V values exactly
// (`vpdpwssd`: two int16 products added per int32 lane, keys in pairs), two keys per
// instruction with no float copy of V. Per row of an item (a chunk of at most kChunk keys),
// each key's probability times its V row's scale, w[j] = P[j] vs[j], is rounded to
//
//     wq[j] = round(w[j] / u)   in [0, 32767], u = max_j w[j] / 32767 (the row's unit)
//
// and acc[c] = u * sum_j wq[j] v[j][c], the integer sum exact in any order (|sum| <= kChunk
// * 32767 * 128 < 2^31). A row's result is a function of its own scores and its chunk's keys,
// whatever rows share the item (batch invariance, decode_impl). Relative to the largest w of
// the chunk, a probability is off by at most 2^-16 (bfloat16 pairs: 2^-9 of each).
constexpr float kProbUnit = 32767.0f;
static_assert(kChunk * 32767LL * 128 < (1LL << 31), "int8 P @ V: int32 sums of a chunk");

// Row r's n probabilities (floats in place, padded to whole vectors with zeros) times the
// keys' V scales vs[0 .. whole vectors) -> wq as int16, key j's in halfword j of the row, so
// keys 2t and 2t + 1 are the 32-bit pair t that `vpdpwssd` takes (each vector of floats is
// read before its halves are written, at or below it); its unit into s.punit[r].
inline void q8_probs(Scratch& s, int r, int n, const float* vs, float* sc) {
  float* row = sc + r * kScoreStride;
  const int nv = (n + kLanes - 1) / kLanes;
  __m512 wmax = _mm512_setzero_ps();
  for (int v = 0; v < nv; ++v) {
    const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(row + v * kLanes),
                                   _mm512_loadu_ps(vs + v * kLanes));
    _mm512_storeu_ps(row + v * kLanes, w);
    wmax = _mm512_max_ps(wmax, w);
  }
  const float m = _mm512_reduce_max_ps(wmax);
  s.punit[r] = m / kProbUnit;
  const __m512 f = _mm512_set1_ps(m > 0.0f ? kProbUnit / m : 0.0f);
  int16_t* wq = reinterpret_cast<int16_t*>(row);
  for (int v = 0; v < nv; ++v) {
    const __m512i w = _mm512_min_epi32(
        _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + v * kLanes), f),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_epi32(32767));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wq + v * kLanes), _mm512_cvtepi32_epi16(w));
  }
}

// The tile's n V rows of one head (int8, pool slots) -> vpair [n2][d] as int16 pairs
// (V[2t][c], V[2t + 1][c]), a zero row past an odd n
inline void pack_values_q8(uint32_t* vpair, const Q8* head, const int64_t* slots, int n, int d,
                           int64_t slot_stride) {
  for (int t = 0; 2 * t < n; ++t) {
    const Q8* v0 = head + slots[2 * t] * slot_stride;
    const Q8* v1 = 2 * t + 1 < n ? head + slots[2 * t + 1] * slot_stride : nullptr;
    for (int c = 0; c < d; c += kLanes) {
      const __m512i lo =
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + c)));
      const __m512i hi = v1 == nullptr ? _mm512_setzero_si512() : _mm512_slli_epi32(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v1 + c))), 16);
      _mm512_storeu_si512(vpair + t * d + c,
                          _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, hi));
    }
  }
}

// acc[r][c0 .. c0 + NC vectors) += sum_t pair(wq[r], t) . vpair[t][c0 ..] over n2 key pairs
// for rows r0 .. r0 + NR (int32 sums; the pairs of row r at probs + r * kScoreStride floats,
// from pair p0)
template <int NR, int NC>
inline void pv_rows_q8_block(int32_t* acc, int d, const float* probs, int p0,
                             const uint32_t* vpair, int n2, int r0, int c0) {
  __m512i o[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) o[r][u] = _mm512_loadu_si512(acc + (r0 + r) * d + c0 + u * kLanes);
  for (int t = 0; t < n2; ++t) {
    __m512i v[NC];
    for (int u = 0; u < NC; ++u) {
      v[u] = _mm512_loadu_si512(vpair + t * d + c0 + u * kLanes);
      asm("" : "+v"(v[u]));
    }
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, probs + (r0 + r) * kScoreStride + p0 + t, sizeof pair);
      const __m512i b = _mm512_set1_epi32(pair);
      for (int u = 0; u < NC; ++u) o[r][u] = _mm512_dpwssd_epi32(o[r][u], b, v[u]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) _mm512_storeu_si512(acc + (r0 + r) * d + c0 + u * kLanes, o[r][u]);
}

template <int NR>
inline void pv_rows_q8(int32_t* acc, int d, const float* probs, int p0, const uint32_t* vpair,
                       int n2, int r0) {
  int c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes)
    pv_rows_q8_block<NR, 4>(acc, d, probs, p0, vpair, n2, r0, c);
  for (; c < d; c += kLanes) pv_rows_q8_block<NR, 1>(acc, d, probs, p0, vpair, n2, r0, c);
}

// s.acc [R][d] = P @ V of the item's n keys (slots) for its kvh * G rows, row r reading head
// r / G: the rows' probabilities as q8_probs left them in sc, summed as int32 in s.acc (zero
// at the start), then times each row's unit
inline void pv_heads_q8(Scratch& s, int kvh, int G, int d, const float* sc, const Q8* vp,
                        const int64_t* slots, int n) {
  const int64_t stride = kvh * row_len<Q8>(d);
  int32_t* acc = reinterpret_cast<int32_t*>(s.acc);
  for (int j0 = 0; j0 < n; j0 += kTile) {
    const int nb = std::min(kTile, n - j0), n2 = (nb + 1) / 2;
    for (int h = 0; h < kvh; ++h) {
      pack_values_q8(s.vpair, vp + int64_t(h) * row_len<Q8>(d), slots + j0, nb, d, stride);
      const int p0 = j0 / 2, end = (h + 1) * G;
      int r = h * G;
      for (; r + 4 <= end; r += 4) pv_rows_q8<4>(acc, d, sc, p0, s.vpair, n2, r);
      switch (end - r) {
        case 3: pv_rows_q8<3>(acc, d, sc, p0, s.vpair, n2, r); break;
        case 2: pv_rows_q8<2>(acc, d, sc, p0, s.vpair, n2, r); break;
        case 1: pv_rows_q8<1>(acc, d, sc, p0, s.vpair, n2, r); break;
        default: break;
      }
    }
  }
  for (int r = 0; r < kvh * G; ++r) {
    const __m512 unit = _mm512_set1_ps(s.punit[r]);
    for (int c = 0; c < d; c += kLanes) {
      float* a = s.acc + r * d + c;
      _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a)), unit));
    }
  }
}
#endif

// Row r's n scores (padded to whole vectors) soft-capped and turned into probabilities in
// place, keys outside [a, b) masked (a zero probability); the row's m and l into s.
// dots (a call with bfloat16 products): the base-2 softmax of the row-tiled items' dot
// products, its probabilities rounded to bfloat16 as those items' pairs hold them (l sums them
// unrounded, as there) and stored in place as bfloat16: key j's in halfword j of the row, so
// keys 2t and 2t + 1 are the 32-bit pair t that P @ V's `vdpbf16ps` takes (each vector of
// floats is read before its halves are written, at or below it).
inline void row_softmax(Scratch& s, int r, int n, int a, int b, float cap, bool dots,
                        float* sc) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int nv = (n + kLanes - 1) / kLanes;
  float* row = sc + r * kScoreStride;
  if (cap > 0.0f || dots)
    for (int v = 0; v < nv; ++v) {
      const vf x = loadf(row + v * kLanes);
      const vf capped = cap > 0.0f ? vsoftcap(x, cap) : x;
      storef(row + v * kLanes, dots ? capped * kLog2e : capped);
    }
  for (int j = 0; j < std::min(a, n); ++j) row[j] = neg_inf;
  for (int j = std::max(b, 0); j < nv * kLanes; ++j) row[j] = neg_inf;  // and the padding
  vf mx = splat(neg_inf);
  for (int v = 0; v < nv; ++v) mx = vmax(mx, loadf(row + v * kLanes));
  const float m = dots ? std::ceil(hmax(mx)) : hmax(mx);
  vf sum = splat(0.0f);
  for (int v = 0; v < nv; ++v) {
    const vf x = loadf(row + v * kLanes);
    if (dots) {
      const vf p = x == neg_inf ? splat(0.0f) : vexp2_rel(x, splat(m));
      store16(reinterpret_cast<at::BFloat16*>(row) + v * kLanes, p);
      sum += p;
    } else {
      const vf p = x == neg_inf ? splat(0.0f) : vexp(x - m);
      storef(row + v * kLanes, p);
      sum += p;
    }
  }
  s.m[r] = m;
  s.l[r] = hsum(sum);
}

// acc[r][c0 .. c0 + NC vectors) += sum_j P[r][j] V[j][voff + c0 ..] for rows r0 .. r0 + NR
// and nb keys: one V vector loaded per (key, column vector) for all NR rows.
template <typename T, int NR, int NC>
inline void pv_rows_block(float* acc, int d, const float* p, const T* const* vr, int64_t voff,
                          int nb, int r0, int c0) {
  vf o[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) o[r][u] = loadf(acc + (r0 + r) * d + c0 + u * kLanes);
  for (int j = 0; j < nb; ++j) {
    vf v[NC];
    for (int u = 0; u < NC; ++u) {
      v[u] = load16(vr[j] + voff + c0 + u * kLanes);
      in_register(v[u]);
    }
    for (int r = 0; r < NR; ++r) {
      const vf pr = splat(p[(r0 + r) * kScoreStride + j]);
      for (int u = 0; u < NC; ++u) o[r][u] += pr * v[u];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) storef(acc + (r0 + r) * d + c0 + u * kLanes, o[r][u]);
}

#if defined(__AVX512BF16__)
// pv_rows_block under bfloat16 products: acc[r][c0 .. c0 + NC vectors) += sum_t
// pair(P[r], t) . pair(V, t)[c0 ..] over n2 key pairs, P the rows' bfloat16 pairs (row_softmax,
// pair p0 + t of row r at probs + r * kScoreStride floats), V the pairs of pack_values.
template <int NR, int NC>
inline void pv_rows_dots_block(float* acc, int d, const float* probs, int p0,
                               const uint32_t* vpair, int n2, int r0, int c0) {
  __m512 o[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) o[r][u] = _mm512_loadu_ps(acc + (r0 + r) * d + c0 + u * kLanes);
  for (int t = 0; t < n2; ++t) {
    __m512bh v[NC];
    for (int u = 0; u < NC; ++u) {
      v[u] = as_bh(_mm512_loadu_si512(vpair + t * d + c0 + u * kLanes));
      in_register(v[u]);
    }
    for (int r = 0; r < NR; ++r) {
      const uint32_t pair = load_u32(probs + (r0 + r) * kScoreStride + p0 + t);
      const __m512bh b = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int u = 0; u < NC; ++u) o[r][u] = _mm512_dpbf16_ps(o[r][u], b, v[u]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) _mm512_storeu_ps(acc + (r0 + r) * d + c0 + u * kLanes, o[r][u]);
}

template <int NR>
inline void pv_rows_dots(float* acc, int d, const float* probs, int p0, const uint32_t* vpair,
                         int n2, int r0) {
  int c = 0;
  for (; c + 4 * kLanes <= d; c += 4 * kLanes)
    pv_rows_dots_block<NR, 4>(acc, d, probs, p0, vpair, n2, r0, c);
  for (; c < d; c += kLanes) pv_rows_dots_block<NR, 1>(acc, d, probs, p0, vpair, n2, r0, c);
}
#endif

// Rows r0 .. r0 + NR: whole NC-vector column blocks, then single vectors for the rest of d.
template <typename T, int NR, int NC>
inline void pv_rows(float* acc, int d, const float* p, const T* const* vr, int64_t voff, int nb,
                    int r0) {
  int c = 0;
  for (; c + NC * kLanes <= d; c += NC * kLanes)
    pv_rows_block<T, NR, NC>(acc, d, p, vr, voff, nb, r0, c);
  for (; c < d; c += kLanes) pv_rows_block<T, NR, 1>(acc, d, p, vr, voff, nb, r0, c);
}

// acc[r] += P[r] @ V of keys vr[0 .. nb) (pool rows of all kvh heads, head rows row_len apart)
// for the kvh * G rows, row r reading head r / G (int8 rows: their values, unscaled).
template <typename T>
void pv_heads(Scratch& s, int kvh, int G, int d, const float* p, const T* const* vr, int nb) {
  for (int h = 0; h < kvh; ++h) {
    const int64_t voff = int64_t(h) * row_len<T>(d);
    // NR x NC accumulators: at most 8 of AVX2's 16 registers, 12 of AVX-512's 32 (each V
    // vector then loaded once per key for 3 rows of d 64)
    constexpr int kCols3 = kLanes == 16 ? 4 : 2;
    int r = h * G;
    for (; r + 3 <= (h + 1) * G; r += 3) pv_rows<T, 3, kCols3>(s.acc, d, p, vr, voff, nb, r);
    for (; r + 2 <= (h + 1) * G; r += 2) pv_rows<T, 2, 4>(s.acc, d, p, vr, voff, nb, r);
    if (r < (h + 1) * G) pv_rows<T, 1, 4>(s.acc, d, p, vr, voff, nb, r);
  }
}

// The kvh * G rows loaded in s (queries in s.qr; row r reads KV head r / G) against keys
// slots[0 .. n), n <= kChunk: s.m, s.l and s.acc [R][d] as `attend` leaves them. G counts a
// head's rows of all the item's query positions; row r sees keys [seen[2p], seen[2p + 1]) of
// the chunk, p = (r % G) / group its position (seen null: one position seeing every key).
template <typename T>
void attend_heads(Scratch& s, int kvh, int G, int group, int d, const T* kp, const T* vp,
                  const int64_t* slots, int n, const int32_t* seen, float cap, bool dots) {
  const int R = kvh * G;
  float* sc = s.scores;  // [R][kScoreStride]
  std::memset(s.acc, 0, sizeof(float) * R * d);
  if (n <= 0) {
    for (int r = 0; r < R; ++r) {
      s.m[r] = -std::numeric_limits<float>::infinity();
      s.l[r] = 0.0f;
    }
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dots) heads_scores_dots(s, kvh, G, d, kp, vp, slots, n, sc);
    else heads_scores<T>(s, kvh, G, d, kp, vp, slots, n, sc);
  } else
#endif
#if SGL_Q8_DOTS
  if constexpr (std::is_same_v<T, Q8>) {
    heads_scores_q8(s, kvh, G, d, kp, vp, slots, n, sc);
  } else
#endif
  {
    heads_scores<T>(s, kvh, G, d, kp, vp, slots, n, sc);
  }
  for (int r = 0; r < R; ++r) {
    const int p = (r % G) / group;
    row_softmax(s, r, n, seen ? seen[2 * p] : 0, seen ? seen[2 * p + 1] : n, cap, dots, sc);
  }
  const int64_t width = int64_t(kvh) * d;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dots) {  // bfloat16 pairs of keys: each head's V pairs packed once for all its rows
      for (int j0 = 0; j0 < n; j0 += kTile) {
        const int nb = std::min(kTile, n - j0), n2 = (nb + 1) / 2;
        for (int h = 0; h < kvh; ++h) {
          pack_values(s.vpair, vp + int64_t(h) * d, slots + j0, nb, d, width);
          const int p0 = j0 / 2, end = (h + 1) * G;
          int r = h * G;
          for (; r + 4 <= end; r += 4) pv_rows_dots<4>(s.acc, d, sc, p0, s.vpair, n2, r);
          switch (end - r) {
            case 3: pv_rows_dots<3>(s.acc, d, sc, p0, s.vpair, n2, r); break;
            case 2: pv_rows_dots<2>(s.acc, d, sc, p0, s.vpair, n2, r); break;
            case 1: pv_rows_dots<1>(s.acc, d, sc, p0, s.vpair, n2, r); break;
            default: break;
          }
        }
      }
      return;
    }
  }
#endif
  const int64_t stride = kvh * row_len<T>(d);
  if constexpr (std::is_same_v<T, Q8>) {
    // each V row's scale moved onto its probabilities (l already holds their sum): P @ V then
    // takes the int8 values as they are stored, with no float32 copy of the rows (as 16-bit
    // integer products with AVX512-VNNI, else widened to float32 as it multiplies)
    float* vs = s.sp;  // [kChunk + kLanes]: one head's V scales (sp is free here)
    for (int h = 0; h < kvh; ++h) {
      const int64_t off = int64_t(h) * row_len<Q8>(d);
      for (int j = 0; j < n; ++j) vs[j] = q8_scale(vp + slots[j] * stride + off, d);
      for (int j = n; j % kLanes; ++j) vs[j] = 0.0f;
      for (int r = h * G; r < (h + 1) * G; ++r) {
#if SGL_Q8_DOTS
        q8_probs(s, r, n, vs, sc);
#else
        for (int j = 0; j < n; j += kLanes)
          storef(sc + r * kScoreStride + j, loadf(sc + r * kScoreStride + j) * loadf(vs + j));
#endif
      }
    }
#if SGL_Q8_DOTS
    pv_heads_q8(s, kvh, G, d, sc, vp, slots, n);
    return;
#endif
  }
  for (int j0 = 0; j0 < n; j0 += kTile) {
    const int nb = std::min(kTile, n - j0);
    const T* vr[kTile];
    for (int j = 0; j < nb; ++j) vr[j] = vp + slots[j0 + j] * stride;
    pv_heads<T>(s, kvh, G, d, sc + j0, vr, nb);
  }
}

// Run f(i) for i in [0, n) on torch's intra-op threads, handing out items dynamically
// (items differ in cost: causal blocks, ragged contexts).
template <typename F>
void for_each_item(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i);
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu(), "paged_attention_cpu: CPU only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes(),
              "paged_attention_cpu: q [T, H, d], pools [slots, kvh, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention_cpu: q must be float32 or bfloat16, got ", q.scalar_type());
  const bool q8 = k_pool.scalar_type() == at::kChar;
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == q.scalar_type() ||
                   k_pool.scalar_type() == at::kFloat8_e5m2 || q8 ||
                   (q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kBFloat16)),
              "paged_attention_cpu: the pools must share q's dtype, or be float8_e5m2 or int8 "
              "head rows, or bfloat16 under float32 q; got q ", q.scalar_type(), ", k_pool ",
              k_pool.scalar_type(), ", v_pool ", v_pool.scalar_type());
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(),
              "paged_attention_cpu: pools must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "paged_attention_cpu: q's last dim must be contiguous");
  const int64_t d = q.size(2), kvh = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == (q8 ? d + 2 : d) && d % kLanes == 0 && d <= 512,
              "paged_attention_cpu: head_dim must be a multiple of 16, at most 512, got ", d);
  TORCH_CHECK(q.size(1) % kvh == 0 && q.size(1) / kvh <= kMaxRows,
              "paged_attention_cpu: query heads must be a multiple of KV heads");
}

// f(TQ{}, TKV{}) for q's and the pools' element types, as check_inputs admits them.
template <typename F>
void dispatch_types(const at::Tensor& q, const at::Tensor& k_pool, const F& f) {
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  if (k_pool.scalar_type() == at::kFloat8_e5m2) {
    if (q_bf16) f(at::BFloat16{}, at::Float8_e5m2{});
    else f(float{}, at::Float8_e5m2{});
  } else if (k_pool.scalar_type() == at::kChar) {
    if (q_bf16) f(at::BFloat16{}, Q8{});
    else f(float{}, Q8{});
  } else if (q_bf16) {
    f(at::BFloat16{}, at::BFloat16{});
  } else if (k_pool.scalar_type() == at::kBFloat16) {
    f(float{}, at::BFloat16{});
  } else {
    f(float{}, float{});
  }
}

template <typename TQ, typename TKV>
void extend_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const std::vector<at::Tensor>& slots, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& num_new, const std::vector<int64_t>& prefix_lens,
                 double scale, int64_t window, double cap, bool dots, at::Tensor& out) {
  const int64_t H = q.size(1), d = q.size(2), kvh = k_pool.size(1), G = H / kvh;
  // query tokens per item: rows in whole register tiles when that keeps more than 3/4 of
  // kMaxRows (120 of 128 with AVX2, where a last tile of one row vector would run its loads at
  // one per 4 FMAs; with AVX-512, 96 would not, so items keep 128 rows)
  constexpr int64_t kTileLanes = kTileRows * kLanes;
  const int64_t whole = kMaxRows / kTileLanes * kTileLanes / G;
  const int64_t block = std::max<int64_t>(1, whole * G > kMaxRows * 3 / 4 ? whole : kMaxRows / G);
  struct Item { int64_t seq, head, t0, t1; };
  std::vector<Item> items;
  for (size_t s = 0; s < starts.size(); ++s) {
    TORCH_CHECK(slots[s].scalar_type() == at::kLong && slots[s].is_contiguous() &&
                    slots[s].numel() >= prefix_lens[s] + num_new[s],
                "paged_attention_cpu: sequence ", s, " needs i64 slots for its context");
    for (int64_t t0 = 0; t0 < num_new[s]; t0 += block)
      for (int64_t h = 0; h < kvh; ++h)
        items.push_back({int64_t(s), h, t0, std::min(num_new[s], t0 + block)});
  }
  // the longest walks (last query blocks of long contexts) first
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return prefix_lens[a.seq] + a.t1 > prefix_lens[b.seq] + b.t1;
  });
  const TQ* qp = q.data_ptr<TQ>();
  const TKV* kp = static_cast<const TKV*>(k_pool.data_ptr());
  const TKV* vp = static_cast<const TKV*>(v_pool.data_ptr());
  TQ* op = out.data_ptr<TQ>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float qscale = static_cast<float>(scale), fcap = static_cast<float>(cap);
  const bool round_q = with_dots<TKV>(dots);
  constexpr bool quant_q = std::is_same_v<TKV, Q8>;
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t idx) {
    const Item it = items[idx];
    const int R = static_cast<int>((it.t1 - it.t0) * G);
    const int64_t start = starts[it.seq], prefix = prefix_lens[it.seq];
    Scratch& s = scratch(static_cast<int>(d));
    for (int r = 0; r < R; ++r) s.qpos[r] = static_cast<int32_t>(prefix + it.t0 + r / G);
    load_rows<TQ>(s, R, d, qscale, round_q, quant_q, [&](int r) {
      return qp + (start + it.t0 + r / G) * qs0 + (it.head * G + r % G) * qs1;
    });
    Keys keys{slots[it.seq].template data_ptr<int64_t>(), 0, prefix + it.t1, 0};
    attend_rows<TKV>(s, R, d, kp + it.head * row_len<TKV>(d), vp + it.head * row_len<TKV>(d),
                     kvh * row_len<TKV>(d), keys,
                     static_cast<int32_t>(window), fcap, dots);
    for (int r = 0; r < R; ++r) {
      const float inv = s.l[r] > 0.0f ? 1.0f / s.l[r] : 0.0f;
      TQ* o = op + ((start + it.t0 + r / G) * H + it.head * G + r % G) * d;
      for (int c = 0; c < d; c += kLanes) store16(o + c, loadf(s.acc + r * d + c) * inv);
    }
  });
}

at::Tensor extend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const std::vector<at::Tensor>& slots, const std::vector<int64_t>& starts,
                  const std::vector<int64_t>& num_new, const std::vector<int64_t>& prefix_lens,
                  double scale, int64_t window, double cap, bool bf16_dots) {
  check_inputs(q, k_pool, v_pool);
  TORCH_CHECK(slots.size() == starts.size() && starts.size() == num_new.size() &&
                  num_new.size() == prefix_lens.size(),
              "paged_attention_cpu.extend: one slots / start / num_new / prefix_len per seq");
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t w = window > 0 ? window : kNoWindow;
  dispatch_types(q, k_pool, [&](auto tq, auto tkv) {
    extend_impl<decltype(tq), decltype(tkv)>(q, k_pool, v_pool, slots, starts, num_new,
                                             prefix_lens, scale, w, cap, bf16_dots, out);
  });
  return out;
}

template <typename TQ, typename TKV>
void decode_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& shared_slots, const at::Tensor& own_slots,
                 const at::Tensor& own_lo, const at::Tensor& own_hi, double scale,
                 int64_t window, double cap, bool dots, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), kvh = k_pool.size(1);
  const int64_t G = H / kvh, Ls = shared_slots.numel();
  const int64_t* lo = own_lo.data_ptr<int64_t>();
  const int64_t* hi = own_hi.data_ptr<int64_t>();
  const int64_t* own = own_slots.data_ptr<int64_t>();
  const int64_t own_len = own_slots.size(1);
  // Verify groups: consecutive rows b0 .. b0 + n - 1 whose own keys are one run read further
  // by each row (a speculative verify's rows of one request: row j holds the keys of row j -
  // 1 plus its own input's). Row b joins its predecessor's run when both start at the same
  // own key, b's keys run at least as far, and the slots the predecessor reads are b's too.
  // A group's items read its keys once for all its rows, each row masked at its own
  // position, instead of once per row.
  //
  // A group's own keys: one item per chunk for all its rows of every KV head (keys in vector
  // lanes: attend_heads) when the GQA groups are small and its rows' heads fit one item,
  // else per KV head (attend, rows in vector lanes). Long runs (more than kMaxRows / H rows)
  // are per head: there the row tiles are the faster form (AVX-512, G = 3, 336 own keys: 16
  // rows 1.3x faster than as all-heads items).
  //
  // Batch invariance: a row's output depends on its query and its context alone, never on the
  // rows beside it (a speculative verify's k + 1 rows give each row the bits a one-row decode
  // gives it, so drafts never change a greedy token). Every path reads the context in chunks
  // at the same key positions (multiples of the chunk from position 0: the caller's shared
  // prefix is a whole number of kChunk keys, and own chunks start where it ends) and computes
  // a chunk's (max, sum, acc) per row with the same instructions in the same order whatever
  // rows share the item; the merge then adds the chunks in position order. With small GQA
  // groups, shared chunks are all-heads items too and long verify groups split into groups of
  // all-heads size, so one function (attend_heads) computes every chunk of every row.
  const bool small_groups = G <= 4 && H <= kMaxRows;
  const int64_t max_heads_group = small_groups ? kMaxRows / H : 0;
  const int64_t max_group = small_groups ? max_heads_group : std::max<int64_t>(1, kMaxRows / G);
  std::vector<int64_t> group_first;
  int64_t run0 = 0;
  for (int64_t b = 1; b <= B; ++b) {
    const bool joins =
        b < B && lo[b] == lo[b - 1] && hi[b] >= hi[b - 1] && b - run0 < max_group &&
        std::equal(own + (b - 1) * own_len + lo[b], own + (b - 1) * own_len + hi[b - 1],
                   own + b * own_len + lo[b]);
    if (!joins) {
      group_first.push_back(run0);
      run0 = b;
    }
  }
  const int64_t num_groups = static_cast<int64_t>(group_first.size());
  group_first.push_back(B);
  std::vector<int64_t> group_of(B);
  for (int64_t grp = 0; grp < num_groups; ++grp)
    for (int64_t b = group_first[grp]; b < group_first[grp + 1]; ++b) group_of[b] = grp;
  auto all_heads = [&](int64_t grp) {
    return group_first[grp + 1] - group_first[grp] <= max_heads_group;
  };
  // Items; each owns R partial rows [m, l, acc[d]] at `part` in the partials buffer. head
  // is -1 for an all-heads item; row0 is the first flat row (sequence x group head) of a
  // shared item, the group of an own item. An all-heads item of a group of M rows holds
  // its query heads head-major: row (h * M + m) * G + g is group head g of KV head h of the
  // group's row m.
  struct Item { int64_t head, row0, rows, k0, k1, part; bool shared; };
  std::vector<Item> items;
  // shared_first[h] .. shared_first[h + 1]: head h's shared-prefix items; own_first[grp * kvh
  // + h] .. [+ 1]: verify group grp's own items holding head h's rows (all-heads items: head
  // 0's range holds them, the other heads' are empty)
  std::vector<int64_t> shared_first(kvh + 1), own_first(num_groups * kvh + 1);
  const int64_t row_floats = d + 2;
  int64_t parts = 0;
  // shared prefix, small groups: all-heads items of up to max_heads_group sequences (head -1,
  // row0 the first sequence; head 0's range holds them), chunks as an own group's. Under a
  // window (which the runner never shares: its rows see different keys) per-head items.
  const bool heads_shared = small_groups && window >= kNoWindow;
  for (int64_t h = 0; h < kvh; ++h) {
    shared_first[h] = static_cast<int64_t>(items.size());
    if (heads_shared) {  // sequence groups of equal size (16 -> 8 + 8, not 14 + 2)
      const int64_t per = (B + (B - 1) / max_heads_group) / ((B - 1) / max_heads_group + 1);
      for (int64_t k0 = 0; h == 0 && k0 < Ls; k0 += kChunk)
        for (int64_t b0 = 0; b0 < B; b0 += per) {
          const int64_t rows = std::min<int64_t>(per, B - b0) * H;
          items.push_back({-1, b0, rows, k0, std::min(Ls, k0 + kChunk), parts, true});
          parts += rows * row_floats;
        }
      continue;
    }
    for (int64_t k0 = 0; k0 < Ls; k0 += kChunk)  // shared prefix: all B * G rows
      for (int64_t r0 = 0; r0 < B * G; r0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, B * G - r0);
        items.push_back({h, r0, rows, k0, std::min(Ls, k0 + kChunk), parts, true});
        parts += rows * row_floats;
      }
  }
  shared_first[kvh] = static_cast<int64_t>(items.size());
  for (int64_t grp = 0; grp < num_groups; ++grp) {
    const int64_t b0 = group_first[grp], last = group_first[grp + 1] - 1;
    const bool heads = all_heads(grp);
    // a window hides the keys before hi - window (the query sits at own key hi - 1), for
    // every row of the group from its first row's on; items mask the rest per row
    const int64_t first = std::max(lo[b0], hi[b0] - window);
    for (int64_t h = 0; h < kvh; ++h) {
      own_first[grp * kvh + h] = static_cast<int64_t>(items.size());
      if (heads && h > 0) continue;
      for (int64_t k0 = first; k0 < hi[last]; k0 += kChunk) {
        const int64_t rows = (last - b0 + 1) * (heads ? H : G);
        items.push_back({heads ? -1 : h, grp, rows, k0, std::min(hi[last], k0 + kChunk), parts,
                         false});
        parts += rows * row_floats;
      }
    }
  }
  own_first[num_groups * kvh] = static_cast<int64_t>(items.size());
  at::Tensor partials = at::empty({std::max<int64_t>(parts, 1)}, q.options().dtype(at::kFloat));
  float* pp = partials.data_ptr<float>();
  const TQ* qp = q.data_ptr<TQ>();
  const TKV* kp = static_cast<const TKV*>(k_pool.data_ptr());
  const TKV* vp = static_cast<const TKV*>(v_pool.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t* shared = Ls ? shared_slots.data_ptr<int64_t>() : nullptr;
  const float qscale = static_cast<float>(scale), fcap = static_cast<float>(cap);
  // bfloat16 products: the base-2 softmax everywhere, and the own-key items of small GQA
  // groups (keys in lanes) take each score as the row tiles' chain of pair products and
  // multiply V by the probabilities rounded as those tiles' pairs hold them, so a key's score
  // and probability have the same bits on every path
  const bool dots_on = with_dots<TKV>(dots);
  constexpr bool quant_q = std::is_same_v<TKV, Q8>;
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t idx) {
    const Item it = items[idx];
    const int R = static_cast<int>(it.rows);
    Scratch& s = scratch(static_cast<int>(d));
    if (it.head < 0 && it.shared) {  // all heads of sequences it.row0 .., a shared chunk
      const int64_t b0 = it.row0, M = it.rows / H;
      load_rows<TQ>(s, R, d, qscale, dots_on, quant_q, [&](int r) {
        const int64_t h = r / (M * G), m = r / G % M, g = r % G;
        return qp + (b0 + m) * qs0 + (h * G + g) * qs1;
      });
      attend_heads<TKV>(s, static_cast<int>(kvh), static_cast<int>(M * G), static_cast<int>(G),
                        static_cast<int>(d), kp, vp, shared + it.k0,
                        static_cast<int>(it.k1 - it.k0), nullptr, fcap, dots_on);
    } else if (it.head < 0) {  // all heads of group it.row0's rows, its own keys
      const int64_t b0 = group_first[it.row0], M = group_first[it.row0 + 1] - b0;
      int32_t seen[2 * kMaxRows];  // per row m of the group: the chunk keys it sees
      for (int64_t m = 0; m < M; ++m) {
        const int64_t first = std::max(lo[b0 + m], hi[b0 + m] - window);
        seen[2 * m] = static_cast<int32_t>(std::max<int64_t>(first - it.k0, 0));
        seen[2 * m + 1] = static_cast<int32_t>(std::min(hi[b0 + m], it.k1) - it.k0);
      }
      load_rows<TQ>(s, R, d, qscale, dots_on, quant_q, [&](int r) {
        const int64_t h = r / (M * G), m = r / G % M, g = r % G;
        return qp + (b0 + m) * qs0 + (h * G + g) * qs1;
      });
      attend_heads<TKV>(s, static_cast<int>(kvh), static_cast<int>(M * G), static_cast<int>(G),
                        static_cast<int>(d), kp, vp, own + (b0 + M - 1) * own_len + it.k0,
                        static_cast<int>(it.k1 - it.k0), M > 1 ? seen : nullptr, fcap,
                        dots_on);
    } else {
      // row r of the item: shared items' flat row it.row0 + r = sequence b, group head g;
      // own items' row r = group head r % G of the group's sequence r / G
      const int64_t row0 = it.shared ? it.row0 : group_first[it.row0] * G;
      for (int r = 0; r < R; ++r) {
        const int64_t b = (row0 + r) / G;
        s.qpos[r] = static_cast<int32_t>(Ls + hi[b] - 1);
      }
      load_rows<TQ>(s, R, d, qscale, dots_on, quant_q, [&](int r) {
        const int64_t b = (row0 + r) / G, g = (row0 + r) % G;
        return qp + b * qs0 + (it.head * G + g) * qs1;
      });
      // a group's keys: its last row's, the longest run
      Keys keys = it.shared ? Keys{shared, it.k0, it.k1, 0}
                            : Keys{own + (group_first[it.row0 + 1] - 1) * own_len, it.k0,
                                   it.k1, Ls};
      attend_rows<TKV>(s, R, d, kp + it.head * row_len<TKV>(d),
                       vp + it.head * row_len<TKV>(d), kvh * row_len<TKV>(d), keys,
                       static_cast<int32_t>(window), fcap, dots);
    }
    float* part = pp + it.part;
    for (int r = 0; r < R; ++r) {
      part[r * row_floats] = s.m[r];
      part[r * row_floats + 1] = s.l[r];
      std::memcpy(part + r * row_floats + 2, s.acc + r * d, sizeof(float) * d);
    }
  });
  // merge: per (sequence, kv head), its shared-prefix partials and its own ones
  const float neg_inf = -std::numeric_limits<float>::infinity();
  TQ* op = out.data_ptr<TQ>();
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(d);
    std::vector<const float*> rows;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kvh, h = bh % kvh;
      // this head's rows within its verify group's own items
      const int64_t grp = group_of[b], m = b - group_first[grp];
      const int64_t M = group_first[grp + 1] - group_first[grp];
      const int64_t own_at = all_heads(grp) ? grp * kvh : grp * kvh + h;
      const int64_t own_row0 = all_heads(grp) ? (h * M + m) * G : m * G;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = b * G + g;
        rows.clear();
        const int64_t shared_at = heads_shared ? 0 : h;
        for (int64_t i = shared_first[shared_at]; i < shared_first[shared_at + 1]; ++i) {
          const Item& it = items[i];  // shared items: the row group holding row
          if (it.head < 0) {  // sequences it.row0 .. + Ms, all heads, head-major
            const int64_t Ms = it.rows / H;
            if (b >= it.row0 && b < it.row0 + Ms)
              rows.push_back(pp + it.part + ((h * Ms + b - it.row0) * G + g) * row_floats);
          } else if (row >= it.row0 && row < it.row0 + it.rows) {
            rows.push_back(pp + it.part + (row - it.row0) * row_floats);
          }
        }
        for (int64_t i = own_first[own_at]; i < own_first[own_at + 1]; ++i)
          rows.push_back(pp + items[i].part + (own_row0 + g) * row_floats);
        float M = neg_inf;
        for (const float* part : rows) M = std::max(M, part[0]);
        float Lsum = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (const float* part : rows) {
          if (part[0] == neg_inf) continue;
          // whole maxima under bfloat16 products (the base-2 softmax)
          const float w = dots_on ? std::ldexp(1.0f, static_cast<int>(part[0] - M))
                                : std::exp(part[0] - M);
          Lsum += part[1] * w;
          for (int64_t c = 0; c < d; ++c) o[c] += part[2 + c] * w;
        }
        const float inv = Lsum > 0.0f ? 1.0f / Lsum : 0.0f;
        TQ* dst = op + (b * H + h * G + g) * d;
        for (int64_t c = 0; c < d; c += kLanes) store16(dst + c, loadf(o.data() + c) * inv);
      }
    }
  });
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& shared_slots, const at::Tensor& own_slots,
                  const at::Tensor& own_lo, const at::Tensor& own_hi, double scale,
                  int64_t window, double cap, bool bf16_dots) {
  check_inputs(q, k_pool, v_pool);
  const int64_t B = q.size(0);
  for (const at::Tensor* t : {&shared_slots, &own_slots, &own_lo, &own_hi})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention_cpu.decode: slot and length tensors must be contiguous i64");
  TORCH_CHECK(own_slots.dim() == 2 && own_slots.size(0) == B && own_lo.numel() == B &&
                  own_hi.numel() == B,
              "paged_attention_cpu.decode: own_slots [B, Lown], own_lo / own_hi [B]");
  at::Tensor out = at::empty({B, q.size(1), q.size(2)}, q.options());
  const int64_t w = window > 0 ? window : kNoWindow;
  dispatch_types(q, k_pool, [&](auto tq, auto tkv) {
    decode_impl<decltype(tq), decltype(tkv)>(q, k_pool, v_pool, shared_slots, own_slots,
                                             own_lo, own_hi, scale, w, cap, bf16_dots, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused paged attention for CPUs (sgl_tpu torch-cpu-fused backend)";
  m.def("extend", &extend, "EXTEND: packed new tokens of ragged sequences over the paged pool");
  m.def("decode", &decode, "DECODE: one query per sequence; shared prefix read once");
  // `decode` as a pointer, for layer_ops_cpu.cpp's decode layer loop (another module); the
  // capsule name carries the signature it checks
  m.attr("decode_fn") = py::capsule(
      reinterpret_cast<void*>(&decode),
      "sgl_tpu.attention_decode(q, k_pool, v_pool, shared_slots, own_slots, own_lo, own_hi, "
      "scale, window, cap, bf16_dots)");
  // whether bf16_dots can take effect (AVX512-BF16 build; a bfloat16 pool)
  m.attr("bf16_dots") = kDots;
  // whether an int8 pool's products are integer instructions (AVX512-VNNI: the scores'
  // `vpdpbusd`, and 16-bit probabilities times V in the all-heads decode items)
  m.attr("q8_dots") = static_cast<bool>(SGL_Q8_DOTS);
  // keys per DECODE chunk: a shared prefix of whole chunks keeps every row batch-invariant
  m.attr("decode_chunk_keys") = kChunk;
}
