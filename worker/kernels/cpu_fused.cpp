// Fused CPU kernels of the decoder layer's small ops: the "cpu" backend's `fused` namespace
// (worker/kernels/cpu_fused.py), one op call where eager torch runs 5-10 ops.
//
// Contract (the same as worker/kernels/triton_norm.py, whose plain-torch twins are RMSNorm,
// RotaryEmbedding and the MLP activation in worker/model/llama.py), for float32, bfloat16 and
// float16 activations:
//   rms_norm(x [T, C], weight [C], eps) -> out [T, C]
//   rms_norm_residual(x [T, C], residual [T, C], weight [C], eps) -> (out, x + residual)
//     The sum is rounded to x's dtype (as torch adds) and normalised: the mean of squares in
//     float32, x * rsqrt(mean + eps) rounded to x's dtype, then times the weight (rounded).
//     weight has x's dtype; rows may be strided, columns contiguous.
//   rotary_embedding(positions [T] int64, q [T, H, D], k [T, Hkv, D], cos [P, D/2], sin [P, D/2])
//     -> (q_out, k_out), new contiguous tensors: non-interleaved (rotate-half) RoPE in float32
//     (each product rounded before the sum, as torch computes it), rounded to the input dtype.
//     cos/sin float32 and contiguous; q/k any row/head strides, unit inner stride.
//   rope_store_kv(positions, q, k, v [T, Hkv, D], cos, sin, k_cache, v_cache [NB, BS, Hkv, D],
//     slot_mapping [T] int64) -> q_out: rotary_embedding's q_out, and the rotated k and v written
//     into the cache rows of their slots (slots < 0: padding, nothing written); k and v are not
//     modified, the rotated k lives only in the cache. Caches contiguous, of k's dtype. Slots must
//     be distinct (as the scheduler makes them): tokens run in parallel.
//   silu_and_mul(x [T, 2F]) -> [T, F]: silu(x[:, :F]) rounded to x's dtype, times x[:, F:],
//     rounded (torch's `F.silu(gate) * up`).
// How: plain loops over rows (the compiler vectorises the float32 inner loops); rows are cut
//   across torch's OpenMP pool (at::parallel_for) only when there are enough of them to pay for
//   waking it: a decode step's rows run on the calling thread.
// Fails how: bad shapes, dtypes or strides, a position outside the cos/sin tables or a slot
//   outside the cache raise ValueError (TORCH_CHECK_VALUE) before any work.
// Build: compiled inside cpu_attention.cpp's translation unit (it includes this file at its end),
//   so torch's headers, most of either file's compile time, are parsed once; hence its own
//   namespace, llm_cpu_fused. worker/kernels/cpu_attention.py hashes and copies both files.
// Proven by tests/test_cpu_fused.py (against the torch formulas, every dtype, strided inputs,
//   the engine's greedy tokens with and without the fused ops).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace llm_cpu_fused {

using at::BFloat16;
using at::Half;

// Elements of work below which a call stays on the calling thread.
constexpr int64_t kSerialElems = 1 << 15;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kSerialElems / std::max<int64_t>(1, row_elems));
}

// Calls f(T{}) for the activation dtypes the ops take (the checks have rejected the others).
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(BFloat16{}); break;
    case at::kHalf: f(Half{}); break;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", t);
  }
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);  // float32: as is; bfloat16 / float16: round to nearest even
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 2, name, " must be [T, C], got ", x.dim(), " dims");
  TORCH_CHECK_VALUE(x.stride(1) == 1, name, ": columns must be contiguous");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                        x.scalar_type() == at::kHalf,
                    name, " must be float32, bfloat16 or float16, got ", x.scalar_type());
}

