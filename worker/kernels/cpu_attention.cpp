// Batched paged attention for CPU: the "cpu" attention backend's op, `llm_cpu::paged_attention`.
//
// Contract (the same as worker/kernels/reference.py `paged_attention`):
//   q [T, H, D] (any row/head strides, unit inner stride), k_cache/v_cache [NB, BS, Hkv, D]
//   (unit inner stride), block_tables [S, W] int32, seq_lens [S] int32 (cached + new tokens),
//   query_start_loc [S + 1] int32. Each sequence's new tokens are its last query_len positions:
//   causal among themselves, full over the cached prefix. GQA: head h reads KV head h / (H / Hkv).
//   dtypes: q, K and V all float32, bfloat16 or float16 (the same one). Returns a new contiguous
//   [T, H, D] tensor of q's dtype; rows past query_start_loc[S] are zero. Scores, softmax and the
//   weighted sum of V are float32 whatever the storage dtype.
// How: one pass of online softmax (flash-decoding style) per work item, reading K/V rows in place
//   from the paged cache (no gather, no padding). A work item is (sequence, KV head, tile of query
//   rows, key range): all the query heads of a GQA group and a few query rows share every K/V row
//   read. Items are cut into one contiguous run per thread of roughly equal cost and run under
//   at::parallel_for (torch's own OpenMP pool). When there are too few items for the threads
//   (small decode batches), long decode rows are split over key ranges and the partial
//   (max, sum, acc) triples are merged afterwards. Prefill chunks of at least
//   `sdpa_min_query_len` rows (0: never, the default: this kernel measured faster at every chunk
//   length tried, docs/kernels.md) go to torch's SDPA flash kernel instead, one sequence at a
//   time, as worker/kernels/torch_attention.py does.
// SIMD: AVX-512F, else AVX2 + FMA + F16C, else scalar, chosen at compile time (the build is
//   -march=native and cached per CPU-flag set by worker/kernels/cpu_attention.py).
// Fails how: bad shapes, dtypes, strides or metadata (a sequence longer than its block-table row,
//   a block id outside the pool, query_len > seq_len, non-monotonic query_start_loc) raise
//   ValueError (TORCH_CHECK_VALUE) before any work.
// Proven by tests/test_cpu_attention.py (against the reference; AVX2 build included).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <set>
#include <mutex>
#include <string>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define LLM_CPU_SIMD 1
#endif

namespace {

using at::BFloat16;
using at::Half;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- SIMD layer: W float lanes.
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int W = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
constexpr int kRegs = 32;
// The sums of a0..a3, one per lane of the result: 9 shuffles and 5 adds for four dot products.
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  vec s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  vec s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
  vec t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}
// 2^x, relative error < 1e-8 on [-126, 126]; 0 below -126; NaN stays NaN.
inline vec vexp2(vec x) {
  const vec lo = _mm512_set1_ps(-126.0f);
  __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);
  x = _mm512_min_ps(_mm512_set1_ps(126.0f), _mm512_max_ps(lo, x));
  vec xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec f = _mm512_sub_ps(x, xi);
  vec p = _mm512_set1_ps(1.5252733804059841e-05f);           // ln2^7 / 7!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, xi));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
