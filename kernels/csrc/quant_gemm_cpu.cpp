// Weight-only quantized GEMM for CPUs with float32 activations, for decode-sized row counts:
// the compiled half of kernels/quant_gemm_cpu.py (kernels/cpu_extension.py builds it). The
// second half of the file (`*_a8`, `--quantization gguf-a8`) quantizes the activations to int8
// per block first and takes integer block dots, as llama.cpp does on CPUs.
//
// Dimensions: M activation rows (1 .. 32 in the runner, 64 for a8), K input features, N output
// features, G = 32 (one block of weights of one output row along K), nb = K / G.
//
//     x      f32[M, K]          activations, row-major
//     Q4     qs u8[N, nb, 16]   byte t holds weight 2t (low nibble) and 2t + 1 (high) of
//                               its block
//            scale f32[N, nb], zero f32[N, nb]      w = (q - 8) * scale + zero
//     Q8     qs i8[N, nb, 32], scale f32[N, nb]     w = q * scale
//     y      f32[M, N]          y = x @ w.T
//
// The weights stay exactly what the blocks store: each block's codes are widened to float32
// in registers (0..15 or -128..127, exact), multiplied with the activations and accumulated in
// float32, then the block's sum is scaled:
//
//     y[m, n] = sum_b scale[n, b] * sum_j x[m, bG + j] q[n, bG + j]
//             + sum_b (zero[n, b] - 8 scale[n, b]) * xsum[m, b]   (Q4 only; xsum = the
//                                                                  activations' block sums)
//
// which is sum_k x w with the stored w (only the float32 summation order differs from a
// dense GEMV; the zero term is summed as zero * xsum and -8 scale * xsum, so zero - 8 scale is
// never rounded). Every row runs the same operations whatever M is: a row's result does not
// depend on the rows beside it. Each output row's blocks are read once for all M rows: the rows
// are processed in tiles of up to 8 (accumulators in registers; each block's codes widened once
// per tile) inside the loop over output features, so a later tile finds the row's bytes in L1.
// Output features are split over torch's threads (at::parallel_for). AVX-512 intrinsics where
// the build has them (16 float lanes: a block is two vectors), else AVX2 + FMA (8 lanes, four
// vectors per block), else a scalar loop. The int8-activation kernels below use AVX512-VNNI
// where the build has it (a pair of blocks per `vpdpbusd`), else AVX2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SGL_QGEMM_AVX2 1
#else
#define SGL_QGEMM_AVX2 0
#endif
#if SGL_QGEMM_AVX2 && defined(__AVX512F__)
#define SGL_QGEMM_AVX512 1
#else
#define SGL_QGEMM_AVX512 0
#endif
#if SGL_QGEMM_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SGL_QGEMM_VNNI 1
#else
#define SGL_QGEMM_VNNI 0
#endif
// The int8-activation tile kernels with 256-bit vectors (8 features per vector), on builds
// without AVX-512 (F16C for the tiles' float16 scales). Their dot product, in order of choice:
//   AVX-VNNI (-mavxvnni, __AVXVNNI__): VEX `vpdpbusd ymm` (_mm256_dpbusd_avx_epi32)
//   SGL_TPU_VNNI256_EVEX (the avx2-vnni build on a CPU with AVX512-VNNI + VL but no AVX-VNNI,
//     cpu_extension.py): EVEX `vpdpbusd ymm` (_mm256_dpbusd_epi32, the same operation), in
//     functions compiled for that target alone; everything else stays AVX2
//   else AVX2: `vpmaddubsw` + `vpmaddwd` (exact: the 256-bit tile kernels below say why)
#if SGL_QGEMM_AVX2 && !SGL_QGEMM_AVX512 && defined(__F16C__)
#define SGL_QGEMM_T256 1
#else
#define SGL_QGEMM_T256 0
#endif
#if SGL_QGEMM_T256 && defined(__AVXVNNI__)
#define SGL_QGEMM_T256_DOT "vpdpbusd-ymm-vex"
#define SGL_QGEMM_T256_VNNI 1
#define SGL_QGEMM_T256_TARGET
#elif SGL_QGEMM_T256 && defined(SGL_TPU_VNNI256_EVEX)
#define SGL_QGEMM_T256_DOT "vpdpbusd-ymm-evex"
#define SGL_QGEMM_T256_VNNI 1
#define SGL_QGEMM_T256_TARGET __attribute__((target("avx512vl,avx512vnni")))
#elif SGL_QGEMM_T256
#define SGL_QGEMM_T256_DOT "vpmaddubsw-ymm"
#define SGL_QGEMM_T256_VNNI 0
#define SGL_QGEMM_T256_TARGET
#endif

namespace {

constexpr int64_t kGroup = 32;
// Activation rows whose accumulators live in registers: the float32 kernels' and the int8
// kernels' (whose unpacked codes of 8 blocks take most registers already).
// (With AVX512-VNNI the int8 kernels unpack one block pair at a time: 8 rows fit.)
constexpr int kRowTile = 8;
constexpr int kRowTileA8 = SGL_QGEMM_VNNI ? 8 : 4;
constexpr int64_t kGrain = 16;    // output features per parallel task, at least
// Float lanes of the float32 kernels' vectors. The Q4 kernel's activations are stored in
// nibble order per 2 * kLanes values (`nibble_order`): 8 code bytes per half block with AVX2
// (and the scalar loop), all 16 of a block with AVX-512.
constexpr int kLanes = SGL_QGEMM_AVX512 ? 16 : 8;

struct Q4 {
  const uint8_t* qs;    // [N, nb, 16]
  const float* scale;   // [N, nb]
  const float* zero;    // [N, nb]
};
struct Q8 {
  const int8_t* qs;     // [N, nb, 32]
  const float* scale;   // [N, nb]
};

#if SGL_QGEMM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen8(__m128i codes) {  // the low 8 signed bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
}

// One block's 32 weights of one output row times R activation rows, added to acc[r] after
// scaling: acc[r] += scale * sum_j x[r][j] w[j] (lane-wise partial sums). Five float
// operations per row and block (one multiply, four FMAs in one chain): the rows' kernels are
// bound by the float units at 8 rows, and the chains of successive blocks overlap (only the
// last FMA depends on the previous block).
template <int R>
inline void block_fma(const float* x, int64_t K, __m256 w0, __m256 w1, __m256 w2, __m256 w3,
                      __m256 scale, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xr), w0);
    a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, a);
    a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, a);
    a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, a);
    acc[r] = _mm256_fmadd_ps(scale, a, acc[r]);
  }
}
#endif

#if SGL_QGEMM_AVX512
// block_fma with 16 lanes: a block's 32 weights are two vectors, so three float operations per
// row and block (one multiply, one FMA, the scaled FMA into acc[r]) instead of five.
template <int R>
inline void block_fma16(const float* x, int64_t K, __m512 w0, __m512 w1, __m512 scale,
                        __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xr), w0);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, a);
    acc[r] = _mm512_fmadd_ps(scale, a, acc[r]);
  }
}

// q4_zero_lanes (below) with 16 blocks per vector and a masked load for the last nb % 16.
template <int R>
inline void q4_zero_lanes16(const float* xsum, const float* scale, const float* zero,
                            int64_t nb, __m512* acc) {
  const __m512 minus8 = _mm512_set1_ps(-8.0f);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const int64_t left = nb - b;  // lanes past the last block load as 0 and add 0
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 z = _mm512_maskz_loadu_ps(mask, zero + b);
    const __m512 s8 = _mm512_mul_ps(minus8, _mm512_maskz_loadu_ps(mask, scale + b));
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_maskz_loadu_ps(mask, xsum + r * nb + b);
      acc[r] = _mm512_fmadd_ps(s8, xs, _mm512_fmadd_ps(z, xs, acc[r]));
    }
  }
}
#endif

