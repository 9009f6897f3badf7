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

}  // namespace llm_cpu_quant

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("int4_dequant_t(Tensor packed, Tensor scales_and_zeros, int group_size, int repeats) -> Tensor");
  m.def("int8_linear_tiled(Tensor x, Tensor q, Tensor scale, int tile) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("int4_dequant_t", &llm_cpu_quant::int4_dequant_t);
  m.impl("int8_linear_tiled", &llm_cpu_quant::int8_linear_tiled);
}