constexpr int W = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vhmax(vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kRegs = 16;
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  vec h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline vec vexp2(vec x) {
  const vec lo = _mm256_set1_ps(-126.0f);
  vec keep = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);
  x = _mm256_min_ps(_mm256_set1_ps(126.0f), _mm256_max_ps(lo, x));
  vec xi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec f = _mm256_sub_ps(x, xi);
  vec p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381609e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(xi), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
constexpr const char* kIsa = "scalar";
constexpr int W = 1;
using vec = float;
inline vec vload(const float* p) { return *p; }
inline vec vload(const BFloat16* p) { return static_cast<float>(*p); }
inline vec vload(const Half* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vec a) { *p = a; }
inline vec vset1(float x) { return x; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vfma(vec a, vec b, vec c) { return std::fma(a, b, c); }
inline float vsum(vec a) { return a; }
inline vec vexp2(vec x) { return x < -126.0f ? 0.0f : std::exp2(x); }
inline vec vmax(vec a, vec b) { return std::max(a, b); }
inline float vhmax(vec a) { return a; }
constexpr int kRegs = 16;
#endif

constexpr int kMaxTile = 128;     // keys per tile (multiple of W)

// ---------------------------------------------------------------- the work.
struct Item {
  int32_t seq, kvh, row0, nrows, kbeg, kend;
  int32_t part;                   // -1: write the output; else index of its partial slot
};

template <typename T>
struct Problem {
  const T* q; int64_t q_st, q_sh;
  const T* k; int64_t k_sb, k_sr, k_sh;
  const T* v; int64_t v_sb, v_sr, v_sh;
  const int32_t* bt; int64_t bt_s;
  const int32_t* seq_lens;
  const int32_t* qsl;
  T* out;                         // contiguous [T, H, D]
  float* parts;                   // [num_parts, G, D + 2]: m, l, acc
  int H, Hkv, G, D, bs, tile;
  float qscale;                   // scale * log2(e): scores are in log2 units
};

struct Scratch {
  std::vector<float> qf, acc, m, l;
  std::vector<uint16_t> qraw;     // bfloat16 queries as stored, for the bf16 dot-product path
  std::vector<int32_t> lim;
  std::vector<const void*> kp, vp;
  alignas(64) float s[4 * kMaxTile];
  Scratch(int max_nq, int D) : qf(size_t(max_nq) * D), acc(size_t(max_nq) * D), m(max_nq),
                               l(max_nq), qraw(size_t(max_nq) * D), lim(max_nq), kp(2 * kMaxTile),
                               vp(2 * kMaxTile) {}
};

// s[0, n) <- 2^(s - mx), padded to whole vectors with zeros; returns their sum.
inline float exp_and_sum(float* s, int n, float mx) {
  const int padded = (n + W - 1) / W * W;
  for (int j = n; j < padded; ++j) s[j] = kNegInf;
  vec total = vset1(0.0f), shift = vset1(-mx);
  for (int j = 0; j < padded; j += W) {
    vec p = vexp2(vadd(vload(s + j), shift));
    vstore(s + j, p);
    total = vadd(total, p);
  }
  return vsum(total);
}

// One query vector against n keys of a tile: online-softmax update of (m, l, acc). Any head_dim
// (the path for sizes without a compiled-in specialisation; a scalar loop takes the tail).
template <typename T>
inline void attend_tile(const float* qv, const T* const* kp, const T* const* vp, int n, int D,
                        float* s, float& m, float& l, float* acc) {
  const int nv = D / W;
  float mt = kNegInf;
  for (int j = 0; j < n; ++j) {
    const T* kr = kp[j];
    vec a = vset1(0.0f);
    for (int c = 0; c < nv; ++c) a = vfma(vload(qv + c * W), vload(kr + c * W), a);
    float x = vsum(a);
    for (int d = nv * W; d < D; ++d) x += qv[d] * static_cast<float>(kr[d]);
    s[j] = x;
    mt = std::max(mt, x);
  }
  const float mn = std::max(m, mt);
  const float corr = std::exp2(m - mn);           // 0 on the first tile (m = -inf)
  l = l * corr + exp_and_sum(s, n, mn);
  m = mn;
  for (int d = 0; d < D; ++d) acc[d] *= corr;
  for (int j = 0; j < n; ++j) {
    const vec p = vset1(s[j]);
    const T* vr = vp[j];
    for (int c = 0; c < nv; ++c) vstore(acc + c * W, vfma(p, vload(vr + c * W), vload(acc + c * W)));
    for (int d = nv * W; d < D; ++d) acc[d] += s[j] * static_cast<float>(vr[d]);
  }
}

// Up to four query vectors of one KV head (QB <= 4) against one tile of keys, each against its
// first n[q] keys (n[q] <= 0: none; causal prefill rows differ). Every K and V row is loaded once
// for the QB queries, dot products are reduced four at a time, and the QB x NV accumulators stay in
// registers through the weighted sum of V. head_dim = NV * W.
// `pk`/`pv`: rows of the next tile to prefetch, one K and one V row per key of this tile's dot
// products (spread out, so the requests keep the memory system busy without flooding it).
template <typename T, int NV, int QB>
inline void attend_group(const float* qv, const T* const* kp, const T* const* vp, const int* n,
                         float* s, float* m, float* l, float* acc, const T* const* pk,
                         const T* const* pv, int npf, const uint16_t* qraw, float qscale) {
  constexpr int D = NV * W;
  int nmax = 0;
  for (int q = 0; q < QB; ++q) nmax = std::max(nmax, n[q]);
  if (nmax <= 0) return;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, BFloat16> && NV % 2 == 0) {
    // bfloat16 q.K with vdpbf16ps: products of bf16 pairs are exact in fp32 and accumulate in
    // fp32, so this is the float path's arithmetic without converting K; the scale comes after.
    __m512bh qr[QB][NV / 2];
    for (int q = 0; q < QB; ++q)
      for (int c = 0; c < NV / 2; ++c) qr[q][c] = (__m512bh)_mm512_loadu_si512(qraw + q * D + c * 32);
    const __m128 sc4 = _mm_set1_ps(qscale);
    for (int j = 0; j < nmax; ++j) {
      if (j < npf) {
        for (int o = 0; o < int(D * sizeof(T)); o += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(pk[j]) + o);
          __builtin_prefetch(reinterpret_cast<const char*>(pv[j]) + o);
        }
      }
      const T* kr = kp[j];
      vec a[4];
      for (int q = 0; q < 4; ++q) a[q] = vset1(0.0f);
      for (int c = 0; c < NV / 2; ++c) {
        const __m512bh kc = (__m512bh)_mm512_loadu_si512(kr + c * 32);
        for (int q = 0; q < QB; ++q) a[q] = _mm512_dpbf16_ps(a[q], qr[q][c], kc);
      }
      alignas(16) float r[4];
      _mm_store_ps(r, _mm_mul_ps(vsum4(a[0], a[1], a[2], a[3]), sc4));
      for (int q = 0; q < QB; ++q) s[q * kMaxTile + j] = r[q];
    }
  } else
#endif
  {
    vec qr[QB][NV];
    for (int q = 0; q < QB; ++q)
      for (int c = 0; c < NV; ++c) qr[q][c] = vload(qv + q * D + c * W);
    for (int j = 0; j < nmax; ++j) {
      if (j < npf) {
        for (int o = 0; o < int(D * sizeof(T)); o += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(pk[j]) + o);
          __builtin_prefetch(reinterpret_cast<const char*>(pv[j]) + o);
        }
      }
      const T* kr = kp[j];
      vec a[4];
      for (int q = 0; q < QB; ++q) a[q] = vmul(qr[q][0], vload(kr));
      for (int c = 1; c < NV; ++c) {
        const vec kc = vload(kr + c * W);
        for (int q = 0; q < QB; ++q) a[q] = vfma(qr[q][c], kc, a[q]);
      }
#if defined(LLM_CPU_SIMD)
      for (int q = QB; q < 4; ++q) a[q] = vset1(0.0f);
      alignas(16) float r[4];
      _mm_store_ps(r, vsum4(a[0], a[1], a[2], a[3]));
      for (int q = 0; q < QB; ++q) s[q * kMaxTile + j] = r[q];
#else
      for (int q = 0; q < QB; ++q) s[q * kMaxTile + j] = vsum(a[q]);
#endif
    }
  }
  float corr[QB];
  for (int q = 0; q < QB; ++q) {
    float* sq = s + q * kMaxTile;
    if (n[q] <= 0) {                              // this row sees none of these keys
      std::fill_n(sq, nmax, 0.0f);
      corr[q] = 1.0f;
      continue;
    }
    const int padded = (nmax + W - 1) / W * W;
    for (int j = n[q]; j < padded; ++j) sq[j] = kNegInf;
    vec mv = vset1(kNegInf);
    for (int j = 0; j < padded; j += W) mv = vmax(mv, vload(sq + j));
    const float mn = std::max(m[q], vhmax(mv));
    corr[q] = std::exp2(m[q] - mn);               // 0 on a row's first tile (m = -inf)
    l[q] = l[q] * corr[q] + exp_and_sum(sq, padded, mn);
    m[q] = mn;
  }
  vec ar[QB][NV];
  for (int q = 0; q < QB; ++q) {
    const vec cv = vset1(corr[q]);
    for (int c = 0; c < NV; ++c) ar[q][c] = vmul(vload(acc + q * D + c * W), cv);
  }
  for (int j = 0; j < nmax; ++j) {
    const T* vr = vp[j];
    vec p[QB];
    for (int q = 0; q < QB; ++q) p[q] = vset1(s[q * kMaxTile + j]);
    for (int c = 0; c < NV; ++c) {
      const vec vc = vload(vr + c * W);
      for (int q = 0; q < QB; ++q) ar[q][c] = vfma(p[q], vc, ar[q][c]);
    }
  }
  for (int q = 0; q < QB; ++q)
    for (int c = 0; c < NV; ++c) vstore(acc + q * D + c * W, ar[q][c]);
}