// zacc[r] = sum_b (zero_b xsum[r, b] - 8 scale_b xsum[r, b]): the Q4 zero terms of R rows,
// summed as zero * xsum and -8 scale * xsum so that zero - 8 scale is never rounded. The
// scalar kernels' form (builds without AVX2); the AVX2 kernels start their accumulators with
// the same terms instead (q4_zero_lanes, below).
template <int R>
inline void q4_zero_terms(const float* xsum, const float* scale, const float* zero, int64_t nb,
                          float* zacc) {
  for (int r = 0; r < R; ++r) {
    zacc[r] = 0.0f;
    for (int64_t t = 0; t < nb; ++t) {
      zacc[r] = std::fma(zero[t], xsum[r * nb + t], zacc[r]);
      zacc[r] = std::fma(-8.0f * scale[t], xsum[r * nb + t], zacc[r]);
    }
  }
}

#if SGL_QGEMM_AVX2
// acc[r] = the Q4 zero terms of row r (q4_zero_terms' sum) as 8 lane-wise partial sums, 8
// blocks per vector, the last nb % 8 blocks a masked vector, not a scalar loop. The
// kernels start their accumulators with these, so one horizontal sum per row covers both: at
// 8 rows and K = 576, 8 horizontal sums and 32 scalar FMA pairs fewer per output feature. (At
// the start, this chain of FMAs overlaps the first blocks' products; added after the last
// block it waited on that block's FMA, slower at 1 row. A separate vector per row instead
// took 8 more registers at 8 rows and lost the gain there. README, "Float32 activations".)
template <int R>
inline void q4_zero_lanes(const float* xsum, const float* scale, const float* zero, int64_t nb,
                          __m256* acc) {
  const __m256 minus8 = _mm256_set1_ps(-8.0f);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b += 8) {
    const int64_t left = nb - b;
    __m256 z, s, xs[R];
    if (left >= 8) {
      z = _mm256_loadu_ps(zero + b);
      s = _mm256_loadu_ps(scale + b);
      for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(xsum + r * nb + b);
    } else {  // lanes past the last block load as 0 and add 0
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      z = _mm256_maskload_ps(zero + b, mask);
      s = _mm256_maskload_ps(scale + b, mask);
      for (int r = 0; r < R; ++r) xs[r] = _mm256_maskload_ps(xsum + r * nb + b, mask);
    }
    const __m256 s8 = _mm256_mul_ps(minus8, s);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(s8, xs[r], _mm256_fmadd_ps(z, xs[r], acc[r]));
  }
}
#endif

// y[r, n] for r < R: output feature n (its blocks at `qs`, `scale`, `zero`) of R rows of x.
// `xp` is x with each block's values in nibble order (`nibble_order`): byte t of a block holds
// weights 2t (low nibble) and 2t + 1 (high), so kLanes bytes zero-extended to int32 lanes give
// the even weights of 2 kLanes (mask) and the odd ones (shift), and the activations are stored
// to match: with AVX2 per half block [x0 x2 .. x14 | x1 x3 .. x15], with AVX-512 per block
// [x0 x2 .. x30 | x1 x3 .. x31]. The -8 is applied to the block sums:
// sum_j x_j (q_j - 8) = sum_j x_j q_j - 8 xsum. (Zero-extending bytes takes 10 vector
// operations per block, broadcasting 32-bit words and shifting each lane by its own count 16:
// 1.02x per batch-1 decode step, the same at 8 rows; README, "Float32 activations".)
template <int R>
void q4_rows(const float* xp, int64_t K, const float* xsum, const uint8_t* qs,
             const float* scale, const float* zero, float* y, int64_t N) {
  const int64_t nb = K / kGroup;
#if SGL_QGEMM_AVX512
  __m512 acc[R];
  q4_zero_lanes16<R>(xsum, scale, zero, nb, acc);
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16)));
    block_fma16<R>(xp + b * kGroup, K, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)),
                   _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)),
                   _mm512_set1_ps(scale[b]), acc);
  }
  for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
#elif SGL_QGEMM_AVX2
  __m256 acc[R];
  q4_zero_lanes<R>(xsum, scale, zero, nb, acc);
  const __m256i low = _mm256_set1_epi32(0x0F);
  auto codes = [low](const uint8_t* q, __m256* w) {  // one block's 32 codes, nibble order
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
      w[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
      w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  };
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    codes(qs + b * 16, w);
    block_fma<R>(xp + b * kGroup, K, w[0], w[1], w[2], w[3], _mm256_set1_ps(scale[b]), acc);
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]);
#else
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * 16;
    for (int r = 0; r < R; ++r) {
      const float* xr = xp + r * K + b * kGroup;
      float s = 0.0f;
      for (int j = 0; j < kGroup; ++j) {  // nibble order: xr[j] multiplies byte kLanes h + i
        const int h = j / (2 * kLanes), i = j % kLanes, odd = (j / kLanes) % 2;
        s += xr[j] * float((q[kLanes * h + i] >> (4 * odd)) & 0x0F);
      }
      acc[r] += scale[b] * s;
    }
  }
  float zacc[R];
  q4_zero_terms<R>(xsum, scale, zero, nb, zacc);
  for (int r = 0; r < R; ++r) y[r * N] = acc[r] + zacc[r];
#endif
}

// x f32[M, K] -> the same values with each block in the Q4 kernel's nibble order (per
// 2 kLanes values: the kLanes even-indexed ones, then the odd ones), and the block sums
// xsum[M, nb].
void nibble_order(const float* x, int64_t M, int64_t K, float* xp, float* xsum) {
  for (int64_t i = 0; i < M * (K / kGroup); ++i) {  // i = m * nb + b
    const float* xb = x + i * kGroup;
    float* pb = xp + i * kGroup;
    float s = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) s += xb[j];
    for (int h = 0; h < kGroup / (2 * kLanes); ++h) {
      for (int t = 0; t < kLanes; ++t) {
        pb[2 * kLanes * h + t] = xb[2 * kLanes * h + 2 * t];
        pb[2 * kLanes * h + kLanes + t] = xb[2 * kLanes * h + 2 * t + 1];
      }
    }
    xsum[i] = s;
  }
}

template <int R>
void q8_rows(const float* x, int64_t K, const int8_t* qs, const float* scale, float* y,
             int64_t N) {
  const int64_t nb = K / kGroup;
#if SGL_QGEMM_AVX512
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * kGroup;
    auto w = [q](int i) {  // 16 signed bytes -> 16 floats
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i))));
    };
    block_fma16<R>(x + b * kGroup, K, w(0), w(1), _mm512_set1_ps(scale[b]), acc);
  }
  for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
#elif SGL_QGEMM_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * kGroup;
    auto w = [q](int i) {
      return widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
    };
    block_fma<R>(x + b * kGroup, K, w(0), w(1), w(2), w(3), _mm256_set1_ps(scale[b]), acc);
  }
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]);
#else
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * kGroup;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * kGroup;
      float s = 0.0f;
      for (int j = 0; j < kGroup; ++j) s += xr[j] * float(q[j]);
      acc[r] += scale[b] * s;
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = acc[r];
#endif
}

