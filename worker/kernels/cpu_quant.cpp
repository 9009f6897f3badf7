// Dequantization of torch's CPU int4 weight layout to a bfloat16 matrix, for inputs with many rows
// (prefill chunks, big decode batches): one pass over the packed weight, then a bfloat16 GEMM
// (oneDNN, AVX512-BF16 / AMX where the CPU has them), instead of torch's int4 kernel, which
// re-reads and re-dequantizes the whole weight for every 4 rows of input (worker/kernels/
// cpu_quant.py has the numbers).
//
// Contract:
//   int4_dequant_t(packed uint8 [N, K/2], scales_and_zeros bfloat16 [K/G, N, 2], int G,
//                  int repeats) -> bfloat16 [K/repeats, N]
//     out[k, n] = sum over r < repeats of (q[n, k + r*K/repeats] - 8) * scale[g, n] + zero[g, n]
//     with g = (k + r*K/repeats) / G, summed in float32 and rounded once to bfloat16 (nearest
//     even). The TRANSPOSED weight: x [M, K/repeats] @ out is the layer's output.
//     `packed` is torch._convert_weight_to_int4pack_for_cpu's output in the layout its AVX-512
//     kernel uses: for each block of 64 output rows, K runs of 32 bytes; byte j of run k holds
//     q[64b + j, k] in its low nibble and q[64b + 32 + j, k] in its high one. Other ISAs' torch
//     builds may pack differently: worker/kernels/cpu_quant.py probes the layout once and does
//     not call this op when it differs.
// How: parallel over (64-row block, group of G columns) units across torch's OpenMP pool, the
//   block's scales and zeros loaded once per unit; plain loops the compiler vectorises (-O3
//   -march=native).
// Fails how: N % 64 != 0, K/repeats % G != 0, wrong dtypes or shapes raise ValueError.
// Build: included at the end of cpu_attention.cpp (one translation unit); namespace llm_cpu_quant.
// Proven by tests/test_cpu_quant.py (against Int4Linear.dequantize, the slow reference that
// probes the nibble order; repeats 1 and 2; every group size).

#include <ATen/ops/mm.h>

namespace llm_cpu_quant {

inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
  return uint16_t(u >> 16);
}

at::Tensor int4_dequant_t(const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                          int64_t repeats) {
  TORCH_CHECK_VALUE(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
                    "packed must be a contiguous uint8 [N, K/2] tensor");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK_VALUE(n % 64 == 0, "int4_dequant_t needs N % 64 == 0, got N=", n);
  TORCH_CHECK_VALUE(group_size > 0 && k % group_size == 0, "K=", k, " is not a multiple of G=", group_size);
  TORCH_CHECK_VALUE(repeats >= 1 && k % repeats == 0, "K=", k, " is not a multiple of repeats=", repeats);
  TORCH_CHECK_VALUE(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 &&
                        sz.size(0) == k / group_size && sz.size(1) == n && sz.size(2) == 2,
                    "scales_and_zeros must be a contiguous bfloat16 [K/G, N, 2] tensor");
  const int64_t k_in = k / repeats, blocks = n / 64, groups_in = k_in / group_size;
  TORCH_CHECK_VALUE(k_in % group_size == 0, "K/repeats=", k_in, " is not a multiple of G=", group_size);
  at::Tensor out = at::empty({k_in, n}, packed.options().dtype(at::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // One unit: a block of 64 output rows times one group of G input columns, whose 64 scales and
  // zeros are loaded once and used G times.
  at::parallel_for(0, blocks * groups_in, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(size_t(group_size) * 64);
    float scale[64], zero[64];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / groups_in, gi = u % groups_in;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < repeats; ++r) {
        const int64_t g = gi + r * groups_in;
        const uint16_t* s = szp + (g * n + b * 64) * 2;
        for (int j = 0; j < 64; ++j) {
          uint32_t sb = uint32_t(s[2 * j]) << 16, zb = uint32_t(s[2 * j + 1]) << 16;
          std::memcpy(&scale[j], &sb, 4);
          std::memcpy(&zero[j], &zb, 4);
        }
        const uint8_t* p = src + (b * k + g * group_size) * 32;
        for (int64_t t = 0; t < group_size; ++t, p += 32) {
          float* a = acc.data() + t * 64;
          for (int j = 0; j < 32; ++j) {
            a[j] += float(int(p[j] & 15) - 8) * scale[j] + zero[j];
            a[32 + j] += float(int(p[j] >> 4) - 8) * scale[32 + j] + zero[32 + j];
          }
        }
      }
      for (int64_t t = 0; t < group_size; ++t) {
        const float* a = acc.data() + t * 64;
        uint16_t* o = dst + (gi * group_size + t) * n + b * 64;
        for (int j = 0; j < 64; ++j) o[j] = bf16_bits(a[j]);
      }
    }
  });
  return out;
}