// Queries per group: their vectors and accumulators should fit the vector registers.
template <int NV>
constexpr int group_size() {
  return NV <= 0 ? 1 : std::max(1, std::min(4, kRegs / (2 * NV)));
}

// Keys an item reads: up to its last query row's position (causal), within its key range.
template <typename T>
inline int item_end(const Problem<T>& pb, const Item& it) {
  const int qlen = pb.qsl[it.seq + 1] - pb.qsl[it.seq];
  return std::min(it.kend, pb.seq_lens[it.seq] - qlen + it.row0 + it.nrows);
}

// Row pointers of keys [j0, j0 + n) of an item's sequence and KV head, walking its blocks in place.
template <typename T>
inline void tile_rows(const Problem<T>& pb, const Item& it, int j0, int n, const T** kp, const T** vp) {
  const int32_t* table = pb.bt + it.seq * pb.bt_s;
  int b = j0 / pb.bs, r = j0 % pb.bs;
  const T* kb = pb.k + int64_t(table[b]) * pb.k_sb + it.kvh * pb.k_sh;
  const T* vb = pb.v + int64_t(table[b]) * pb.v_sb + it.kvh * pb.v_sh;
  for (int j = 0; j < n; ++j, ++r) {
    if (r == pb.bs) {
      r = 0;
      ++b;
      kb = pb.k + int64_t(table[b]) * pb.k_sb + it.kvh * pb.k_sh;
      vb = pb.v + int64_t(table[b]) * pb.v_sb + it.kvh * pb.v_sh;
    }
    kp[j] = kb + r * pb.k_sr;
    vp[j] = vb + r * pb.v_sr;
  }
}