// Calls rows<R>(m0, R) for tiles of up to Tile (<= 8) rows covering 0..M.
template <int Tile, typename F>
inline void for_row_tiles(int64_t M, F&& rows) {
  for (int64_t m0 = 0; m0 < M; m0 += Tile) {
    switch (std::min<int64_t>(Tile, M - m0)) {
      case 8: rows(m0, std::integral_constant<int, std::min(8, Tile)>{}); break;
      case 7: rows(m0, std::integral_constant<int, std::min(7, Tile)>{}); break;
      case 6: rows(m0, std::integral_constant<int, std::min(6, Tile)>{}); break;
      case 5: rows(m0, std::integral_constant<int, std::min(5, Tile)>{}); break;
      case 4: rows(m0, std::integral_constant<int, 4>{}); break;
      case 3: rows(m0, std::integral_constant<int, 3>{}); break;
      case 2: rows(m0, std::integral_constant<int, 2>{}); break;
      default: rows(m0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// x f32[M, K] with K a multiple of the block size; returns K.
int64_t check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              op, ": x must be a contiguous float32 CPU matrix [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, op, ": K = ", K, " is not a multiple of ", kGroup);
  return K;
}

int64_t check(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
              int64_t block_bytes, at::ScalarType code_type, const char* op) {
  const int64_t K = check_x(x, op);
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == code_type && qs.is_contiguous() &&
                  qs.size(1) == K / kGroup && qs.size(2) == block_bytes,
              op, ": codes must be contiguous [N, K/32, ", block_bytes, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == qs.size(0) * qs.size(1),
              op, ": scales must be contiguous float32 [N, K/32]");
  return K;
}

// `check` for Q4 blocks, whose zeros share the scales' layout.
int64_t check_q4(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                 const at::Tensor& zero, const char* op) {
  const int64_t K = check(x, qs, scale, 16, at::kByte, op);
  TORCH_CHECK(zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                  zero.numel() == scale.numel(),
              op, ": zeros must be contiguous float32 [N, K/32]");
  return K;
}

at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                   const at::Tensor& zero) {
  const int64_t K = check_q4(x, qs, scale, zero, "q4_gemm");
  const int64_t M = x.size(0), N = qs.size(0), nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  // x in nibble order (a tensor: 64-byte aligned, so no load of 8 floats splits a cache line)
  at::Tensor xp = at::empty({M, K}, x.options());
  std::vector<float> xsum(M * nb);  // [M, nb] the activations' block sums
  nibble_order(x.data_ptr<float>(), M, K, xp.data_ptr<float>(), xsum.data());
  const float* xpp = xp.data_ptr<float>();
  const Q4 w{qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>()};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for_row_tiles<kRowTile>(M, [&](int64_t m0, auto R) {
        q4_rows<decltype(R)::value>(xpp + m0 * K, K, xsum.data() + m0 * nb,
                                    w.qs + n * nb * 16, w.scale + n * nb, w.zero + n * nb,
                                    yp + m0 * N + n, N);
      });
    }
  });
  return y;
}

at::Tensor q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  const int64_t K = check(x, qs, scale, kGroup, at::kChar, "q8_gemm");
  const int64_t M = x.size(0), N = qs.size(0), nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const Q8 w{qs.data_ptr<int8_t>(), scale.data_ptr<float>()};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for_row_tiles<kRowTile>(M, [&](int64_t m0, auto R) {
        q8_rows<decltype(R)::value>(xp + m0 * K, K, w.qs + n * nb * kGroup, w.scale + n * nb,
                                    yp + m0 * N + n, N);
      });
    }
  });
  return y;
}


// ---- int8 activations (`--quantization gguf-a8`, llama.cpp's CPU math) ----------------------
//
// Each activation row is quantized per block of G = 32 values, as llama.cpp's Q8_0 does:
//
//     d[m, b] = max_j |x[m, bG + j]| / 127      id = 1 / d (0 when d = 0)     (float32)
//     xq[m, bG + j] = round_half_even(x[m, bG + j] * id)   in -127..127       (int8)
//     xsum[m, b] = d[m, b] sum_j xq[m, bG + j]   (float32: the Q4 zero term; Q8_1's s)
//
// and each block's dot is an integer one (exact in int32: |q xq| <= 128 * 127 per product):
//
//     Q4: y[m, n] = sum_b scale[n, b] d[m, b] sum_j q[n, bG + j] xq[m, bG + j]      (q 0..15)
//                 + sum_b (zero[n, b] - 8 scale[n, b]) xsum[m, b]
//     Q8: y[m, n] = sum_b scale[n, b] d[m, b] sum_j q[n, bG + j] xq[m, bG + j]      (q signed)
//
// which is the dot of the stored weights with the dequantized activations d xq: the error is
// the activations' rounding (|x - d xq| <= d/2 per value) times the weights. The zero term must
// take the quantized sums too (as llama.cpp's Q8_1 does): with the exact sums x's rounding
// errors meet the codes 0..15 alone, not the centred weights q scale + min: on the default
// model's Q4_1 the mean KL divergence from the float32 model was 4x llama.cpp's, now within 5%
// of it (docs/benchmarks.md, "Instruction-set levels, faithfulness"). AVX2:
// `maddubs` multiplies unsigned by signed bytes and adds pairs to int16 (Q4: 15 * 127 * 2, Q8
// after moving the weight's sign onto the activation: 128 * 127 * 2, both < 2^15, no
// saturation), `madd` with ones widens to 8 int32 sums; the dots of 8 consecutive blocks are
// reduced to one vector (lane = block, exact) and added with one float FMA scaled by the 8
// blocks' scale * d (AVX512-VNNI: a8_pairs_vnni, below). Same tiling, threading and row
// independence as above.
//
// Q4 activation layout: a Q4 block's byte t holds weights 2t and 2t + 1, so the low nibbles of
// the 16 bytes are weights 0, 2, .., 30 and the high nibbles 1, 3, .., 31. The Q4 kernel's
// quantized activations are stored in that order, [x0 x2 .. x30 | x1 x3 .. x31] per block:
// the weights unpack to [low nibbles | high nibbles] with one shift and one mask.

struct ActQ8 {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d;     // [M, nb]
  std::vector<float> sum;   // [M, nb] d * the block's sum of codes (Q4 only)
  std::vector<int32_t> code_sum;  // [M, nb] each block's sum of codes (Q8 tiles only)
  std::vector<float> dpair;  // [M, ceil(nb / 2), 16] (with VNNI: pair_scales)
  std::vector<float> dgroup;  // [M, nb / 16, 16] (Q4 with VNNI: group_scales)
  std::vector<int32_t> bias;  // [M, ceil(nb / 2), 16] (Q8 with VNNI: q8_pair_bias)
};