at::Tensor int8_linear_tiled(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t tile) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
                    "x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK_VALUE(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
                    "q must be a contiguous int8 [V, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), v = q.size(0);
  TORCH_CHECK_VALUE(q.size(1) == k, "x has K=", k, " columns, q has ", q.size(1));
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == v && scale.scalar_type() == at::kBFloat16 &&
                        scale.is_contiguous(),
                    "scale must be a contiguous bfloat16 [V] tensor");
  TORCH_CHECK_VALUE(tile >= 16, "tile must be >= 16, got ", tile);
  at::Tensor out = at::empty({m, v}, x.options());
  const int64_t tiles = (v + tile - 1) / tile;
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // Each thread dequantizes a tile of rows into its own buffer (L2-sized) and multiplies it with
  // x there: the weight is read once as int8 and never written out whole. (at::mm inside the
  // parallel region runs on the calling thread.)
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::Tensor buf = at::empty({tile, k}, x.options());
    at::Tensor part = at::empty({m, tile}, x.options());
    uint16_t* bp = reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t v0 = t * tile, rows = std::min(tile, v - v0);
      for (int64_t r = 0; r < rows; ++r) {
        uint32_t sb = uint32_t(sp[v0 + r]) << 16;
        float s;
        std::memcpy(&s, &sb, 4);
        const int8_t* src = qp + (v0 + r) * k;
        uint16_t* dst = bp + r * k;
        for (int64_t c = 0; c < k; ++c) dst[c] = bf16_bits(float(src[c]) * s);
      }
      at::Tensor w = rows == tile ? buf : buf.narrow(0, 0, rows);
      at::Tensor o = rows == tile ? part : at::empty({m, rows}, x.options());
      at::mm_out(o, x, w.t());
      const uint16_t* pp = reinterpret_cast<const uint16_t*>(o.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < m; ++i) std::memcpy(op + i * v + v0, pp + i * rows, size_t(rows) * 2);
    }
  });
  return out;
}

// ---- W4A8: int4 weights x int8 activations with AVX512-VNNI ------------------------------------
//
// int4_vnni_linear(x bf16 [M, K], wq uint8 [N/16, K/8, 16, 4], sz bf16 [N/16, K/32, 2, 16])
//   -> bf16 [M, N] (a row with a NaN or inf gives NaN outputs). wq: for each block of 16 output rows and each run of 8 columns, lane r's 4
//   bytes hold q[16b + r, 8t + j] (low nibble) and q[16b + r, 8t + 4 + j] (high), j < 4; sz: the
//   16 rows' scale then zero per group of 32 columns (Int4Linear's bfloat16 values, w = (q - 8) *
//   scale + zero). x is quantized per row and group of 32 to int8 (d = max|x| / 127, round to
//   nearest), so out[m, n] = sum_g d[m, g] * (scale * sum_k q * xq + (zero - 8 * scale) * sum_k
//   xq), i.e. the float32 dot of the dequantized weights with the int8-rounded activations.
//
// Builds with AVX2 but no AVX512-VNNI (Zen 2/3, Haswell to Comet Lake; also AVX-512 CPUs without
// VNNI, e.g. Skylake-SP, untested) run the same two ops on the same layouts
// with 256-bit registers, a block's 16 rows as two halves of 8 lanes: vpmaddubsw (unsigned x signed
// bytes -> pairs summed into int16) then vpmaddwd by ones (-> int32) does what one vpdpbusd does,
// as llama.cpp's AVX2 dot products do. W4A8: the weight nibbles (0..15) are the unsigned operand,
// so a pair sums to at most 2 * 15 * 127 and a group's 8 pair sums per int16 lane (16 products,
// 30,480) still fit int16 (activations are in [-127, 127]: |x| * round(127 / max|x|) <= 127).
// W8A8: no +128 offset (so `corr` is checked but not read); |w| is the unsigned operand and x
// takes w's sign (vpsignb), so a pair stays within 2 * 128 * 127; each pair sum widens to int32 at
// once. The results are the same
// integers, so the same outputs up to float summation order.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLM_DOTS_AVX512 1
constexpr const char* kDots = "AVX512-VNNI";
#elif defined(__AVX2__) && defined(__FMA__)
#define LLM_DOTS_AVX2 1
constexpr const char* kDots = "AVX2";
#else
constexpr const char* kDots = "";
#endif
constexpr bool kVnni = kDots[0] != '\0';

