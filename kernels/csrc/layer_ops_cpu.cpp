// Fused per-layer element-wise ops of the torch backend's eager CPU decoder: the compiled half
// of kernels/layer_ops_cpu.py (kernels/cpu_extension.py builds it). Each op is one pass over
// its rows instead of the 4-8 small aten ops (and their temporaries) that the same arithmetic
// costs in eager PyTorch.
//
// Dimensions: T token rows, n features, H query heads, kvh KV heads, d head_dim, F MLP width.
// Element types: float32 or bfloat16 (scalar_t); arithmetic in float32, rounded once on store.
//
//     rms_norm(x [T, n], w f32[n], eps)               -> y [T, n] = x * rsqrt(mean(x^2) + eps) * w
//     add_rms_norm(h [T, n], delta [T, n], w, eps)    -> y;  h <- h + delta  (in place, rounded
//                                                        to scalar_t first, as `h + delta`)
//     rope_write_kv(qkv [T, (H + 2 kvh) d], cos, sin f32[T, d], k_pool, v_pool [S, kvh, d],
//                   slots i64[T], H, kvh, q_norm f32[d] | None, k_norm f32[d] | None, eps)
//         rotates the q and k heads of each row in place (rotate-half, llama_torch.apply_rope's
//         tables: cos = (c, c), sin = (-s, s)), each head RMSNormed first when the norms are
//         given (Qwen3), then copies the row's k and v heads into pool row slots[t]; the
//         pools hold qkv's dtype, or bfloat16 under float32 qkv, or fp8 e5m2 (rounded to
//         nearest even; fp8 saturated at +-57344), or int8 head rows [S, kvh, d + 2]
//         (quantize_head: each head's d int8 values and its bfloat16 scale)
//
//                 qkv row t:  | q head 0 .. H-1 | k head 0 .. kvh-1 | v head 0 .. kvh-1 |
//                               \____ rotated in place ____/          |
//                                                 \__ k_pool[slot] __/ \__ v_pool[slot] __/
//
//     silu_mul(gate_up [T, 2F])                        -> [T, F] = silu(gate) * up
//
// Rows are split over torch's threads (at::parallel_for) once there are enough of them
// (prefill); a decode step's few rows run on the calling thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int64_t kGrainElems = 1 << 15;  // elements per parallel task, at least
constexpr int kPartials = 8;              // independent partial sums (vectorizable)

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }
// A --kv-cache-dtype fp8_e5m2 pool row: rounded to nearest even as torch rounds, saturated at
// the type's largest finite value where torch's conversion gives inf (write_kv clamps alike).
constexpr float kE5m2Max = 57344.0f;
template <>
inline c10::Float8_e5m2 from_f<c10::Float8_e5m2>(float v) {
  return static_cast<c10::Float8_e5m2>(std::min(std::max(v, -kE5m2Max), kE5m2Max));
}

// exp(x) for the SiLU, branch-free so that the compiler vectorizes its loop (std::exp does not):
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (relative error ~1e-7).
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1));
}

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              op, ": ", name, " must be a CPU matrix with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": ", name, " must be float32 or bfloat16");
}

void check_weight(const at::Tensor& w, int64_t n, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.numel() == n,
              op, ": weight must be a contiguous float32 vector of the rows' width");
}

// y[i] = h[i] * rsqrt(mean(h^2) + eps) * w[i] over one row of n float32 values
template <typename T>
void norm_row(const float* h, const float* w, int64_t n, float eps, T* y) {
  float part[kPartials] = {};
  int64_t i = 0;
  for (; i + kPartials <= n; i += kPartials)
    for (int j = 0; j < kPartials; ++j) part[j] += h[i + j] * h[i + j];
  float ss = 0.0f;
  for (; i < n; ++i) ss += h[i] * h[i];
  for (int j = 0; j < kPartials; ++j) ss += part[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = from_f<T>(h[k] * r * w[k]);
}

template <typename T>
void add_rms_norm_impl(T* h, int64_t h_stride, const T* delta, int64_t d_stride, const float* w,
                       int64_t rows, int64_t n, float eps, T* y) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      T* hr = h + r * h_stride;
      if (delta != nullptr) {
        const T* dr = delta + r * d_stride;
        for (int64_t k = 0; k < n; ++k) {
          hr[k] = from_f<T>(to_f(hr[k]) + to_f(dr[k]));  // rounded like `h + delta`
          buf[k] = to_f(hr[k]);
        }
      } else {
        for (int64_t k = 0; k < n; ++k) buf[k] = to_f(hr[k]);
      }
      norm_row(buf.data(), w, n, eps, y + r * n);
    }
  });
}

