// Fixed-reduction-order GEMM for --enable-deterministic-inference on CPUs: the compiled half of
// kernels/invariant_gemm_cpu.py (kernels/cpu_extension.py builds it).
//
// oneDNN and MKL pick a GEMM kernel, its blocking and the split of the K reduction per call
// from the shapes and the CPU's ISA (AMX tiles, AVX512-BF16 pairs, AVX2), so one row's result
// changes with the number of rows beside it. Here every output element is one chain of fused
// multiply-adds over k = 0 .. K-1, in that order, starting from 0:
//
//     c[m, n] = fma(a[m, K-1], b[K-1, n], ... fma(a[m, 1], b[1, n], fma(a[m, 0], b[0, n], 0)))
//
// Vectors run across n (independent outputs), never across k, and threads split whole blocks
// of outputs, so c[m, n] is a function of row m of a and column n of b only: not of M, of the
// thread count, of the vector width (AVX-512, AVX2), or of the block sizes below. std::fma is
// one rounding on every build (a vfmadd instruction where the build targets FMA, libm's exact
// fma in the portable build), so every x86 build gives the same bits.
//
// Dimensions: Bt batch, M rows of a, K the reduced axis, N columns of b; NB = 16 columns a block.
//
//     gemm(a f32[Bt, M, K], b f32|bf16[Bt, K, N])        -> f32[Bt, M, N]   (rows contiguous)
//     pack(w f32|bf16[N, K])                             -> panels [ceil(N/NB), K, NB], w's dtype
//     gemm_packed(a f32[M, K], panels, N)                -> f32[M, N] = a @ w.T
//
//          b [K, N]:   | n-block 0 | n-block 1 | ... |        panels: n-block j's K x NB values
//                k=0   |  16 cols  |  16 cols  |     |        contiguous (zero-padded past N),
//                ...                                          so a block streams one panel
//
// A block holds MR rows x NB columns of accumulators in registers (MR = 8 with AVX-512, 4 with
// AVX2's 16 registers); each b value is widened to float32 once per k and used by MR rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define SGL_INV_SIMD "avx512f"
constexpr int kRowsPerBlock = 8;
#elif defined(__AVX2__) && defined(__FMA__)
#define SGL_INV_SIMD "avx2-fma"
constexpr int kRowsPerBlock = 4;
#else
#define SGL_INV_SIMD "scalar"
constexpr int kRowsPerBlock = 4;
#endif

namespace {

constexpr int NB = 16;                     // columns per block
constexpr int64_t kGrainFlops = 1 << 18;   // multiply-adds per parallel task, at least

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) {  // exact: bf16 is float32's upper half
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// NB float32 lanes: one zmm, two ymm, or a plain array; fma() rounds once per lane on each.
struct Lanes {
#if defined(__AVX512F__)
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Lanes load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void fma(float a, const Lanes& b) { v = _mm512_fmadd_ps(_mm512_set1_ps(a), b.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256 widen(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Lanes load(const c10::BFloat16* p) { return {widen(p), widen(p + 8)}; }
  void fma(float a, const Lanes& b) {
    const __m256 av = _mm256_set1_ps(a);
    lo = _mm256_fmadd_ps(av, b.lo, lo);
    hi = _mm256_fmadd_ps(av, b.hi, hi);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
#else
  float v[NB];
  static Lanes zero() { return {}; }
  template <typename T>
  static Lanes load(const T* p) {
    Lanes l;
    for (int j = 0; j < NB; ++j) l.v[j] = to_f(p[j]);
    return l;
  }
  void fma(float a, const Lanes& b) {
    for (int j = 0; j < NB; ++j) v[j] = std::fma(a, b.v[j], v[j]);
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
#endif
};

// c[0..R) x [0..cols) of one block; b[k * ldb + j] is column j of the block at depth k.
template <typename BT, int R>
void block(const float* a, int64_t lda, const BT* b, int64_t ldb, float* c, int64_t ldc,
           int64_t K, int cols) {
  if (cols == NB) {
    Lanes acc[R];
    for (int i = 0; i < R; ++i) acc[i] = Lanes::zero();
    for (int64_t k = 0; k < K; ++k) {
      const Lanes bv = Lanes::load(b + k * ldb);
      for (int i = 0; i < R; ++i) acc[i].fma(a[i * lda + k], bv);
    }
    for (int i = 0; i < R; ++i) acc[i].store(c + i * ldc);
    return;
  }
  // the last, narrower block of a strided b: the same chain per element, one lane at a time
  float acc[R][NB] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < R; ++i) {
      const float av = a[i * lda + k];
      for (int j = 0; j < cols; ++j) acc[i][j] = std::fma(av, to_f(b[k * ldb + j]), acc[i][j]);
    }
  for (int i = 0; i < R; ++i) std::memcpy(c + i * ldc, acc[i], cols * sizeof(float));
}

// The last R < MR rows of a block of columns, R a run-time count: one block<R> for them all
// (each b value widened once), found by counting down the template argument.
template <typename BT, int R>
void tail_block(int rows, const float* a, int64_t lda, const BT* b, int64_t ldb, float* c,
                int64_t ldc, int64_t K, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return block<BT, R>(a, lda, b, ldb, c, ldc, K, cols);
    tail_block<BT, R - 1>(rows, a, lda, b, ldb, c, ldc, K, cols);
  }
}

// All rows of a against one block of columns: MR rows at a time, then the rest in one block.
template <typename BT>
void column_block(const float* a, int64_t lda, int64_t M, const BT* b, int64_t ldb, float* c,
                  int64_t ldc, int64_t K, int cols) {
  int64_t m = 0;
  for (; m + kRowsPerBlock <= M; m += kRowsPerBlock)
    block<BT, kRowsPerBlock>(a + m * lda, lda, b, ldb, c + m * ldc, ldc, K, cols);
  tail_block<BT, kRowsPerBlock - 1>(static_cast<int>(M - m), a + m * lda, lda, b, ldb,
                                    c + m * ldc, ldc, K, cols);
}

int64_t grain(int64_t flops_per_task) {
  return std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(flops_per_task, 1));
}

void check_a(const at::Tensor& a, int64_t dim, const char* op) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == dim &&
                  a.stride(-1) == 1,
              op, ": a must be a float32 CPU tensor of ", dim, " dims with contiguous rows");
}

void check_b(const at::Tensor& b, const char* op, const char* name) {
  TORCH_CHECK(b.device().is_cpu() &&
                  (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16),
              op, ": ", name, " must be a float32 or bfloat16 CPU tensor");
}

template <typename BT>
void gemm_impl(const at::Tensor& a, const at::Tensor& b, at::Tensor& c) {
  const int64_t Bt = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  const int64_t blocks = (N + NB - 1) / NB;
  const float* ap = a.data_ptr<float>();
  const BT* bp = b.data_ptr<BT>();
  float* cp = c.data_ptr<float>();
  at::parallel_for(0, Bt * blocks, grain(M * K * NB), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / blocks, n0 = (t % blocks) * NB;
      column_block<BT>(ap + bi * a.stride(0), a.stride(1), M, bp + bi * b.stride(0) + n0,
                       b.stride(1), cp + bi * M * N + n0, N, K,
                       static_cast<int>(std::min<int64_t>(NB, N - n0)));
    }
  });
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
  const char* op = "invariant_gemm_cpu.gemm";
  check_a(a, 3, op);
  check_b(b, op, "b");
  TORCH_CHECK(b.dim() == 3 && b.stride(2) == 1 && b.size(0) == a.size(0) &&
                  b.size(1) == a.size(2),
              op, ": b must be [Bt, K, N] with contiguous rows, matching a [Bt, M, K]");
  at::Tensor c = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (b.scalar_type() == at::kBFloat16)
    gemm_impl<c10::BFloat16>(a, b, c);
  else
    gemm_impl<float>(a, b, c);
  return c;
}