bool vnni_compiled() { return kVnni; }
std::string int8_dots_isa() { return kDots; }

// 127 / amax for a finite group, 0 for an all-zero one and for amax below ~3.7e-37, where the
// quotient overflows: such a group quantizes to zeros (its values are < 1e-36 anyway).
inline float group_inverse(float amax) {
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  return inv < std::numeric_limits<float>::infinity() ? inv : 0.f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One group of 32 values with AVX-512: the scalar loop's results bit for bit (the same float
// products, rounded to nearest even by vcvtps2dq under the default rounding mode as nearbyint
// rounds them); a group with a NaN or inf gets scale NaN, values 0 and sum 0.
inline void quantize_group(const at::BFloat16* src, int8_t* q, float* d, float* sum) {
  const __m512 lo = llm_cpu_fused::load16(src), hi = llm_cpu_fused::load16(src + 16);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
  const bool finite = (_mm512_cmp_ps_mask(alo, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ahi, inf, _CMP_LT_OQ)) == 0xFFFF;
  if (!finite) {
    std::memset(q, 0, 32);
    *d = std::numeric_limits<float>::quiet_NaN();
    *sum = 0.f;
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
  const __m512 inv = _mm512_set1_ps(group_inverse(amax));
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(qhi));
  *d = amax / 127.f;
  *sum = float(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
// One group of 32 values with AVX2, bit for bit the scalar loop's results (as the AVX-512 one).
inline __m256 bf16x8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline void quantize_group(const at::BFloat16* src, int8_t* q, float* d, float* sum) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 amax = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int j = 0; j < 4; ++j) {
    v[j] = bf16x8(src + 8 * j);
    const __m256 a = _mm256_andnot_ps(sign, v[j]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    amax = _mm256_max_ps(amax, a);
  }
  if (finite != 0xFF) {
    std::memset(q, 0, 32);
    *d = std::numeric_limits<float>::quiet_NaN();
    *sum = 0.f;
    return;
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float top = _mm_cvtss_f32(m);
  const __m256 inv = _mm256_set1_ps(group_inverse(top));
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = top / 127.f;
  *sum = float(_mm_cvtsi128_si32(t));
}
#define LLM_QUANTIZE_GROUP_SIMD 1
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define LLM_QUANTIZE_GROUP_SIMD 1
#endif

// Per row and group of 32: int8 values, the scale d and the sum of the int8 values.
void quantize_rows(const at::BFloat16* x, int64_t m, int64_t k, int8_t* xq, float* d, float* sums) {
  const int64_t groups = k / 32;
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const at::BFloat16* src = x + u * 32;  // rows are contiguous, groups follow each other
#if defined(LLM_QUANTIZE_GROUP_SIMD)
      quantize_group(src, xq + u * 32, d + u, sums + u);
#else
      float v[32], amax = 0.f;
      bool finite = true;
      for (int j = 0; j < 32; ++j) {
        v[j] = float(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
        finite &= std::isfinite(v[j]);
      }
      // A NaN or inf makes the group's scale NaN (and its values 0), so the rows' outputs are NaN
      // as a float product would be, not finite numbers (std::max skips NaN).
      const float scale = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
      const float inv = finite ? group_inverse(amax) : 0.f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = finite ? int(std::nearbyint(v[j] * inv)) : 0;
        xq[u * 32 + j] = int8_t(q);
        sum += q;
      }
      d[u] = scale;
      sums[u] = float(sum);
#endif
    }
  });
}