// ------------------------------------------------------------------------------- RMSNorm
// No fused multiply-add (also inside the parallel_for lambda, hence a pragma, not an attribute):
// torch rounds each square to float32 before the sum.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor* res_out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rop = res_out ? res_out->data_ptr<T>() : nullptr;
  const int64_t sx = x.stride(0), sr = residual ? residual->stride(0) : 0, so = out.stride(0);
  const int64_t sro = res_out ? res_out->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> row(cols);
    std::vector<float> w(cols);
    for (int64_t c = 0; c < cols; ++c) w[c] = static_cast<float>(wp[c]);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * sx;
      if (rp) {
        const T* rr = rp + r * sr;
        T* ro = rop + r * sro;
        for (int64_t c = 0; c < cols; ++c) {
          T s = round_to<T>(static_cast<float>(xr[c]) + static_cast<float>(rr[c]));
          ro[c] = s;
          row[c] = static_cast<float>(s);
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) row[c] = static_cast<float>(xr[c]);
      }
      float ss = 0.f;
      for (int64_t c = 0; c < cols; ++c) ss += row[c] * row[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + feps);
      T* orow = op + r * so;
      for (int64_t c = 0; c < cols; ++c) {
        const float normed = static_cast<float>(round_to<T>(row[c] * inv));
        orow[c] = round_to<T>(w[c] * normed);
      }
    }
  });
}
#pragma GCC pop_options

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
                    "weight must be a contiguous [C] tensor with C = ", x.size(1));
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight dtype ", weight.scalar_type(),
                    " != x dtype ", x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_impl<scalar_t>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
                    "residual must match x's shape and dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor sum = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_impl<scalar_t>(x, &residual, weight, eps, out, &sum);
  });
  return {out, sum};
}

// ------------------------------------------------------------------------------- RoPE
// No fused multiply-add here: torch rounds x1 * cos and x2 * sin to float32 before the sum.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_heads(const T* src, int64_t head_stride,
                                                               int64_t heads, T* dst, int64_t half,
                                                               const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * head_stride;
    T* y = dst + h * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
      y[i] = round_to<T>(a - b);
      y[i + half] = round_to<T>(e + f);
    }
  }
}

void check_rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3, "q and k must be [T, H, D]");
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
                    "q and k must share T and an even head dim D");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k.stride(2) == 1, "q and k: head dim must be contiguous");
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                        q.scalar_type() == at::kHalf,
                    "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0) &&
                        positions.scalar_type() == at::kLong && positions.is_contiguous(),
                    "positions must be a contiguous [T] int64 tensor");
  const int64_t half = q.size(2) / 2;
  TORCH_CHECK_VALUE(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == half &&
                        cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                        cos.is_contiguous() && sin.is_contiguous(),
                    "cos and sin must be contiguous float32 [P, D/2] tables, D/2 = ", half);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < q.size(0); ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t],
                      " outside the RoPE tables (", cos.size(0), " positions)");
  }
}

// q_out (new, contiguous) = RoPE(q); k_dst(t) = where token t's rotated k heads go (contiguous
// [Hkv, D]), nullptr to skip; after each token, `after(t)` (the v copy).
template <typename T, typename KDst, typename After>
at::Tensor rope_tokens(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& cos, const at::Tensor& sin, KDst k_dst, After after) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  at::Tensor q_out = at::empty({tokens, q.size(1), q.size(2)}, q.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  T* qo = q_out.data_ptr<T>();
  const int64_t row_elems = (q.size(1) + 2 * k.size(1)) * q.size(2);
  at::parallel_for(0, tokens, grain_rows(row_elems), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      rope_heads<T>(qp + t * q.stride(0), q.stride(1), q.size(1), qo + t * q.size(1) * 2 * half, half, c, s);
      T* kd = k_dst(t);
      if (kd != nullptr) rope_heads<T>(kp + t * k.stride(0), k.stride(1), k.size(1), kd, half, c, s);
      after(t);
    }
  });
  return q_out;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  check_rope(positions, q, k, cos, sin);
  at::Tensor k_out = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
  at::Tensor q_out;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* ko = k_out.data_ptr<scalar_t>();
    const int64_t row = k.size(1) * k.size(2);
    q_out = rope_tokens<scalar_t>(
        positions, q, k, cos, sin, [&](int64_t t) { return ko + t * row; }, [](int64_t) {});
  });
  return {q_out, k_out};
}