// One block of kGroup values at `xb` -> its codes at `qb` (`split`: the Q4 order above), its d,
// and where asked (null: not) its sum d * sum(codes) and its code sum. Every loop below gives the same codes,
// d and sums: the vector conversions round half to even, as nearbyint does in the default
// mode.
inline void quantize_block(const float* xb, int8_t* qb, float* d, float* sum, int32_t* code_sum,
                           bool split) {
#if SGL_QGEMM_AVX512
  const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dv = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(dv != 0.0f ? 1.0f / dv : 0.0f);
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
  __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
  if (split) {  // [x0 x2 .. x30 | x1 x3 .. x31]
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i e = _mm512_permutex2var_epi32(q0, even, q1);
    q1 = _mm512_permutex2var_epi32(q0, odd, q1);
    q0 = e;
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
  const int32_t code_total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif SGL_QGEMM_AVX2
  __m256 v[4];
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
  const __m256 m = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
      _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float dv = _mm_cvtss_f32(h) / 127.0f;
  const __m256 id = _mm256_set1_ps(dv != 0.0f ? 1.0f / dv : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
  // int32 -> int8 (|code| <= 127: the packs never saturate); they interleave 128-bit lanes,
  // and the dword permutation restores the natural order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                            _mm256_packs_epi32(q[2], q[3]));
  __m256i codes = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (split) {  // per 128-bit lane the even bytes, then the odd ones; then the halves regrouped
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                                                9, 11, 13, 15);
    codes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(codes, evens_odds), 0xD8);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), codes);
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                     _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  const int32_t code_total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float dv = amax / 127.0f;
  const float id = dv != 0.0f ? 1.0f / dv : 0.0f;
  int32_t code_total = 0;
  for (int64_t j = 0; j < kGroup; ++j) {
    const int64_t to = split ? (j & 1) * (kGroup / 2) + j / 2 : j;
    qb[to] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
    code_total += qb[to];
  }
#endif
  if (sum) *sum = dv * float(code_total);
  if (code_sum) *code_sum = code_total;
  *d = dv;
}

// Row-by-row (each row's values depend on that row only); `split`: the Q4 order above; `sums`:
// the sums d * sum(codes) (Q4), `code_sums`: the code sums (the Q8 tiles).
ActQ8 quantize_rows(const float* x, int64_t M, int64_t K, bool split, bool sums,
                    bool code_sums = false) {
  const int64_t nb = K / kGroup;
  ActQ8 a{std::vector<int8_t>(M * K), std::vector<float>(M * nb),
          std::vector<float>(sums ? M * nb : 0), std::vector<int32_t>(code_sums ? M * nb : 0)};
  at::parallel_for(0, M * nb, std::max<int64_t>(1, 4096 / kGroup), [&](int64_t begin,
                                                                          int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // i = m * nb + b
      quantize_block(x + i * kGroup, a.q.data() + i * kGroup, a.d.data() + i,
                     sums ? a.sum.data() + i : nullptr,
                     code_sums ? a.code_sum.data() + i : nullptr, split);
  });
  return a;
}

#if SGL_QGEMM_AVX2
// 8 int32 lanes of sum u[j] s[j] (u unsigned, s signed bytes), summed in pairs twice.
inline __m256i dot_u8i8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Lane i of the result = the sum of v[i]'s 8 lanes (exact int32): 8 blocks' dots in one vector.
inline __m256i hsum8_epi32(const __m256i* v) {
  // per 128-bit half: [v0 v1 v2 v3] and [v4 v5 v6 v7] sums over that half's lanes
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                      _mm256_hadd_epi32(v[2], v[3]));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                      _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20),
                          _mm256_permute2x128_si256(a, c, 0x31));
}

// Q4 block -> 32 unsigned codes in the order [low nibbles | high nibbles] (one vector).
struct Q4Codes {
  static constexpr int kVecs = 1;
  const uint8_t* qs;  // [nb, 16]
  void load(int64_t b, __m256i* w) const {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    w[0] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                            _mm256_set1_epi8(0x0F));
  }
  static __m256i dot(const __m256i* w, __m256i a) { return dot_u8i8(w[0], a); }
};

// Q8 block -> (|q| as unsigned bytes: -128 -> 128, q): q a = |q| (a with q's sign), and a is
// in -127..127, so its negation fits.
struct Q8Codes {
  static constexpr int kVecs = 2;
  const int8_t* qs;  // [nb, 32]
  void load(int64_t b, __m256i* w) const {
    w[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * kGroup));
    w[0] = _mm256_sign_epi8(w[1], w[1]);
  }
  static __m256i dot(const __m256i* w, __m256i a) {
    return dot_u8i8(w[0], _mm256_sign_epi8(a, w[1]));
  }
};

// acc[r] += lane-wise scale_b d[r, b] dot_b over the blocks of one output feature. Groups of 8
// blocks: the 8 integer dots are reduced to one vector (lane = block) before the single
// convert and FMA with the 8 blocks' scale * d; the remaining blocks one FMA each. The codes
// of a group are unpacked once for the R rows.
template <int R, typename Codes>
inline void a8_rows(const int8_t* xq, const float* xd, int64_t K, const float* scale,
                    const Codes& codes, __m256* acc) {
  const int64_t nb = K / kGroup;
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256i w[8 * Codes::kVecs];
    for (int j = 0; j < 8; ++j) codes.load(b + j, w + j * Codes::kVecs);
    const __m256 s = _mm256_loadu_ps(scale + b);
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + b * kGroup;
      __m256i v[8];
      for (int j = 0; j < 8; ++j) {
        v[j] = Codes::dot(w + j * Codes::kVecs, _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a + j * kGroup)));
      }
      const __m256 sd = _mm256_mul_ps(s, _mm256_loadu_ps(xd + r * nb + b));
      acc[r] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(hsum8_epi32(v)), acc[r]);
    }
  }
  for (; b < nb; ++b) {
    __m256i w[Codes::kVecs];
    codes.load(b, w);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xq + r * K + b * kGroup));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * xd[r * nb + b]),
                               _mm256_cvtepi32_ps(Codes::dot(w, a)), acc[r]);
    }
  }
}
#endif

#if SGL_QGEMM_VNNI
// d of a row's blocks 2p and 2p + 1 as the VNNI kernels' lanes: [d[2p] x 8 | d[2p + 1] x 8]
// (0 past the last block), once per call rather than once per output feature.
std::vector<float> pair_scales(const std::vector<float>& d, int64_t M, int64_t nb) {
  const int64_t pairs = (nb + 1) / 2;
  std::vector<float> out(M * pairs * 16, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      std::fill_n(out.data() + (m * pairs + b / 2) * 16 + (b % 2) * 8, 8, d[m * nb + b]);
  return out;
}

// The VNNI kernels take 16 blocks (8 pairs) at a time: the 8 pairs' int32 dots are reduced to
// one vector with a lane per block (reduce16), in this order of the 16 blocks, and scaled and
// added with one convert and one FMA, instead of one each per pair.
//   lane:   0 1 2 3   4 5 6 7   8  9  10 11   12 13 14 15
//   block:  0 2 4 6   1 3 5 7   8  10 12 14   9  11 13 15
inline __m512i group_order() {
  return _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0);
}

// d of each full group of 16 blocks of a row, in group_order: [M, nb / 16, 16].
std::vector<float> group_scales(const std::vector<float>& d, int64_t M, int64_t nb) {
  const int64_t groups = nb / 16;
  std::vector<float> out(M * groups * 16);
  const __m512i order = group_order();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g)
      _mm512_storeu_ps(out.data() + (m * groups + g) * 16,
                       _mm512_permutexvar_ps(order, _mm512_loadu_ps(d.data() + m * nb + 16 * g)));
  return out;
}

// v[p] = the dots of pair p (lanes 0-7: block 2p, 8-15: block 2p + 1) -> lane i = the sum of
// block group_order[i]'s 8 lanes (exact int32). Per 128-bit lane L: unpack + add twice gives
// [sum of v0's 4 ints in L, v1's, v2's, v3's]; a block's two 128-bit lanes are then added.
inline __m512i reduce16(const __m512i* v) {
  auto pairs32 = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  };
  auto pairs64 = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  };
  const __m512i y0 = pairs64(pairs32(v[0], v[1]), pairs32(v[2], v[3]));  // pairs 0-3
  const __m512i y1 = pairs64(pairs32(v[4], v[5]), pairs32(v[6], v[7]));  // pairs 4-7
  // 128-bit lanes [y0.L0 + y0.L1, y0.L2 + y0.L3, y1.L0 + y1.L1, y1.L2 + y1.L3]
  return _mm512_add_epi32(_mm512_shuffle_i64x2(y0, y1, 0x88), _mm512_shuffle_i64x2(y0, y1, 0xDD));
}