void check_activations(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
                    "x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK_VALUE(x.size(1) % 32 == 0, "K must be a multiple of 32, got ", x.size(1));
}

// The W4A8 / W8A8 ops' activation quantization as an op of its own, for the tests:
// quantize_activations(x bf16 [M, K]) -> (q int8 [M, K], d float32 [M, K/32], sums float32 [M, K/32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  check_activations(x);
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / 32}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({m, k / 32}, x.options().dtype(at::kFloat));
  quantize_rows(x.data_ptr<at::BFloat16>(), m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<float>());
  return {q, d, sums};
}

// x [M, K] quantized per row and group of 32 (quantize_rows): the int8 values, scales and sums.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  explicit QuantizedRows(const at::Tensor& x)
      : q(size_t(x.numel())), d(size_t(x.numel() / 32)), sums(size_t(x.numel() / 32)) {
    quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), q.data(), d.data(), sums.data());
  }
};

#if defined(LLM_DOTS_AVX512)
inline void store_bf16_16(uint16_t* o, __m512 v) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int r = 0; r < 16; ++r) o[r] = bf16_bits(tmp[r]);
}

// Rows are taken 8, 4, 2 or 1 at a time, each count a compile-time constant so that the rows'
// accumulators stay in registers: f(std::integral_constant<int, R>, m0) for each block.
template <class F>
inline void for_row_blocks(int64_t m, F&& f) {
  for (int64_t m0 = 0; m0 < m;) {
    const int64_t left = m - m0;
    if (left >= 8) f(std::integral_constant<int, 8>{}, m0), m0 += 8;
    else if (left >= 4) f(std::integral_constant<int, 4>{}, m0), m0 += 4;
    else if (left >= 2) f(std::integral_constant<int, 2>{}, m0), m0 += 2;
    else f(std::integral_constant<int, 1>{}, m0), m0 += 1;
  }
}

// The int32 dot products of R rows for one group: A = 2 chains per row below 8 rows (so that one
// row is not bound by dpbusd's latency), else 1; sum(i) adds a row's chains.
template <int R>
struct RowDots {
  static constexpr int A = R <= 4 ? 2 : 1;
  __m512i v[R][A];
  RowDots() {
    for (int i = 0; i < R; ++i)
      for (int a = 0; a < A; ++a) v[i][a] = _mm512_setzero_si512();
  }
  __m512i sum(int i) const { return A == 2 ? _mm512_add_epi32(v[i][0], v[i][A - 1]) : v[i][0]; }
};

// 4 activation bytes as one int32 lane value for the dot products (memcpy: no type punning).
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R activation rows (m0 .. m0+R-1) against one block of 16 output rows: the block's weights are
// loaded once per group for all R rows, and the rows' int32 dot products stay in registers as R
// interleaved dpbusd chains (two per row for R <= 4, so that one row is not bound by the
// instruction's latency). Integer sums: the same result in any order.
template <int R>
inline void int4_vnni_rows(const uint8_t* wb, const uint16_t* sb, int64_t groups, const int8_t* xq,
                           int64_t k, const float* dx, const float* sx, int64_t m0, uint16_t* out,
                           int64_t n) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    RowDots<R> dot;
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512((const void*)(wb + (g * 4 + t) * 64));
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < R; ++i) {
        const int8_t* xw = xq + (m0 + i) * k + g * 32 + 8 * t;
        __m512i* d = dot.v[i];
        d[0] = _mm512_dpbusd_epi32(d[0], lo, bcast4(xw));
        d[RowDots<R>::A - 1] = _mm512_dpbusd_epi32(d[RowDots<R>::A - 1], hi, bcast4(xw + 4));
      }
    }
    const __m512 s = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sb + g * 32))), 16));
    const __m512 z = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sb + g * 32 + 16))), 16));
    const __m512 zm = _mm512_fmadd_ps(_mm512_set1_ps(-8.f), s, z);
    for (int i = 0; i < R; ++i) {
      const int64_t u = (m0 + i) * groups + g;
      const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot.sum(i)), s, _mm512_mul_ps(zm, _mm512_set1_ps(sx[u])));
      acc[i] = _mm512_fmadd_ps(part, _mm512_set1_ps(dx[u]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store_bf16_16(out + (m0 + i) * n, acc[i]);
}

// The W8A8 counterpart: xq holds the activations offset to unsigned bytes, c the offset's
// products (128 * the weights' group sums), sc the rows' scales.
template <int R>
inline void int8_vnni_rows(const int8_t* wb, const int32_t* cb, int64_t groups, const int8_t* xq,
                           int64_t k, const float* dx, __m512 sc, int64_t m0, uint16_t* out, int64_t n) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    RowDots<R> dot;
    for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_loadu_si512((const void*)(wb + (g * 8 + t) * 64));
      for (int i = 0; i < R; ++i) {
        __m512i& d = dot.v[i][t % RowDots<R>::A];
        d = _mm512_dpbusd_epi32(d, bcast4(xq + (m0 + i) * k + g * 32 + 4 * t), w);
      }
    }
    const __m512i c = _mm512_loadu_si512((const void*)(cb + g * 16));
    for (int i = 0; i < R; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot.sum(i), c)),
                               _mm512_set1_ps(dx[(m0 + i) * groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store_bf16_16(out + (m0 + i) * n, _mm512_mul_ps(acc[i], sc));
}
#elif defined(LLM_DOTS_AVX2)
inline void store_bf16_8(uint16_t* o, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int r = 0; r < 8; ++r) o[r] = bf16_bits(tmp[r]);
}