at::Tensor rope_store_kv(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_rope(positions, q, k, cos, sin);
  TORCH_CHECK_VALUE(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.stride(2) == 1,
                    "v must match k's shape and dtype, head dim contiguous");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
                        k_cache.size(3) == k.size(2),
                    "caches must be [num_blocks, block_size, Hkv, D] with k's Hkv and D");
  TORCH_CHECK_VALUE(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type() &&
                        k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "caches must be contiguous, of k's dtype");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous [T] int64 tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "slot ", slots[t], " outside the cache (", num_slots, " slots)");
  }
  at::Tensor q_out;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const int64_t heads = k.size(1), dim = k.size(2), row = heads * dim;
    q_out = rope_tokens<scalar_t>(
        positions, q, k, cos, sin,
        [&](int64_t t) { return slots[t] < 0 ? nullptr : kc + slots[t] * row; },
        [&](int64_t t) {
          if (slots[t] < 0) return;
          for (int64_t h = 0; h < heads; ++h) {
            std::memcpy(vc + slots[t] * row + h * dim, vp + t * v.stride(0) + h * v.stride(1),
                        dim * sizeof(scalar_t));
          }
        });
  });
  return q_out;
}

// ------------------------------------------------------------------------------- SiLU * up
// exp in float32 for the SiLU: Cody-Waite range reduction, e^r = 1 + r + r^2 P(r) (Cephes'
// expf polynomial, ~1-2 units in the last place), then times 2^n; overflow gives inf, underflow
// 0, NaN stays NaN (min/max return their second operand for NaN). A scalar exp costs ~4 ns,
// which made the op the step's third-largest at batch 8 (12% of it).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
inline void exp_lanes(float* x) {
  __m512 v = _mm512_loadu_ps(x);
  v = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(89.f), v));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  _mm512_storeu_ps(x, _mm512_scalef_ps(y, n));  // y * 2^n, inf / denormal / 0 at the ends
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
inline void exp_lanes(float* x) {
  __m256 v = _mm256_loadu_ps(x);
  v = _mm256_max_ps(_mm256_set1_ps(-104.f), _mm256_min_ps(_mm256_set1_ps(89.f), v));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n in two halves, each a normal float for n in [-150, 129]: inf and denormals come out of
  // the products.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  _mm256_storeu_ps(x, _mm256_mul_ps(_mm256_mul_ps(y, s1), s2));
}
#else
constexpr int kLanes = 1;
inline void exp_lanes(float* x) { x[0] = std::exp(x[0]); }
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), f = x.size(1) / 2, sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * f), [&](int64_t begin, int64_t end) {
    std::vector<float> e(f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * sx;
      const T* up = gate + f;
      T* o = op + r * f;
      for (int64_t i = 0; i < f; ++i) e[i] = -static_cast<float>(gate[i]);
      int64_t i = 0;
      for (; i + kLanes <= f; i += kLanes) exp_lanes(e.data() + i);
      for (; i < f; ++i) e[i] = std::exp(e[i]);
      for (i = 0; i < f; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = round_to<T>(g / (1.f + e[i]));
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, "silu_and_mul needs [T, 2F], got ", x.size(1), " columns");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_impl<scalar_t>(x, out);
  });
  return out;
}

// ------------------------------------------------------------------------------- argmax
// Greedy sampling's argmax of each row, with torch.argmax's answer: the first index of the
// maximum, and a NaN counts as the maximum (the first NaN's index). Read in the logits' own dtype
// (torch's CPU argmax is ~3x slower on bfloat16 than on a float32 copy, and the copy costs more
// than the scan here). AVX-512: 16 values per compare, a block only looked into when it holds a
// NaN or beats the best so far (rarely after the first blocks of a row).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);
    if (_mm512_cmp_ps_mask(v, _mm512_set1_ps(best), _CMP_GT_OQ)) {
      const float m = _mm512_reduce_max_ps(v);
      best = m;
      best_i = i + __builtin_ctz(_mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ));
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "logits");
  TORCH_CHECK_VALUE(x.size(1) > 0, "argmax_rows needs at least one column");
  const int64_t rows = x.size(0), cols = x.size(1), sx = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * sx, cols);
    });
  });
  return out;
}

}  // namespace llm_cpu_fused

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_residual(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rope_store_kv(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("rms_norm", &llm_cpu_fused::rms_norm);
  m.impl("rms_norm_residual", &llm_cpu_fused::rms_norm_residual);
  m.impl("rotary_embedding", &llm_cpu_fused::rotary_embedding);
  m.impl("rope_store_kv", &llm_cpu_fused::rope_store_kv);
  m.impl("silu_and_mul", &llm_cpu_fused::silu_and_mul);
  m.impl("argmax_rows", &llm_cpu_fused::argmax_rows);
}