// -128 x (each int32 lane's 4 activations summed) per block pair of each row, the start of the
// VNNI Q8 kernel's dots: it multiplies the codes offset to unsigned (q + 128), so
// sum (q + 128) a - 128 sum a = sum q a, exactly. The pairs' lanes as in a8_pairs_vnni.
std::vector<int32_t> q8_pair_bias(const int8_t* xq, int64_t M, int64_t K) {
  const int64_t nb = K / kGroup, pairs = (nb + 1) / 2;
  std::vector<int32_t> out(M * pairs * 16);
  const __m512i minus128 = _mm512_set1_epi8(static_cast<char>(0x80));  // 128 as unsigned
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < pairs; ++p) {
      const int8_t* a = xq + m * K + 2 * p * kGroup;
      const __m512i av = 2 * p + 1 < nb ? _mm512_loadu_si512(a)
                                        : _mm512_castsi256_si512(_mm256_loadu_si256(
                                              reinterpret_cast<const __m256i*>(a)));
      const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), minus128,
                                              _mm512_maskz_mov_epi64(
                                                  2 * p + 1 < nb ? 0xFF : 0x0F, av));
      _mm512_storeu_si512(out.data() + (m * pairs + p) * 16, _mm512_sub_epi32(
          _mm512_setzero_si512(), sum));
    }
  return out;
}

// Q4 block pair -> 64 unsigned codes: [q_b | q_b+1] (16 code bytes each) -> 128-bit lanes
// [q_b, q_b, q_b+1, q_b+1], the second and fourth shifted: [low nibbles b | high nibbles b |
// low b+1 | high b+1], the order of the Q4 kernel's activations. No bias: codes are 0..15.
struct Q4Pairs {
  // reduce16 groups: measured 1.25x faster at 8 rows, equal at 1 (its unpacking dominates)
  static constexpr bool kGrouped = true;
  const uint8_t* qs;  // [nb, 16]
  __m512i load(int64_t b, bool whole) const {
    const __m256i raw = whole
        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 16))
        : _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16)));
    __m512i w = _mm512_shuffle_i64x2(_mm512_castsi256_si512(raw), _mm512_castsi256_si512(raw),
                                     _MM_SHUFFLE(1, 1, 0, 0));
    w = _mm512_mask_srli_epi16(w, __mmask32(0xFF00FF00u), w, 4);
    w = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
    return whole ? w : _mm512_maskz_mov_epi64(__mmask8(0x0F), w);
  }
};

// Q8 block pair -> 64 codes offset to unsigned (q + 128: the sign bit flipped); the dots start
// from q8_pair_bias to take the offset out.
struct Q8Pairs {
  // pair by pair: with a load and an xor per pair, reduce16 measured 1.4x slower at 1 row
  static constexpr bool kGrouped = false;
  const int8_t* qs;  // [nb, 32]
  __m512i load(int64_t b, bool whole) const {
    const __m512i q = whole ? _mm512_loadu_si512(qs + b * kGroup)
                            : _mm512_castsi256_si512(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(qs + b * kGroup)));
    const __m512i u = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
    return whole ? u : _mm512_maskz_mov_epi64(__mmask8(0x0F), u);
  }
};

// The a8 dots with AVX512-VNNI: `vpdpbusd` multiplies 64 unsigned codes by 64 signed
// activations and adds each 4 products into an int32 lane, so a pair of blocks is one
// instruction per row (lanes 0-7: block b, 8-15: block b + 1; exact, as above), started from
// `bias` (Q8: q8_pair_bias; Q4: none). Each pair's lanes are converted and accumulated into
// acc[r] with one float FMA scaled by [scale[b] d[b] x 8 | scale[b + 1] d[b + 1] x 8] (`dpair`:
// pair_scales); an odd last block runs as a pair with zero codes in its second half. With
// `Pairs::kGrouped`, full groups of 8 pairs go first: their dots are reduced to a lane per
// block (reduce16) and added with one FMA scaled by the 16 blocks' scale * d (`dgroup`:
// group_scales). The choice is per weight format, never per row count: a row's result does
// not depend on M.
template <int R, typename Pairs>
inline void a8_pairs_vnni(const int8_t* xq, const float* dgroup, const float* dpair,
                          const int32_t* bias, int64_t K, const Pairs& codes, const float* scale,
                          __m512* acc) {
  const int64_t nb = K / kGroup, pairs = (nb + 1) / 2, groups = Pairs::kGrouped ? nb / 16 : 0;
  const __m512i order = group_order();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = codes.load(16 * g + 2 * j, true);
    const __m512 s = _mm512_permutexvar_ps(order, _mm512_loadu_ps(scale + 16 * g));
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + 16 * g * kGroup;
      __m512i v[8];
      for (int j = 0; j < 8; ++j) {
        const __m512i start = bias ? _mm512_loadu_si512(bias + (r * pairs + 8 * g + j) * 16)
                                   : _mm512_setzero_si512();
        v[j] = _mm512_dpbusd_epi32(start, w[j], _mm512_loadu_si512(a + 2 * j * kGroup));
      }
      const __m512 sd = _mm512_mul_ps(s, _mm512_loadu_ps(dgroup + (r * groups + g) * 16));
      acc[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(reduce16(v)), acc[r]);
    }
  }
  const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t p = 8 * groups; p < pairs; ++p) {
    const int64_t b = 2 * p;
    const bool whole = b + 1 < nb;
    const __m512i w = codes.load(b, whole);
    const __m128 s2 = whole
        ? _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + b)))
        : _mm_load_ss(scale + b);
    const __m512 s = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(s2));
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + b * kGroup;
      const __m512i av = whole ? _mm512_loadu_si512(a)
                               : _mm512_castsi256_si512(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(a)));
      const __m512i start = bias ? _mm512_loadu_si512(bias + (r * pairs + p) * 16)
                                 : _mm512_setzero_si512();
      const __m512i dot = _mm512_dpbusd_epi32(start, w, av);
      const __m512 sd = _mm512_mul_ps(s, _mm512_loadu_ps(dpair + (r * pairs + p) * 16));
      acc[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(dot), acc[r]);
    }
  }
}
#endif

template <int R>
void q4a8_rows(const int8_t* xq, const float* xd, const float* dgroup, const float* dpair,
               const float* xsum, int64_t K, const uint8_t* qs, const float* scale,
               const float* zero, float* y, int64_t N) {
  const int64_t nb = K / kGroup;
#if SGL_QGEMM_VNNI
  (void)xd;
  __m512 acc[R];
  q4_zero_lanes16<R>(xsum, scale, zero, nb, acc);
  a8_pairs_vnni<R>(xq, dgroup, dpair, nullptr, K, Q4Pairs{qs}, scale, acc);
  for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
#elif SGL_QGEMM_AVX2
  (void)dgroup;
  (void)dpair;
  __m256 acc[R];
  q4_zero_lanes<R>(xsum, scale, zero, nb, acc);
  a8_rows<R>(xq, xd, K, scale, Q4Codes{qs}, acc);
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]);
#else
  (void)dgroup;
  (void)dpair;
  float zacc[R];
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * 16;
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + b * kGroup;  // [even | odd] weights' activations
      int32_t dot = 0;
      for (int t = 0; t < 16; ++t) dot += (q[t] & 0x0F) * a[t] + (q[t] >> 4) * a[16 + t];
      acc[r] += scale[b] * xd[r * nb + b] * float(dot);
    }
  }
  q4_zero_terms<R>(xsum, scale, zero, nb, zacc);
  for (int r = 0; r < R; ++r) y[r * N] = acc[r] + zacc[r];