// Rows 4, 2 or 1 at a time (16 ymm registers: a row holds two halves of int and float sums).
template <class F>
inline void for_row_blocks(int64_t m, F&& f) {
  for (int64_t m0 = 0; m0 < m;) {
    const int64_t left = m - m0;
    if (left >= 4) f(std::integral_constant<int, 4>{}, m0), m0 += 4;
    else if (left >= 2) f(std::integral_constant<int, 2>{}, m0), m0 += 2;
    else f(std::integral_constant<int, 1>{}, m0), m0 += 1;
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 bfloat16 values (bits) as floats.
inline __m256 bf16_bits_x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <int R>
inline void int4_vnni_rows(const uint8_t* wb, const uint16_t* sb, int64_t groups, const int8_t* xq,
                           int64_t k, const float* dx, const float* sx, int64_t m0, uint16_t* out,
                           int64_t n) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];  // int16 pair sums: 16 products per value, |sum| <= 30,480
    for (int i = 0; i < R; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + (g * 4 + t) * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < R; ++i) {
          const int8_t* xw = xq + (m0 + i) * k + g * 32 + 8 * t;
          dot[i][h] = _mm256_add_epi16(dot[i][h], _mm256_maddubs_epi16(lo, bcast4(xw)));
          dot[i][h] = _mm256_add_epi16(dot[i][h], _mm256_maddubs_epi16(hi, bcast4(xw + 4)));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = bf16_bits_x8(sb + g * 32 + h * 8), z = bf16_bits_x8(sb + g * 32 + 16 + h * 8);
      const __m256 zm = _mm256_fmadd_ps(_mm256_set1_ps(-8.f), s, z);
      for (int i = 0; i < R; ++i) {
        const int64_t u = (m0 + i) * groups + g;
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[i][h], ones));
        const __m256 part = _mm256_fmadd_ps(d, s, _mm256_mul_ps(zm, _mm256_set1_ps(sx[u])));
        acc[i][h] = _mm256_fmadd_ps(part, _mm256_set1_ps(dx[u]), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) store_bf16_8(out + (m0 + i) * n + h * 8, acc[i][h]);
}

// W8A8 with signed activations (no offset, no correction): sum_k q * xq = sum |q| * (xq * sign q).
template <int R>
inline void int8_vnni_rows(const int8_t* wb, const int64_t groups, const int8_t* xq, int64_t k,
                           const float* dx, const __m256 sc[2], int64_t m0, uint16_t* out, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];
    for (int i = 0; i < R; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(wb + (g * 8 + t) * 64 + h * 32));
        const __m256i aw = _mm256_abs_epi8(w);  // -128 -> 0x80, read as unsigned 128: right
        for (int i = 0; i < R; ++i) {
          const __m256i xs = _mm256_sign_epi8(bcast4(xq + (m0 + i) * k + g * 32 + 4 * t), w);
          dot[i][h] = _mm256_add_epi32(dot[i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m256 d = _mm256_set1_ps(dx[(m0 + i) * groups + g]);
      for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), d, acc[i][h]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < 2; ++h) store_bf16_8(out + (m0 + i) * n + h * 8, _mm256_mul_ps(acc[i][h], sc[h]));
}
#endif