at::Tensor add_rms_norm_any(const at::Tensor& h, const at::Tensor* delta, const at::Tensor& w,
                            double eps, const char* op) {
  check_rows(h, op, "x");
  const int64_t rows = h.size(0), n = h.size(1);
  check_weight(w, n, op);
  if (delta != nullptr) {
    check_rows(*delta, op, "delta");
    TORCH_CHECK(delta->scalar_type() == h.scalar_type() && delta->size(0) == rows &&
                    delta->size(1) == n,
                op, ": delta must have the residual's shape and dtype");
  }
  at::Tensor y = at::empty({rows, n}, h.options());
  if (h.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(
        h.data_ptr<c10::BFloat16>(), h.stride(0),
        delta ? delta->data_ptr<c10::BFloat16>() : nullptr, delta ? delta->stride(0) : 0,
        w.data_ptr<float>(), rows, n, static_cast<float>(eps), y.data_ptr<c10::BFloat16>());
  } else {
    add_rms_norm_impl<float>(h.data_ptr<float>(), h.stride(0),
                             delta ? delta->data_ptr<float>() : nullptr,
                             delta ? delta->stride(0) : 0, w.data_ptr<float>(), rows, n,
                             static_cast<float>(eps), y.data_ptr<float>());
  }
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return add_rms_norm_any(x, nullptr, w, eps, "layer_ops_cpu.rms_norm");
}

at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& w,
                        double eps) {
  return add_rms_norm_any(h, &delta, w, eps, "layer_ops_cpu.add_rms_norm");
}

// one head in place: x' = x * cos + swap_halves(x) * sin, after the head's RMSNorm (rounded
// to T, as the torch path stores it) when `norm` is given (Qwen3's q/k norms)
template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t d, float* tmp,
                        const float* norm, float eps) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) tmp[i] = to_f(x[i]);
  if (norm != nullptr) {
    norm_row(tmp, norm, d, eps, x);
    for (int64_t i = 0; i < d; ++i) tmp[i] = to_f(x[i]);
  }
  for (int64_t i = 0; i < half; ++i) {
    x[i] = from_f<T>(tmp[i] * cos[i] + tmp[i + half] * sin[i]);
    x[i + half] = from_f<T>(tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half]);
  }
}

// A --kv-cache-dtype int8 head row (sgl_tpu/backends/torch/kv_pool.py quantize_int8, bit for
// bit): d values q = round(x / scale) in [-127, 127] (ties to even, as torch.round), then the
// scale's bfloat16 bits; scale = max |x| / 127 rounded up to bfloat16.
template <typename T>
inline void quantize_head(int8_t* dst, const T* src, int64_t d) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_f(src[i])));
  uint32_t u;
  const float raw = amax / 127.0f;
  std::memcpy(&u, &raw, sizeof u);
  u = (u + 0xFFFFu) & ~0xFFFFu;
  float scale;
  std::memcpy(&scale, &u, sizeof scale);
  for (int64_t i = 0; i < d; ++i) {
    const float q = scale > 0.0f ? std::nearbyint(to_f(src[i]) / scale) : 0.0f;
    dst[i] = static_cast<int8_t>(std::min(std::max(q, -127.0f), 127.0f));
  }
  const uint16_t bits = static_cast<uint16_t>(u >> 16);
  std::memcpy(dst + d, &bits, sizeof bits);
}

// n values of one row into a pool row: a copy, or rounded to the pool's narrower type
template <typename T, typename TP>
inline void copy_row(TP* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, TP>)
    std::memcpy(dst, src, n * sizeof(T));
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = from_f<TP>(to_f(src[i]));
}