template <typename T>
inline void prefetch_rows(const T* const* kp, const T* const* vp, int n, int row_bytes) {
  for (int j = 0; j < n; ++j)
    for (int o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kp[j]) + o);
      __builtin_prefetch(reinterpret_cast<const char*>(vp[j]) + o);
    }
}

template <typename T, int NV>
void run_item(const Problem<T>& pb, const Item& it, const Item* next, Scratch& sc) {
  const int D = pb.D, G = pb.G;
  const int nq = it.nrows * G;
  const int qstart = pb.qsl[it.seq];
  const int qlen = pb.qsl[it.seq + 1] - qstart;
  const int prefix = pb.seq_lens[it.seq] - qlen;
  // Queries (scaled into log2 units), causal key limits, fresh accumulators.
  for (int r = 0; r < it.nrows; ++r) {
    const int t = qstart + it.row0 + r;
    for (int g = 0; g < G; ++g) {
      const int qi = r * G + g;
      const T* src = pb.q + t * pb.q_st + (it.kvh * G + g) * pb.q_sh;
      float* dst = sc.qf.data() + size_t(qi) * D;
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * pb.qscale;
      if constexpr (std::is_same_v<T, BFloat16>)
        std::memcpy(sc.qraw.data() + size_t(qi) * D, src, size_t(D) * sizeof(T));
      std::fill_n(sc.acc.data() + size_t(qi) * D, D, 0.0f);
      sc.m[qi] = kNegInf;
      sc.l[qi] = 0.0f;
      sc.lim[qi] = std::min(it.kend, prefix + it.row0 + r + 1);
    }
  }
  const int kend = item_end(pb, it);
  const T** kp = reinterpret_cast<const T**>(sc.kp.data());
  const T** vp = reinterpret_cast<const T**>(sc.vp.data());
  const T** kp_next = kp + kMaxTile;
  const T** vp_next = vp + kMaxTile;
  if (it.kbeg < kend) tile_rows(pb, it, it.kbeg, std::min(pb.tile, kend - it.kbeg), kp, vp);
  for (int j0 = it.kbeg; j0 < kend; j0 += pb.tile) {
    const int nk = std::min(pb.tile, kend - j0);
    // The blocks are scattered, so no hardware prefetcher can guess the next tile (this item's,
    // or the next item's first one): ask for it now.
    const int j1 = j0 + nk;
    int npf = 0;                                  // rows of the next tile to prefetch
    if (j1 < kend) {
      npf = std::min(pb.tile, kend - j1);
      tile_rows(pb, it, j1, npf, kp_next, vp_next);
    } else if (next != nullptr) {
      const int next_end = item_end(pb, *next);
      if (next->kbeg < next_end) {
        npf = std::min(pb.tile, next_end - next->kbeg);
        tile_rows(pb, *next, next->kbeg, npf, kp_next, vp_next);
      }
    }
    // The first query group's dot products interleave the requests (at most one per key of this
    // tile; the rest go out at once). The generic path asks for them all at once.
    const int spread = NV > 0 ? std::min(npf, nk) : 0;
    if (npf > spread) prefetch_rows(kp_next + spread, vp_next + spread, npf - spread, D * int(sizeof(T)));
    if constexpr (NV > 0) {
      constexpr int QB = group_size<NV>();
      for (int q0 = 0; q0 < nq; q0 += QB) {
        const int pf = q0 == 0 ? spread : 0;
        int n[QB];
        const int nb = std::min(QB, nq - q0);
        for (int q = 0; q < nb; ++q) n[q] = std::min(nk, sc.lim[q0 + q] - j0);
        float* qv = sc.qf.data() + size_t(q0) * D;
        float* acc = sc.acc.data() + size_t(q0) * D;
        const uint16_t* qr = sc.qraw.data() + size_t(q0) * D;
        if (nb == 4) {
          if constexpr (QB >= 4) attend_group<T, NV, 4>(qv, kp, vp, n, sc.s, &sc.m[q0], &sc.l[q0], acc, kp_next, vp_next, pf, qr, pb.qscale);
        } else if (nb == 3) {
          if constexpr (QB >= 3) attend_group<T, NV, 3>(qv, kp, vp, n, sc.s, &sc.m[q0], &sc.l[q0], acc, kp_next, vp_next, pf, qr, pb.qscale);
        } else if (nb == 2) {
          if constexpr (QB >= 2) attend_group<T, NV, 2>(qv, kp, vp, n, sc.s, &sc.m[q0], &sc.l[q0], acc, kp_next, vp_next, pf, qr, pb.qscale);
        } else {
          attend_group<T, NV, 1>(qv, kp, vp, n, sc.s, &sc.m[q0], &sc.l[q0], acc, kp_next, vp_next, pf, qr, pb.qscale);
        }
      }
    } else {
      for (int qi = 0; qi < nq; ++qi) {
        const int n = std::min(nk, sc.lim[qi] - j0);
        if (n <= 0) continue;
        attend_tile<T>(sc.qf.data() + size_t(qi) * D, kp, vp, n, D, sc.s, sc.m[qi], sc.l[qi],
                       sc.acc.data() + size_t(qi) * D);
      }
    }
    std::swap(kp, kp_next);
    std::swap(vp, vp_next);
  }
  if (it.part < 0) {
    for (int r = 0; r < it.nrows; ++r) {
      const int t = qstart + it.row0 + r;
      for (int g = 0; g < G; ++g) {
        const int qi = r * G + g;
        const float inv = 1.0f / sc.l[qi];
        const float* a = sc.acc.data() + size_t(qi) * D;
        T* dst = pb.out + (int64_t(t) * pb.H + it.kvh * G + g) * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * inv);
      }
    }
  } else {
    float* part = pb.parts + int64_t(it.part) * G * (D + 2);
    for (int g = 0; g < G; ++g) {
      part[g] = sc.m[g];
      part[G + g] = sc.l[g];
    }
    std::copy_n(sc.acc.data(), size_t(G) * D, part + 2 * G);
  }
}