#endif
}

template <int R>
void q8a8_rows(const int8_t* xq, const float* xd, const float* dgroup, const float* dpair,
               const int32_t* bias, int64_t K, const int8_t* qs, const float* scale, float* y,
               int64_t N) {
  const int64_t nb = K / kGroup;
#if SGL_QGEMM_VNNI
  (void)xd;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  a8_pairs_vnni<R>(xq, dgroup, dpair, bias, K, Q8Pairs{qs}, scale, acc);
  for (int r = 0; r < R; ++r) y[r * N] = _mm512_reduce_add_ps(acc[r]);
#elif SGL_QGEMM_AVX2
  (void)dgroup;
  (void)dpair;
  (void)bias;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  a8_rows<R>(xq, xd, K, scale, Q8Codes{qs}, acc);
  for (int r = 0; r < R; ++r) y[r * N] = hsum(acc[r]);
#else
  (void)dgroup;
  (void)dpair;
  (void)bias;
  float acc[R] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* q = qs + b * kGroup;
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + b * kGroup;
      int32_t dot = 0;
      for (int j = 0; j < kGroup; ++j) dot += int32_t(q[j]) * a[j];
      acc[r] += scale[b] * xd[r * nb + b] * float(dot);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = acc[r];
#endif
}

at::Tensor q4_gemm_a8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                      const at::Tensor& zero) {
  const int64_t K = check_q4(x, qs, scale, zero, "q4_gemm_a8");
  const int64_t M = x.size(0), N = qs.size(0), nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  ActQ8 a = quantize_rows(x.data_ptr<float>(), M, K, /*split=*/true, /*sums=*/true);
#if SGL_QGEMM_VNNI
  a.dpair = pair_scales(a.d, M, nb);
  a.dgroup = group_scales(a.d, M, nb);
#endif
  const int64_t pair_values = (nb + 1) / 2 * 16, group_values = nb / 16 * 16;
  const Q4 w{qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), zero.data_ptr<float>()};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for_row_tiles<kRowTileA8>(M, [&](int64_t m0, auto R) {
        q4a8_rows<decltype(R)::value>(
            a.q.data() + m0 * K, a.d.data() + m0 * nb,
            a.dgroup.empty() ? nullptr : a.dgroup.data() + m0 * group_values,
            a.dpair.empty() ? nullptr : a.dpair.data() + m0 * pair_values,
            a.sum.data() + m0 * nb, K, w.qs + n * nb * 16, w.scale + n * nb, w.zero + n * nb,
            yp + m0 * N + n, N);
      });
    }
  });
  return y;
}

at::Tensor q8_gemm_a8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale) {
  const int64_t K = check(x, qs, scale, kGroup, at::kChar, "q8_gemm_a8");
  const int64_t M = x.size(0), N = qs.size(0), nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  ActQ8 a = quantize_rows(x.data_ptr<float>(), M, K, /*split=*/false, /*sums=*/false);
#if SGL_QGEMM_VNNI
  a.dpair = pair_scales(a.d, M, nb);
  a.bias = q8_pair_bias(a.q.data(), M, K);
#endif
  const int64_t pair_values = (nb + 1) / 2 * 16;
  const Q8 w{qs.data_ptr<int8_t>(), scale.data_ptr<float>()};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for_row_tiles<kRowTileA8>(M, [&](int64_t m0, auto R) {
        q8a8_rows<decltype(R)::value>(
            a.q.data() + m0 * K, a.d.data() + m0 * nb, /*dgroup=*/nullptr,
            a.dpair.empty() ? nullptr : a.dpair.data() + m0 * pair_values,
            a.bias.empty() ? nullptr : a.bias.data() + m0 * pair_values, K,
            w.qs + n * nb * kGroup, w.scale + n * nb, yp + m0 * N + n, N);
      });
    }
  });
  return y;
}

#if SGL_QGEMM_VNNI || SGL_QGEMM_T256
// ---- int8 activations, 16 output features per vector (AVX512-VNNI, N % 16 == 0) ------------
//
// The same math as q4_gemm_a8 / q8_gemm_a8, on weights stored in tiles of 16 output features
// (quant_gemm_cpu.py `pack_q4_tiles` / `pack_q8_tiles`): a vector's 32-bit lane f holds 4
// consecutive codes of feature f, so one `vpdpbusd` multiplies them by 4 activations broadcast
// to every lane and adds 16 features' dots at once. No horizontal sums: a block's int32 dots of
// 16 features come out as one vector, converted and added with one FMA of their 16 scales times
// the row's d. Each code vector is unpacked once per block and used by every row of the tile.
//
//     Q4 tile  qt u8[nb, 4, 16, 4]   vector i of block b, lane f, byte c: code(k = 4i + c) in
//                                    the low nibble, code(k = 16 + 4i + c) in the high one
//              st, mt [nb, 16]       scale and min (zero - 8 scale: w = q scale + min) of the
//                                    tile's 16 features
//     Q8 tile  qt u8[nb, 8, 16, 4]   vector i, lane f, byte c: code(k = 4i + c) + 128 (the
//              st [nb, 16]           sign bit flipped: vpdpbusd takes unsigned codes); the dots
//                                    start from -128 x the block's activation sum, exactly
//
// Scales (and mins) are float16 where every value is one (a GGUF's are: Q4_1 stores d and m,
// Q4_0 and Q8_0 d, all float16), else float32: 20 bytes per Q4 block of 32 weights instead of
// 24, what a batch-1 step streams from memory. The Q4 term is sum_b min[b] xsum[m, b] on the
// quantized block sums, as above.
//
// The activations stay in natural order (dword j of a block = its values 4j .. 4j + 3). Every
// row runs the same operations whatever M is; a row's result does not depend on M.
// (Builds without AVX-512 run the same tiles with 256-bit vectors: SGL_QGEMM_T256 below.)
constexpr int64_t kTile = 16;
constexpr int kRowTileTiles = 8;  // rows per call of a tile kernel
#endif

#if SGL_QGEMM_VNNI

// acc + the dots of the 16 lanes' codes `w` with the 4 activations of dword j of a block at
// `a`, broadcast to every lane by the load itself (an embedded-broadcast memory operand: GCC
// emits a separate broadcast instruction for _mm512_set1_epi32 of a loaded word).
inline __m512i dot_bcast(__m512i acc, __m512i w, const int8_t* a, int j) {
  struct Dword { int8_t b[4]; };  // the operand's 4 bytes, for the compiler's dependences
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const Dword*>(a + 4 * j)));
  return acc;
}

// 16 scales of a tile block, float16 or float32.
template <typename S>
inline __m512 load_scales(const S* p) {
  if constexpr (sizeof(S) == 2) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(p);
  }
}