at::Tensor int4_vnni_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz) {
  check_activations(x);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(wq.scalar_type() == at::kByte && wq.is_contiguous() && wq.dim() == 4 &&
                        wq.size(1) == k / 8 && wq.size(2) == 16 && wq.size(3) == 4,
                    "wq must be a contiguous uint8 [N/16, K/8, 16, 4] tensor for K=", k);
  const int64_t blocks = wq.size(0), n = blocks * 16, groups = k / 32;
  TORCH_CHECK_VALUE(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 4 &&
                        sz.size(0) == blocks && sz.size(1) == groups && sz.size(2) == 2 && sz.size(3) == 16,
                    "sz must be a contiguous bfloat16 [N/16, K/32, 2, 16] tensor");
  TORCH_CHECK(kVnni, "int4_vnni_linear: this build has no int8 dot products (vnni_compiled() is false)");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  QuantizedRows rows(x);
  const std::vector<int8_t>& xq = rows.q;
  const std::vector<float>& dx = rows.d;
  const std::vector<float>& sx = rows.sums;
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
#if defined(LLM_DOTS_AVX512) || defined(LLM_DOTS_AVX2)
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* wb = wp + b * (k / 8) * 64;
      const uint16_t* sb = sp + b * groups * 32;
      uint16_t* ob = op + b * 16;
      for_row_blocks(m, [&](auto rows, int64_t m0) {
        int4_vnni_rows<decltype(rows)::value>(wb, sb, groups, xq.data(), k, dx.data(), sx.data(), m0, ob, n);
      });
    }
#endif
  });
  return out;
}

// int8_vnni_linear(x bf16 [M, K], wq int8 [N/16, K/4, 16, 4], corr int32 [N/16, K/32, 16],
//                  scale bf16 [N]) -> bf16 [M, N]: W8A8 for int8 rows with one scale each (the tied
//   lm_head). wq: per block of 16 rows and run of 4 columns, lane r's 4 bytes are q[16b + r, 4t + j];
//   corr = 128 * the sum of each row's q over each group of 32 columns. x is quantized as above
//   and offset by 128 into unsigned bytes (VNNI multiplies unsigned by signed bytes); the offset's
//   products are taken back with corr: out[m, n] = scale[n] * sum_g d[m, g] * sum_k q * xq.
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& corr,
                            const at::Tensor& scale) {
  check_activations(x);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(wq.scalar_type() == at::kChar && wq.is_contiguous() && wq.dim() == 4 &&
                        wq.size(1) == k / 4 && wq.size(2) == 16 && wq.size(3) == 4,
                    "wq must be a contiguous int8 [N/16, K/4, 16, 4] tensor for K=", k);
  const int64_t blocks = wq.size(0), n = blocks * 16, groups = k / 32;
  TORCH_CHECK_VALUE(corr.scalar_type() == at::kInt && corr.is_contiguous() && corr.dim() == 3 &&
                        corr.size(0) == blocks && corr.size(1) == groups && corr.size(2) == 16,
                    "corr must be a contiguous int32 [N/16, K/32, 16] tensor");
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() && scale.dim() == 1 &&
                        scale.size(0) == n,
                    "scale must be a contiguous bfloat16 [N] tensor");
  TORCH_CHECK(kVnni, "int8_vnni_linear: this build has no int8 dot products (vnni_compiled() is false)");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  QuantizedRows rows(x);
  std::vector<int8_t>& xq = rows.q;
  const std::vector<float>& dx = rows.d;
#if defined(LLM_DOTS_AVX512)
  for (auto& v : xq) v = int8_t(uint8_t(int(v) + 128));  // unsigned bytes 1..255, same bits as +128
#endif
  const int8_t* wp = wq.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