// Merge the partials of one split decode row: out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.
template <typename T>
void merge_parts(const Problem<T>& pb, const Item& first, int nparts, std::vector<float>& buf) {
  const int D = pb.D, G = pb.G;
  const int t = pb.qsl[first.seq];
  buf.assign(D, 0.0f);
  for (int g = 0; g < G; ++g) {
    float mx = kNegInf;
    for (int i = 0; i < nparts; ++i) mx = std::max(mx, pb.parts[int64_t(first.part + i) * G * (D + 2) + g]);
    float den = 0.0f;
    std::fill(buf.begin(), buf.end(), 0.0f);
    for (int i = 0; i < nparts; ++i) {
      const float* part = pb.parts + int64_t(first.part + i) * G * (D + 2);
      const float w = std::exp2(part[g] - mx);
      den += w * part[G + g];
      const float* a = part + 2 * G + g * D;
      for (int d = 0; d < D; ++d) buf[d] += w * a[d];
    }
    const float inv = 1.0f / den;
    T* dst = pb.out + (int64_t(t) * pb.H + first.kvh * G + g) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(buf[d] * inv);
  }
}

template <typename T, int NV>
void run_items(const Problem<T>& pb, const std::vector<Item>& items, const std::vector<int64_t>& cuts,
               int max_nq) {
  const int64_t nchunks = int64_t(cuts.size()) - 1;
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(max_nq, pb.D);
    for (int64_t c = begin; c < end; ++c)
      for (int64_t i = cuts[c]; i < cuts[c + 1]; ++i)
        run_item<T, NV>(pb, items[i], i + 1 < cuts[c + 1] ? &items[i + 1] : nullptr, sc);
  });
}