at::Tensor pack(const at::Tensor& w) {
  const char* op = "invariant_gemm_cpu.pack";
  check_b(w, op, "w");
  TORCH_CHECK(w.dim() == 2, op, ": w must be a matrix [N, K]");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  at::Tensor padded = at::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [blocks, NB, K] -> [blocks, K, NB]
  return padded.view({blocks, NB, K}).transpose(1, 2).contiguous();
}

template <typename BT>
void gemm_packed_impl(const at::Tensor& a, const at::Tensor& panels, int64_t N, at::Tensor& c) {
  const int64_t M = a.size(0), K = a.size(1), blocks = panels.size(0);
  const float* ap = a.data_ptr<float>();
  const BT* pp = panels.data_ptr<BT>();
  float* cp = c.data_ptr<float>();
  at::parallel_for(0, blocks, grain(M * K * NB), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t n0 = j * NB;
      column_block<BT>(ap, a.stride(0), M, pp + j * K * NB, NB, cp + n0, N, K,
                       static_cast<int>(std::min<int64_t>(NB, N - n0)));
    }
  });
}

at::Tensor gemm_packed(const at::Tensor& a, const at::Tensor& panels, int64_t N) {
  const char* op = "invariant_gemm_cpu.gemm_packed";
  check_a(a, 2, op);
  check_b(panels, op, "panels");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == NB &&
                  panels.size(1) == a.size(1) && panels.size(0) == (N + NB - 1) / NB,
              op, ": panels must be pack()'s [ceil(N/16), K, 16] for a [M, K]");
  at::Tensor c = at::empty({a.size(0), N}, a.options());
  if (panels.scalar_type() == at::kBFloat16)
    gemm_packed_impl<c10::BFloat16>(a, panels, N, c);
  else
    gemm_packed_impl<float>(a, panels, N, c);
  return c;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fixed-reduction-order GEMM for deterministic inference on CPUs (sgl_tpu)";
  m.def("gemm", &gemm, "a f32[Bt, M, K] @ b [Bt, K, N] -> f32[Bt, M, N], one FMA chain each");
  m.def("pack", &pack, "w [N, K] -> panels [ceil(N/16), K, 16] for gemm_packed");
  m.def("gemm_packed", &gemm_packed, "a f32[M, K] @ w.T (pack(w)) -> f32[M, N]");
  m.attr("simd") = SGL_INV_SIMD;
  m.attr("block_cols") = NB;
}