template <int R, typename S>
void q4a8_tile(const int8_t* xq, const float* xd, const float* xsum, int64_t K,
               const uint8_t* qt, const S* st, const S* mt, float* y, int64_t N) {
  const int64_t nb = K / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(qt + (b * 4 + i) * 64);
      w[i] = _mm512_and_si512(raw, low);
      w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const __m512 s = load_scales(st + b * kTile);
    const __m512 mins = load_scales(mt + b * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {  // unrolled: the accumulators stay in registers
      const int8_t* a = xq + r * K + b * kGroup;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {  // two chains: half the dependent vpdpbusd latency
        d0 = dot_bcast(d0, w[i], a, i);
        d1 = dot_bcast(d1, w[i + 1], a, i + 1);
      }
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xd[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), acc[r]);
      acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

template <int R, typename S>
void q8a8_tile(const int8_t* xq, const float* xd, const int32_t* code_sum, int64_t K,
               const uint8_t* qt, const S* st, float* y, int64_t N) {
  const int64_t nb = K / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(qt + (b * 8 + i) * 64);
    const __m512 s = load_scales(st + b * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* a = xq + r * K + b * kGroup;
      __m512i d0 = _mm512_set1_epi32(-128 * code_sum[r * nb + b]);
      __m512i d1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        d0 = dot_bcast(d0, w[i], a, i);
        d1 = dot_bcast(d1, w[i + 1], a, i + 1);
      }
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(xd[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

#endif  // SGL_QGEMM_VNNI

#if SGL_QGEMM_T256
// ---- the tile kernels with 256-bit vectors (AVX2, AVX-VNNI; builds without AVX-512) ---------
//
// The same tiles, math and float operations per lane as the AVX-512 kernels above, so a row's
// results are the same bits as theirs: each 64-byte code vector is two 256-bit ones (features
// 0-7 and 8-15), and the kernel runs the tile's two halves one after the other (a half's codes
// and 8 rows' accumulators share the 16 vector registers). The integer block dots are exact:
//
//   VNNI (SGL_QGEMM_T256_VNNI: VEX or EVEX `vpdpbusd ymm`): as above, 4 products of unsigned
//     codes and signed activations per int32 lane, added in int32.
//   AVX2: `vpmaddubsw` multiplies unsigned by signed bytes and adds adjacent products into
//     int16 with signed saturation; `vpmaddwd` with ones adds adjacent int16 into int32 (exact).
//     The activations are -127..127 (quantize_block: |x| / d <= 127).
//     Q4 (codes 0..15): a pair is at most 2 * 15 * 127 = 3810 in magnitude, and the block's 8
//       vectors (each int16 lane: 2 codes of each) at most 8 * 3810 = 30480 <= 32767: their
//       `vpmaddubsw` results are added in int16 and widened once per block.
//     Q8: the tiles hold q + 128 (0..255), whose pairs would reach 2 * 255 * 127 = 64770 and
//       saturate. The kernel restores q (xor 0x80) and multiplies |q| (0..128, unsigned) by the
//       activation carrying q's sign (`vpsignb`; -127..127, so the negation fits): each
//       product is q a, a pair at most 2 * 128 * 127 = 32512 <= 32767. Each vector is widened
//       to int32 (two vectors' pairs could exceed int16). The dot starts from 0 (the VNNI
//       kernels start from -128 x the code sum to undo the + 128).

inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scales8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Dword j of a block's activations at `a` (4 values), broadcast to the 8 lanes.
inline __m256i bcast4(const int8_t* a, int j) {
  int32_t v;
  std::memcpy(&v, a + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

#if SGL_QGEMM_T256_VNNI
// acc + the 8 lanes' dots of unsigned codes `w` with signed activations `a`, 4 bytes a lane.
SGL_QGEMM_T256_TARGET inline __m256i dpbusd8(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, a);  // VEX
#else
  return _mm256_dpbusd_epi32(acc, w, a);  // EVEX (AVX512-VNNI + AVX512VL)
#endif
}
#endif

// The int32 dots of 8 features' Q4 codes w[0..7] (vector j: the codes of activation dword j)
// with one row's block at `a`.
SGL_QGEMM_T256_TARGET inline __m256i q4_dot8(const __m256i* w, const int8_t* a) {
#if SGL_QGEMM_T256_VNNI
  __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {  // two chains, as q4a8_tile's
    d0 = dpbusd8(d0, w[j], bcast4(a, j));
    d1 = dpbusd8(d1, w[j + 1], bcast4(a, j + 1));
  }
  return _mm256_add_epi32(d0, d1);
#else
  __m256i s0 = _mm256_maddubs_epi16(w[0], bcast4(a, 0));
  __m256i s1 = _mm256_maddubs_epi16(w[1], bcast4(a, 1));
  for (int j = 2; j < 8; j += 2) {  // int16 sums: at most 30480 in magnitude (above)
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], bcast4(a, j)));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], bcast4(a, j + 1)));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
#endif
}

template <int R, typename S>
SGL_QGEMM_T256_TARGET void q4a8_tile(const int8_t* xq, const float* xd, const float* xsum,
                                     int64_t K, const uint8_t* qt, const S* st, const S* mt,
                                     float* y, int64_t N) {
  const int64_t nb = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {  // features 8h .. 8h + 7
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i w[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qt + (b * 4 + i) * 64 + 32 * h));
        w[i] = _mm256_and_si256(raw, low);
        w[4 + i] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      const __m256 s = load_scales8(st + b * kTile + 8 * h);
      const __m256 mins = load_scales8(mt + b * kTile + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i dot = q4_dot8(w, xq + r * K + b * kGroup);
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(xd[r * nb + b]));
        acc[r] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(dot), acc[r]);
        acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xsum[r * nb + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * h, acc[r]);
  }
}

template <int R, typename S>
SGL_QGEMM_T256_TARGET void q8a8_tile(const int8_t* xq, const float* xd, const int32_t* code_sum,
                                     int64_t K, const uint8_t* qt, const S* st, float* y,
                                     int64_t N) {
  const int64_t nb = K / kGroup;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i w[8];
      for (int i = 0; i < 8; ++i)
        w[i] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qt + (b * 8 + i) * 64 + 32 * h));
      const __m256 s = load_scales8(st + b * kTile + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* a = xq + r * K + b * kGroup;
#if SGL_QGEMM_T256_VNNI
        __m256i d0 = _mm256_set1_epi32(-128 * code_sum[r * nb + b]);
        __m256i d1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
          d0 = dpbusd8(d0, w[j], bcast4(a, j));
          d1 = dpbusd8(d1, w[j + 1], bcast4(a, j + 1));
        }
#else
        (void)code_sum;
        // |q| x (a with q's sign): pairs <= 32512 (above). q and |q| are derived from the
        // stored q + 128 per row: holding both for the block (16 registers) spilled, and a
        // 1-row call over 1,728 inputs ran at a third of the VNNI build's speed.
        auto dot = [&a](__m256i stored, int j) {
          const __m256i q = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
          return _mm256_madd_epi16(_mm256_maddubs_epi16(
              _mm256_abs_epi8(q), _mm256_sign_epi8(bcast4(a, j), q)), _mm256_set1_epi16(1));
        };
        __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
          d0 = _mm256_add_epi32(d0, dot(w[j], j));
          d1 = _mm256_add_epi32(d1, dot(w[j + 1], j + 1));
        }
#endif
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(xd[r * nb + b]));
        acc[r] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + 8 * h, acc[r]);
  }
}
#endif  // SGL_QGEMM_T256