template <typename T, typename TP>
void rope_write_kv_impl(T* qkv, int64_t row_stride, const float* cos, const float* sin,
                        TP* k_pool, TP* v_pool, const int64_t* slots, int64_t rows, int64_t H,
                        int64_t kvh, int64_t d, const float* q_norm, const float* k_norm,
                        float eps) {
  at::parallel_for(0, rows, grain_rows((H + 2 * kvh) * d), [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(d);
    for (int64_t t = r0; t < r1; ++t) {
      T* row = qkv + t * row_stride;
      for (int64_t head = 0; head < H + kvh; ++head)
        rotate_head(row + head * d, cos + t * d, sin + t * d, d, tmp.data(),
                    head < H ? q_norm : k_norm, eps);
      if constexpr (std::is_same_v<TP, int8_t>) {  // head rows of d + 2 bytes
        const int64_t head_row = d + 2;
        for (int64_t h = 0; h < kvh; ++h) {
          quantize_head(k_pool + (slots[t] * kvh + h) * head_row, row + (H + h) * d, d);
          quantize_head(v_pool + (slots[t] * kvh + h) * head_row, row + (H + kvh + h) * d, d);
        }
      } else {
        const int64_t kv_elems = kvh * d;
        copy_row(k_pool + slots[t] * kv_elems, row + H * d, kv_elems);
        copy_row(v_pool + slots[t] * kv_elems, row + (H + kvh) * d, kv_elems);
      }
    }
  });
}

void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                   int64_t num_q_heads, int64_t num_kv_heads,
                   const c10::optional<at::Tensor>& q_norm,
                   const c10::optional<at::Tensor>& k_norm, double eps) {
  const char* op = "layer_ops_cpu.rope_write_kv";
  check_rows(qkv, op, "qkv");
  const int64_t rows = qkv.size(0), H = num_q_heads, kvh = num_kv_heads;
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.size(1) == kvh && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes(),
              op, ": pools must be contiguous [slots, kvh, d] of the same shape");
  // an int8 pool's head rows end in their scale's 2 bytes
  const bool q8 = k_pool.scalar_type() == at::kChar;
  const int64_t d = k_pool.size(2) - (q8 ? 2 : 0);
  TORCH_CHECK(d % 2 == 0 && qkv.size(1) == (H + 2 * kvh) * d,
              op, ": qkv rows must hold (H + 2 kvh) heads of an even head_dim");
  TORCH_CHECK(k_pool.device().is_cpu() && v_pool.scalar_type() == k_pool.scalar_type() &&
                  (k_pool.scalar_type() == qkv.scalar_type() ||
                   k_pool.scalar_type() == at::kFloat8_e5m2 || q8 ||
                   (qkv.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kBFloat16)),
              op, ": pools must be CPU tensors of qkv's dtype, or float8_e5m2 or int8 head "
              "rows, or bfloat16 under float32 qkv; got qkv ", qkv.scalar_type(), ", k_pool ",
              k_pool.scalar_type(), ", v_pool ", v_pool.scalar_type());
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == rows * d,
                op, ": cos / sin must be contiguous float32 [T, d]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == rows,
              op, ": slots must be contiguous i64[T]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), op, ": q_norm and k_norm go together");
  const float* qn = nullptr;
  const float* kn = nullptr;
  if (q_norm.has_value()) {
    check_weight(*q_norm, d, op);
    check_weight(*k_norm, d, op);
    qn = q_norm->data_ptr<float>();
    kn = k_norm->data_ptr<float>();
  }
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_pool.size(0);
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, op, ": slot ", s[t], " out of range");
  if (q8 && qkv.scalar_type() == at::kBFloat16)
    rope_write_kv_impl<c10::BFloat16, int8_t>(
        qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), cos.data_ptr<float>(),
        sin.data_ptr<float>(), k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(), s, rows,
        H, kvh, d, qn, kn, static_cast<float>(eps));
  else if (q8)
    rope_write_kv_impl<float, int8_t>(
        qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
        k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(), s, rows, H, kvh, d, qn, kn,
        static_cast<float>(eps));
  else if (k_pool.scalar_type() == at::kFloat8_e5m2 && qkv.scalar_type() == at::kBFloat16)
    rope_write_kv_impl<c10::BFloat16, c10::Float8_e5m2>(
        qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), cos.data_ptr<float>(),
        sin.data_ptr<float>(), k_pool.data_ptr<c10::Float8_e5m2>(),
        v_pool.data_ptr<c10::Float8_e5m2>(), s, rows, H, kvh, d, qn, kn,
        static_cast<float>(eps));
  else if (k_pool.scalar_type() == at::kFloat8_e5m2)
    rope_write_kv_impl<float, c10::Float8_e5m2>(
        qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
        k_pool.data_ptr<c10::Float8_e5m2>(), v_pool.data_ptr<c10::Float8_e5m2>(), s, rows, H,
        kvh, d, qn, kn, static_cast<float>(eps));
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_write_kv_impl<c10::BFloat16, c10::BFloat16>(
        qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), cos.data_ptr<float>(),
        sin.data_ptr<float>(), k_pool.data_ptr<c10::BFloat16>(),
        v_pool.data_ptr<c10::BFloat16>(), s, rows, H, kvh, d, qn, kn, static_cast<float>(eps));
  else if (k_pool.scalar_type() == at::kBFloat16)
    rope_write_kv_impl<float, c10::BFloat16>(
        qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
        k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(), s, rows, H, kvh, d,
        qn, kn, static_cast<float>(eps));
  else
    rope_write_kv_impl<float, float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(),
                              sin.data_ptr<float>(), k_pool.data_ptr<float>(),
                              v_pool.data_ptr<float>(), s, rows, H, kvh, d, qn, kn,
                              static_cast<float>(eps));
}