#if defined(LLM_DOTS_AVX512)
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* wb = wp + b * (k / 4) * 64;
      const int32_t* cb = cp + b * groups * 16;
      const __m512 sc = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sp + b * 16))), 16));
      uint16_t* ob = op + b * 16;
      for_row_blocks(m, [&](auto rows, int64_t m0) {
        int8_vnni_rows<decltype(rows)::value>(wb, cb, groups, xq.data(), k, dx.data(), sc, m0, ob, n);
      });
    }
#elif defined(LLM_DOTS_AVX2)
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* wb = wp + b * (k / 4) * 64;
      const __m256 sc[2] = {bf16_bits_x8(sp + b * 16), bf16_bits_x8(sp + b * 16 + 8)};
      uint16_t* ob = op + b * 16;
      for_row_blocks(m, [&](auto rows, int64_t m0) {
        int8_vnni_rows<decltype(rows)::value>(wb, groups, xq.data(), k, dx.data(), sc, m0, ob, n);
      });
    }
#endif
  });
  return out;
}

// int8_vnni_embedding(wq int8 [N/16, K/4, 16, 4], scale bf16 [N], ids int64 [T]) -> bf16 [T, K]:
//   rows `ids` of the W8A8 layout above (the tied embedding / lm_head), each value times its row's
//   scale rounded to bfloat16: out[t, c] = bf16(float(q[ids[t], c]) * float(scale[ids[t]])), what
//   `q[ids].to(bf16) * scale[ids, None]` gives in torch, without unpacking or fancy indexing.
at::Tensor int8_vnni_embedding(const at::Tensor& wq, const at::Tensor& scale, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(wq.scalar_type() == at::kChar && wq.is_contiguous() && wq.dim() == 4 && wq.size(2) == 16 &&
                        wq.size(3) == 4,
                    "wq must be a contiguous int8 [N/16, K/4, 16, 4] tensor");
  const int64_t n = wq.size(0) * 16, k = wq.size(1) * 4;
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() && scale.dim() == 1 &&
                        scale.size(0) == n,
                    "scale must be a contiguous bfloat16 [N] tensor");
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be an int64 [T] tensor");
  const at::Tensor idc = ids.contiguous();
  const int64_t t = idc.size(0);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK_VALUE(ip[i] >= 0 && ip[i] < n, "token id ", ip[i], " outside the embedding's ", n, " rows");
  at::Tensor out = at::empty({t, k}, scale.options());
  const int8_t* wp = wq.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = ip[i], b = row / 16, r = row % 16;
      uint32_t bits = uint32_t(sp[row]) << 16;
      float sc;
      std::memcpy(&sc, &bits, 4);
      const int8_t* src = wp + b * (k / 4) * 64 + r * 4;  // run u of 4 columns at src + u * 64
      uint16_t* dst = op + i * k;
      for (int64_t u = 0; u < k / 4; ++u)
        for (int j = 0; j < 4; ++j) dst[u * 4 + j] = bf16_bits(float(src[u * 64 + j]) * sc);
    }
  });
  return out;
}

}  // namespace llm_cpu_quant

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("int4_dequant_t(Tensor packed, Tensor scales_and_zeros, int group_size, int repeats) -> Tensor");
  m.def("int8_linear_tiled(Tensor x, Tensor q, Tensor scale, int tile) -> Tensor");
  m.def("int4_vnni_linear(Tensor x, Tensor wq, Tensor sz) -> Tensor");
  m.def("int8_vnni_linear(Tensor x, Tensor wq, Tensor corr, Tensor scale) -> Tensor");
  m.def("int8_vnni_embedding(Tensor wq, Tensor scale, Tensor ids) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("vnni_compiled() -> bool", &llm_cpu_quant::vnni_compiled);
  m.def("int8_dots_isa() -> str", &llm_cpu_quant::int8_dots_isa);
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("int4_dequant_t", &llm_cpu_quant::int4_dequant_t);
  m.impl("int8_linear_tiled", &llm_cpu_quant::int8_linear_tiled);
  m.impl("int4_vnni_linear", &llm_cpu_quant::int4_vnni_linear);
  m.impl("int8_vnni_linear", &llm_cpu_quant::int8_vnni_linear);
  m.impl("int8_vnni_embedding", &llm_cpu_quant::int8_vnni_embedding);
  m.impl("quantize_activations", &llm_cpu_quant::quantize_activations);
}