template <typename T>
void run_items_any_dim(const Problem<T>& pb, const std::vector<Item>& items,
                       const std::vector<int64_t>& cuts, int max_nq) {
  switch (pb.D % W == 0 ? pb.D / W : 0) {
#if defined(__AVX512F__)
    case 4: return run_items<T, 4>(pb, items, cuts, max_nq);      // head_dim 64
    case 8: return run_items<T, 8>(pb, items, cuts, max_nq);      // head_dim 128
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case 8: return run_items<T, 8>(pb, items, cuts, max_nq);      // head_dim 64
    case 16: return run_items<T, 16>(pb, items, cuts, max_nq);    // head_dim 128
#endif
    default: return run_items<T, 0>(pb, items, cuts, max_nq);
  }
}

// Long prefill chunk of sequence i through SDPA (the path of worker/kernels/torch_attention.py).
void sdpa_chunk(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, int i, int qstart, int qlen, int seq_len,
                double scale, at::Tensor& out) {
  const int64_t bs = k_cache.size(1);
  const int64_t nblocks = (seq_len + bs - 1) / bs;
  at::Tensor blocks = block_tables.select(0, i).slice(0, 0, nblocks).to(at::kLong);
  at::Tensor k = k_cache.index_select(0, blocks).flatten(0, 1).slice(0, 0, seq_len);   // (L, Hkv, D)
  at::Tensor v = v_cache.index_select(0, blocks).flatten(0, 1).slice(0, 0, seq_len);
  const int prefix = seq_len - qlen;
  std::optional<at::Tensor> mask;
  if (prefix > 0) {
    at::Tensor keys = at::arange(seq_len, at::TensorOptions().dtype(at::kLong));
    at::Tensor queries = at::arange(prefix, seq_len, at::TensorOptions().dtype(at::kLong));
    mask = keys.unsqueeze(0).le(queries.unsqueeze(1));                               // (Q, L)
  }
  // 4-D inputs: with 3-D ones torch's CPU SDPA skips its flash kernel.
  at::Tensor o = at::scaled_dot_product_attention(
      q.slice(0, qstart, qstart + qlen).transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
      v.transpose(0, 1).unsqueeze(0), mask, 0.0, /*is_causal=*/prefix == 0, scale, /*enable_gqa=*/true);
  out.slice(0, qstart, qstart + qlen).copy_(o.squeeze(0).transpose(0, 1));
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& bt, const at::Tensor& seq_lens_t, const at::Tensor& qsl_t, double scale,
         int64_t sdpa_min_query_len, at::Tensor& out) {
  Problem<T> pb{};
  pb.q = q.data_ptr<T>(); pb.q_st = q.stride(0); pb.q_sh = q.stride(1);
  pb.k = k_cache.data_ptr<T>(); pb.k_sb = k_cache.stride(0); pb.k_sr = k_cache.stride(1); pb.k_sh = k_cache.stride(2);
  pb.v = v_cache.data_ptr<T>(); pb.v_sb = v_cache.stride(0); pb.v_sr = v_cache.stride(1); pb.v_sh = v_cache.stride(2);
  pb.bt = bt.data_ptr<int32_t>(); pb.bt_s = bt.stride(0);
  pb.seq_lens = seq_lens_t.data_ptr<int32_t>();
  pb.qsl = qsl_t.data_ptr<int32_t>();
  pb.out = out.data_ptr<T>();
  pb.H = int(q.size(1)); pb.Hkv = int(k_cache.size(2)); pb.G = pb.H / pb.Hkv; pb.D = int(q.size(2));
  pb.bs = int(k_cache.size(1));
  pb.qscale = float(scale) * kLog2e;
  // Keys per tile: K and V tiles of at most 16 KiB each stay in L1 while the group's queries reuse them.
  const int row_bytes = pb.D * int(sizeof(T));
  pb.tile = std::max(W, std::min(kMaxTile, (16384 / row_bytes) / W * W));

  const int S = int(seq_lens_t.size(0));
  const int G = pb.G;
  // Query rows per prefill item: about 16 query vectors share each K/V row.
  const int prefill_rows = std::max(1, 16 / G);
  std::vector<Item> items;
  std::vector<int64_t> cost;                      // per item: keys x (query vectors + 2)
  items.reserve(size_t(S) * pb.Hkv);
  int64_t decode_keys = 0;
  for (int i = 0; i < S; ++i) {
    const int qlen = pb.qsl[i + 1] - pb.qsl[i];
    const int len = pb.seq_lens[i];
    if (qlen == 0) continue;
    if (sdpa_min_query_len > 0 && qlen >= sdpa_min_query_len) {
      sdpa_chunk(q, k_cache, v_cache, bt, i, pb.qsl[i], qlen, len, scale, out);
      continue;
    }
    const int rows = qlen == 1 ? 1 : prefill_rows;
    for (int h = 0; h < pb.Hkv; ++h)
      for (int r0 = 0; r0 < qlen; r0 += rows) {
        const int nr = std::min(rows, qlen - r0);
        const int kend = len - qlen + r0 + nr;
        items.push_back({i, h, r0, nr, 0, kend, -1});
        cost.push_back(int64_t(kend) * (nr * G + 2));
        if (qlen == 1) decode_keys += kend;
      }
  }
  if (items.empty()) return;

  // Too few items for the threads (small decode batches, long contexts): split long decode rows
  // into key ranges, so every thread gets about 4 pieces' worth of work.
  const int nthreads = at::get_num_threads();
  int num_parts = 0;
  std::vector<std::pair<int64_t, int>> merges;    // (first piece's item index, pieces)
  if (nthreads > 1 && int64_t(items.size()) < 4 * nthreads && decode_keys > 0) {
    const int64_t chunk = std::max<int64_t>(256, (decode_keys + 4 * nthreads - 1) / (4 * nthreads));
    std::vector<Item> split;
    std::vector<int64_t> split_cost;
    for (size_t n = 0; n < items.size(); ++n) {
      const Item& it = items[n];
      const int64_t keys = it.kend - it.kbeg;
      const bool decode = pb.qsl[it.seq + 1] - pb.qsl[it.seq] == 1;
      const int pieces = decode ? int((keys + chunk - 1) / chunk) : 1;
      if (pieces <= 1) {
        split.push_back(it);
        split_cost.push_back(cost[n]);
        continue;
      }
      merges.emplace_back(int64_t(split.size()), pieces);
      const int64_t step = (keys + pieces - 1) / pieces;
      for (int p = 0; p < pieces; ++p) {
        Item piece = it;
        piece.kbeg = int32_t(it.kbeg + p * step);
        piece.kend = int32_t(std::min<int64_t>(it.kend, it.kbeg + (p + 1) * step));
        piece.part = num_parts++;
        split.push_back(piece);
        split_cost.push_back(int64_t(piece.kend - piece.kbeg) * (G + 2));
      }
    }
    items.swap(split);
    cost.swap(split_cost);
  }
  std::vector<float> parts_buf(size_t(num_parts) * G * (pb.D + 2));
  pb.parts = parts_buf.data();

  // One contiguous run of items per thread, of about equal cost.
  const int64_t nchunks = std::min<int64_t>(nthreads, int64_t(items.size()));
  std::vector<int64_t> prefix_cost(items.size() + 1, 0);
  for (size_t n = 0; n < items.size(); ++n) prefix_cost[n + 1] = prefix_cost[n] + cost[n];
  std::vector<int64_t> cuts(nchunks + 1, int64_t(items.size()));
  cuts[0] = 0;
  for (int64_t c = 1; c < nchunks; ++c) {
    const int64_t target = prefix_cost.back() * c / nchunks;
    cuts[c] = std::lower_bound(prefix_cost.begin(), prefix_cost.end(), target) - prefix_cost.begin();
    cuts[c] = std::max(cuts[c], cuts[c - 1]);
  }
  const int max_nq = std::max(G, prefill_rows * G);
  run_items_any_dim<T>(pb, items, cuts, max_nq);

  if (!merges.empty()) {
    at::parallel_for(0, int64_t(merges.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t m = begin; m < end; ++m) merge_parts<T>(pb, items[merges[m].first], merges[m].second, buf);
    });
  }
}