// Denormal results flushed to zero (and denormal inputs read as zero) on this thread while it
// lives. The SiLU loop's vector code also evaluates the branch of clamped inputs,
// x u / (1 + e^87), for every lane and then discards it; for ordinary x u that is a denormal,
// and on x86 each denormal result costs a microcode assist: the loop ran 5-7x slower on an
// AVX-512 Xeon with most inputs nonzero (README, "Fused layer ops on CPU"). Only results below
// 1.2e-38 in magnitude change (to 0).
struct FlushDenormals {
#if defined(__SSE2__)
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

template <typename T>
void silu_mul_impl(const T* gu, int64_t row_stride, int64_t rows, int64_t F, T* out) {
  at::parallel_for(0, rows, grain_rows(2 * F), [&](int64_t r0, int64_t r1) {
    const FlushDenormals ftz;
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * row_stride;
      const T* u = g + F;
      T* o = out + r * F;
      // x u / (1 + e): written x / (1 + e) * u, GCC's vector code took two divisions, 2x slower
      for (int64_t i = 0; i < F; ++i) {
        const float x = to_f(g[i]);
        o[i] = from_f<T>(x * to_f(u[i]) / (1.0f + exp_f(-x)));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const char* op = "layer_ops_cpu.silu_mul";
  check_rows(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, op, ": gate_up must have an even width [T, 2F]");
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, F}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_impl<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), gate_up.stride(0), rows,
                                 F, out.data_ptr<c10::BFloat16>());
  else
    silu_mul_impl<float>(gate_up.data_ptr<float>(), gate_up.stride(0), rows, F,
                         out.data_ptr<float>());
  return out;
}

// ---- one decode step's layers in one call -------------------------------------------------
//
// `LlamaTorch.forward_fused`'s layer loop for decode steps whose projections are all
// quant_gemm_cpu.cpp's kernels of one family (the int8-activation tiles `q4-a8-t16` /
// `q8-a8-t16` of AVX512-VNNI builds, the int8-activation blocks `q4-a8` / `q8-a8`, or the
// float32 blocks `q4-f32` / `q8-f32`), without bias, and whose attention is paged_attention_cpu.cpp's `decode`: the same calls in the same
// order, so the same results, with no Python between them (a batch-1 step of the default model
// makes ~270 kernel calls; their Python glue was ~0.6 ms of a ~6 ms step on a 2-core CPU). The
// other two modules export those kernels as function pointers in capsules named by their
// signatures (below), and the GIL is released while the layers run.
//
//     DecodeLayers(layers, k_pools, v_pools, final_norm, kernels, H, kvh, eps, scale, bf16_dots)
//         layers[l] = [attn_norm, mlp_norm, q_norm, k_norm, (codes, scales, mins) x 4
//                      projections: wqkv, wo, w_gate_up, w_down]; empty q_norm / k_norm: none
//                      (not Qwen3); (qt, st, mt) for tiles, (qs, scale, zero) for blocks,
//                      an empty third tensor for Q8
//         kernels = (q4 capsule, q8 capsule, attention decode capsule), q4 and q8 of one family
//     run(h [T, D], cos, sin f32[T, 1, d], out_slots i64[T], shared_slots, own_slots, own_lo,
//         own_hi)  (the FusedDecodeBatch's)  -> the final-normed hidden [T, D]; h is updated in
//         place as forward_fused updates it. The caller keeps T within the block kernels' row
//         limit (above it their projections take a dense copy, which this loop does not)

// both families' functions have these signatures: (x, codes, scales, mins) and (x, codes,
// scales)
using Q4Fn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&);
using Q8Fn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DecodeFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t, double, bool);
// the capsule names, which the exporting modules give them (quant_gemm_cpu.cpp,
// paged_attention_cpu.cpp): a changed signature is a changed name, refused here. The q4 and
// q8 kernels come in pairs of one family.
constexpr int kGemmFamilies = 3;
constexpr const char* kGemmFns[kGemmFamilies][2] = {
    {"sgl_tpu.q4_gemm_a8_tiles(x, qt, st, mt)", "sgl_tpu.q8_gemm_a8_tiles(x, qt, st)"},
    {"sgl_tpu.q4_gemm_a8(x, qs, scale, zero)", "sgl_tpu.q8_gemm_a8(x, qs, scale)"},
    {"sgl_tpu.q4_gemm(x, qs, scale, zero)", "sgl_tpu.q8_gemm(x, qs, scale)"}};