#if SGL_QGEMM_VNNI || SGL_QGEMM_T256
// x f32[M, K], tiles u8[N / 16, K / 32, tile_bytes] and [N / 16, K / 32, 16] per scale tensor,
// all float16 or all float32; returns K.
int64_t check_tiles(const at::Tensor& x, const at::Tensor& qt, int64_t tile_bytes,
                    std::initializer_list<const at::Tensor*> scales, const char* op) {
  const int64_t K = check_x(x, op);
  TORCH_CHECK(qt.dim() == 3 && qt.scalar_type() == at::kByte && qt.is_contiguous() &&
                  qt.size(1) == K / kGroup && qt.size(2) == tile_bytes,
              op, ": tiles must be contiguous uint8 [N/16, K/32, ", tile_bytes, "]");
  const at::ScalarType type = (*scales.begin())->scalar_type();
  for (const at::Tensor* s : scales)
    TORCH_CHECK((type == at::kHalf || type == at::kFloat) && s->scalar_type() == type &&
                    s->is_contiguous() && s->numel() == qt.size(0) * qt.size(1) * kTile,
                op, ": tile scales must be contiguous float16 or float32 [N/16, K/32, 16], "
                "all of one dtype");
  return K;
}

// fn(S*) with the scales' data as uint16_t (float16 bits) or float.
template <typename F>
inline void with_scales(const at::Tensor& s, F&& fn) {
  if (s.scalar_type() == at::kHalf) {
    fn(static_cast<const uint16_t*>(s.data_ptr()));
  } else {
    fn(s.data_ptr<float>());
  }
}

constexpr int64_t kTileGrain = 2;  // tiles (32 output features) per parallel task, at least

at::Tensor q4_gemm_a8_tiles(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& st,
                            const at::Tensor& mt) {
  const int64_t K = check_tiles(x, qt, 4 * 64, {&st, &mt}, "q4_gemm_a8_tiles");
  const int64_t M = x.size(0), tiles = qt.size(0), N = tiles * kTile, nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const ActQ8 a = quantize_rows(x.data_ptr<float>(), M, K, /*split=*/false, /*sums=*/true);
  const uint8_t* q = qt.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  with_scales(st, [&](auto s) {
    const auto* m = static_cast<decltype(s)>(mt.data_ptr());
    at::parallel_for(0, tiles, kTileGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for_row_tiles<kRowTileTiles>(M, [&](int64_t m0, auto R) {
          q4a8_tile<decltype(R)::value>(a.q.data() + m0 * K, a.d.data() + m0 * nb,
                                        a.sum.data() + m0 * nb, K, q + t * nb * 256,
                                        s + t * nb * kTile, m + t * nb * kTile,
                                        yp + m0 * N + t * kTile, N);
        });
      }
    });
  });
  return y;
}

at::Tensor q8_gemm_a8_tiles(const at::Tensor& x, const at::Tensor& qt, const at::Tensor& st) {
  const int64_t K = check_tiles(x, qt, 8 * 64, {&st}, "q8_gemm_a8_tiles");
  const int64_t M = x.size(0), tiles = qt.size(0), N = tiles * kTile, nb = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const ActQ8 a = quantize_rows(x.data_ptr<float>(), M, K, /*split=*/false, /*sums=*/false,
                                /*code_sums=*/true);
  const uint8_t* q = qt.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  with_scales(st, [&](auto s) {
    at::parallel_for(0, tiles, kTileGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for_row_tiles<kRowTileTiles>(M, [&](int64_t m0, auto R) {
          q8a8_tile<decltype(R)::value>(a.q.data() + m0 * K, a.d.data() + m0 * nb,
                                        a.code_sum.data() + m0 * nb, K, q + t * nb * 512,
                                        s + t * nb * kTile, yp + m0 * N + t * kTile, N);
        });
      }
    });
  });
  return y;
}
#endif

// The activations as the a8 kernels see them (natural order): (xq i8[M, K], d f32[M, K/32]).
std::tuple<at::Tensor, at::Tensor> quantize_a8(const at::Tensor& x) {
  const int64_t K = check_x(x, "quantize_a8"), M = x.size(0);
  const ActQ8 a = quantize_rows(x.data_ptr<float>(), M, K, /*split=*/false, /*sums=*/false);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kGroup}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  return {q, d};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Weight-only Q4 / Q8 block GEMM with float32 activations (sgl_tpu)";
  m.def("q4_gemm", &q4_gemm, "x f32[M, K] @ Q4 blocks [N, K/32] -> f32[M, N]");
  m.def("q8_gemm", &q8_gemm, "x f32[M, K] @ Q8 blocks [N, K/32] -> f32[M, N]");
  m.def("q4_gemm_a8", &q4_gemm_a8,
        "x f32[M, K] (quantized to int8 per 32 values) @ Q4 blocks -> f32[M, N]");
  m.def("q8_gemm_a8", &q8_gemm_a8,
        "x f32[M, K] (quantized to int8 per 32 values) @ Q8 blocks -> f32[M, N]");
  m.def("quantize_a8", &quantize_a8, "x f32[M, K] -> (xq i8[M, K], d f32[M, K/32])");
  // the GEMMs as pointers, for layer_ops_cpu.cpp's decode layer loop (another module); the
  // capsule names carry the signatures it checks
  m.attr("q4_gemm_fn") = py::capsule(reinterpret_cast<void*>(&q4_gemm),
                                     "sgl_tpu.q4_gemm(x, qs, scale, zero)");
  m.attr("q8_gemm_fn") = py::capsule(reinterpret_cast<void*>(&q8_gemm),
                                     "sgl_tpu.q8_gemm(x, qs, scale)");
  m.attr("q4_gemm_a8_fn") = py::capsule(reinterpret_cast<void*>(&q4_gemm_a8),
                                        "sgl_tpu.q4_gemm_a8(x, qs, scale, zero)");
  m.attr("q8_gemm_a8_fn") = py::capsule(reinterpret_cast<void*>(&q8_gemm_a8),
                                        "sgl_tpu.q8_gemm_a8(x, qs, scale)");
#if SGL_QGEMM_VNNI || SGL_QGEMM_T256
  m.def("q4_gemm_a8_tiles", &q4_gemm_a8_tiles,
        "x f32[M, K] (quantized to int8 per 32 values) @ Q4 tiles of 16 features -> f32[M, N]");
  m.def("q8_gemm_a8_tiles", &q8_gemm_a8_tiles,
        "x f32[M, K] (quantized to int8 per 32 values) @ Q8 tiles of 16 features -> f32[M, N]");
  m.attr("q4_gemm_a8_tiles_fn") = py::capsule(reinterpret_cast<void*>(&q4_gemm_a8_tiles),
                                              "sgl_tpu.q4_gemm_a8_tiles(x, qt, st, mt)");
  m.attr("q8_gemm_a8_tiles_fn") = py::capsule(reinterpret_cast<void*>(&q8_gemm_a8_tiles),
                                              "sgl_tpu.q8_gemm_a8_tiles(x, qt, st)");
#endif
  m.attr("simd") = SGL_QGEMM_AVX512 ? "avx512f" : SGL_QGEMM_AVX2 ? "avx2-fma" : "scalar";
  m.attr("vnni") = bool(SGL_QGEMM_VNNI);  // the Q4 int8-activation kernel's vpdpbusd path
  // the tile kernels' integer dot product ("" where the build has no tile kernels)
#if SGL_QGEMM_VNNI
  m.attr("tile_dot") = "vpdpbusd-zmm";
#elif SGL_QGEMM_T256
  m.attr("tile_dot") = SGL_QGEMM_T256_DOT;
#else
  m.attr("tile_dot") = "";
#endif
}