void check_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& bt, const at::Tensor& seq_lens, const at::Tensor& qsl) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "bad shapes: q ", q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0, "head layout mismatch: q heads ",
                    H, "x", D, ", kv heads ", Hkv, "x", k_cache.size(3));
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
                    "dtype mismatch: q ", q.scalar_type(), ", k ", k_cache.scalar_type(), ", v ", v_cache.scalar_type());
  const auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                    "unsupported dtype ", dt, " (float32, bfloat16 or float16)");
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &bt, &seq_lens, &qsl})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "all tensors must be on the CPU, got ", t->device());
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                    "q, k_cache and v_cache need a unit stride along head_dim");
  TORCH_CHECK_VALUE(bt.dim() == 2 && seq_lens.dim() == 1 && qsl.dim() == 1, "bad metadata shapes: block_tables ",
                    bt.sizes(), ", seq_lens ", seq_lens.sizes(), ", query_start_loc ", qsl.sizes());
  TORCH_CHECK_VALUE(bt.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                    qsl.scalar_type() == at::kInt, "block_tables, seq_lens and query_start_loc must be int32");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK_VALUE(qsl.size(0) == S + 1 && bt.size(0) == S, "batch mismatch: seq_lens ", S,
                    ", query_start_loc ", qsl.size(0), ", block_tables ", bt.size(0));
}