constexpr const char* kDecodeFn =
    "sgl_tpu.attention_decode(q, k_pool, v_pool, shared_slots, own_slots, own_lo, own_hi, "
    "scale, window, cap, bf16_dots)";

const char* capsule_name(const py::handle& obj) {
  const char* name = py::reinterpret_borrow<py::capsule>(obj).name();
  return name ? name : "an unnamed one";
}

void* capsule_fn(const py::handle& obj, const char* name) {
  TORCH_CHECK(std::strcmp(capsule_name(obj), name) == 0,
              "layer_ops_cpu.DecodeLayers: expected the capsule ", name, ", got ",
              capsule_name(obj));
  return py::reinterpret_borrow<py::capsule>(obj).get_pointer();
}

// The family whose q4 capsule `q4` is (its q8 one must match), or a refusal naming them all.
int gemm_family(const py::handle& q4) {
  for (int f = 0; f < kGemmFamilies; ++f)
    if (std::strcmp(capsule_name(q4), kGemmFns[f][0]) == 0) return f;
  TORCH_CHECK(false, "layer_ops_cpu.DecodeLayers: expected the capsule ", kGemmFns[0][0], ", ",
              kGemmFns[1][0], " or ", kGemmFns[2][0], ", got ", capsule_name(q4));
  return -1;
}

constexpr int kLayerTensors = 4 + 3 * 4;