// Value checks on the (contiguous) metadata: nothing the kernel reads can be out of bounds.
void check_metadata(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& bt,
                    const at::Tensor& seq_lens, const at::Tensor& qsl) {
  const int64_t S = seq_lens.size(0), bs = k_cache.size(1), nb = k_cache.size(0), width = bt.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* table = bt.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(S == 0 || starts[0] == 0, "query_start_loc must start at 0, got ", starts[0]);
  TORCH_CHECK_VALUE(starts[S] <= q.size(0), "query_start_loc ends at ", starts[S], " past the ",
                    q.size(0), " query rows");
  for (int64_t i = 0; i < S; ++i) {
    const int64_t qlen = int64_t(starts[i + 1]) - starts[i], len = lens[i];
    TORCH_CHECK_VALUE(qlen >= 0, "query_start_loc decreases at sequence ", i);
    TORCH_CHECK_VALUE(len >= qlen, "sequence ", i, " has ", qlen, " new tokens but seq_len ", len);
    TORCH_CHECK_VALUE(len <= width * bs, "a sequence of ", len, " tokens needs more than the ", width,
                      " blocks of ", bs, " its block table row holds");
    if (qlen == 0) continue;
    const int64_t used = (len + bs - 1) / bs;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = table[i * width + b];
      TORCH_CHECK_VALUE(id >= 0 && id < nb, "sequence ", i, " block ", b, " is ", id,
                        ", outside the pool of ", nb, " blocks");
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sdpa_min_query_len) {
  check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  const at::Tensor bt = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  check_metadata(q, k_cache, bt, lens, starts);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t covered = starts.size(0) ? starts.data_ptr<int32_t>()[starts.size(0) - 1] : 0;
  if (covered < q.size(0)) out.slice(0, covered).zero_();
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, bt, lens, starts, scale, sdpa_min_query_len, out); break;
    case at::kBFloat16: run<BFloat16>(q, k_cache, v_cache, bt, lens, starts, scale, sdpa_min_query_len, out); break;
    default: run<Half>(q, k_cache, v_cache, bt, lens, starts, scale, sdpa_min_query_len, out); break;
  }
  return out;
}

// Diagnostics for the tests: the SIMD path compiled in, and how many distinct threads
// at::parallel_for really runs `items` one-item chunks on (proves the OpenMP pool is used).
std::string build_info() {
#if defined(_OPENMP)
  return std::string(kIsa) + " openmp";
#else
  return std::string(kIsa) + " no-openmp";
#endif
}

int64_t parallel_threads(int64_t items) {
  std::mutex mu;
  std::set<int> seen;
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(at::get_thread_num());
  });
  return int64_t(seen.size());
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int sdpa_min_query_len) -> Tensor");
  m.def("build_info() -> str", &build_info);
  m.def("parallel_threads(int items) -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}

// The fused norm / RoPE / SiLU ops, in this translation unit: torch's headers are parsed once
// (they are most of each file's compile time: ~7 of the 9 s this one takes here).
#include "cpu_fused.cpp"

// The int4 -> bfloat16 dequantization for many-row inputs (worker/kernels/cpu_quant.py).
#include "cpu_quant.cpp"

// The decoder layers of a step as one op over the ops above (worker/kernels/cpu_layers.py).
#include "cpu_layers.cpp"