class DecodeLayers {
 public:
  DecodeLayers(std::vector<std::vector<at::Tensor>> layers, std::vector<at::Tensor> k_pools,
               std::vector<at::Tensor> v_pools, at::Tensor final_norm, const py::tuple& kernels,
               int64_t num_q_heads, int64_t num_kv_heads, double eps, double scale,
               bool bf16_dots)
      : layers_(std::move(layers)), k_pools_(std::move(k_pools)), v_pools_(std::move(v_pools)),
        final_norm_(std::move(final_norm)), H_(num_q_heads), kvh_(num_kv_heads), eps_(eps),
        scale_(scale), bf16_dots_(bf16_dots) {
    TORCH_CHECK(kernels.size() == 3, "layer_ops_cpu.DecodeLayers: kernels = (q4, q8, decode)");
    const int family = gemm_family(kernels[0]);
    q4_ = reinterpret_cast<Q4Fn>(capsule_fn(kernels[0], kGemmFns[family][0]));
    q8_ = reinterpret_cast<Q8Fn>(capsule_fn(kernels[1], kGemmFns[family][1]));
    decode_ = reinterpret_cast<DecodeFn>(capsule_fn(kernels[2], kDecodeFn));
    TORCH_CHECK(layers_.size() == k_pools_.size() && layers_.size() == v_pools_.size(),
                "layer_ops_cpu.DecodeLayers: one K and one V pool per layer");
    for (const auto& w : layers_)
      TORCH_CHECK(w.size() == kLayerTensors, "layer_ops_cpu.DecodeLayers: ", kLayerTensors,
                  " tensors per layer");
  }

  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& slots, const at::Tensor& shared_slots,
                 const at::Tensor& own_slots, const at::Tensor& own_lo,
                 const at::Tensor& own_hi) const {
    const int64_t t = h.size(0);
    at::Tensor delta;  // the last MLP's output, not yet added to h
    for (size_t l = 0; l < layers_.size(); ++l) {
      const std::vector<at::Tensor>& w = layers_[l];
      const at::Tensor& k_pool = k_pools_[l];
      const at::Tensor& v_pool = v_pools_[l];
      at::Tensor x = add_rms_norm_any(h, delta.defined() ? &delta : nullptr, w[0], eps_,
                                      "layer_ops_cpu.DecodeLayers");
      at::Tensor qkv = linear(x, w, 4);
      c10::optional<at::Tensor> q_norm, k_norm;
      if (w[2].numel()) {
        q_norm = w[2];
        k_norm = w[3];
      }
      rope_write_kv(qkv, cos, sin, k_pool, v_pool, slots, H_, kvh_, q_norm, k_norm, eps_);
      const int64_t d = qkv.size(1) / (H_ + 2 * kvh_), q_size = H_ * d;
      const at::Tensor o = decode_(qkv.narrow(1, 0, q_size).view({t, H_, d}), k_pool, v_pool,
                                   shared_slots, own_slots, own_lo, own_hi, scale_, 0, 0.0,
                                   bf16_dots_);
      const at::Tensor attn = linear(o.view({t, q_size}), w, 7);
      x = add_rms_norm_any(h, &attn, w[1], eps_, "layer_ops_cpu.DecodeLayers");
      delta = linear(silu_mul(linear(x, w, 10)), w, 13);
    }
    return add_rms_norm_any(h, delta.defined() ? &delta : nullptr, final_norm_, eps_,
                            "layer_ops_cpu.DecodeLayers");
  }

 private:
  // x @ the projection whose tensors are w[i .. i + 3)
  at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& w, int i) const {
    return w[i + 2].numel() ? q4_(x, w[i], w[i + 1], w[i + 2]) : q8_(x, w[i], w[i + 1]);
  }

  std::vector<std::vector<at::Tensor>> layers_;
  std::vector<at::Tensor> k_pools_, v_pools_;
  at::Tensor final_norm_;
  int64_t H_, kvh_;
  double eps_, scale_;
  bool bf16_dots_;
  Q4Fn q4_ = nullptr;
  Q8Fn q8_ = nullptr;
  DecodeFn decode_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused per-layer element-wise ops for the torch backend's CPU decoder (sgl_tpu)";
  m.def("rms_norm", &rms_norm, "y = RMSNorm(x) * w");
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place; y = RMSNorm(h) * w");
  m.def("rope_write_kv", &rope_write_kv,
        "(q/k norm and) RoPE on qkv's q and k heads in place, k and v rows into their pool slots",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("slots"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
        py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 1e-6);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2F] -> [T, F]");
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<std::vector<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, at::Tensor, const py::tuple&, int64_t, int64_t,
                    double, double, bool>())
      .def("run", &DecodeLayers::run, "one decode step's layers -> final-normed hidden",
           py::call_guard<py::gil_scoped_release>());
}
