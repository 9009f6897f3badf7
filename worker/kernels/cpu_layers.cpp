// The decoder layers of one model step as one op call: the per-layer sequence of worker/model/
// llama.py's fused CPU path (norm, q|k|v, RoPE + cache write, paged attention, o, norm, gate|up,
// SiLU*mul, down) run from C++, calling this translation unit's ops directly.
//
// Why: a batch-1 decode step of SmolLM2 makes ~270 op calls from Python (9 per layer x 30), each
// ~4-6 us of module call, dispatch and argument handling on top of its kernel: ~1.5 ms of a ~5.5 ms
// step on a 2-vCPU EPYC (docs/cpu-serving.md). Here the loop and the glue (views, splits) cost
// microseconds for the whole step, and the GIL is released for all of it.
//
// Contract:
//   decoder_layers(x bf16 [T, C], positions int64 [T], k_caches[L], v_caches[L] (contiguous
//     [blocks, block_size, Hkv, D], x's dtype), slot_mapping int64 [T], block_tables int32 [S, W],
//     seq_lens int32 [S], query_start_loc int32 [S + 1], cos, sin float32 [P, D/2],
//     weights[18 L], eps, scale, num_heads, num_kv_heads, head_dim, sdpa_min_query_len,
//     lora[12 L S], lora_rows[S]) -> (h [T, C], residual [T, C])
//   per layer l, weights[18 l ..]: input norm weight [C]; q|k|v linear (4 tensors); o linear (4);
//   post-attention norm weight [C]; gate|up linear (4); down linear (4). A linear is three tensors
//   and its bias (bf16 [N], or an empty tensor for none); the three are one of
//     W4A8: (wq uint8 [N/16, K/8, 16, 4], sz bf16, unused) -> int4_vnni_linear;
//     W8A8: (wq int8 [N/16, K/4, 16, 4], corr int32, scale bf16) -> int8_vnni_linear;
//     int4, bfloat16 activations: (torch's packed uint8 [N, K/2], scales_and_zeros bf16,
//       int64 [group size, dequantize-from rows (0: never), input repeats]) -> at::mm on
//       int4_dequant_t from that many rows, else torch's int4 kernel (x repeated along K);
//     int8, bfloat16 activations: (q int8 [N, K], scale bf16 [N], int64 [dequantize-from rows,
//       tile rows]) -> int8_linear_tiled from that many rows, else torch's int8 kernel;
//   told apart by wq's dtype and rank: Int4Linear._matmul / Int8Linear._matmul's choices, made
//   with the same calls. The result is what LlamaModel.forward's layer
//   loop returns before the final norm: the last layer's MLP output and the residual stream, so
//   `rms_norm_residual(h, residual, norm_weight, eps)` gives the final hidden states. The K/V of
//   the new tokens are written into the caches as the Python path writes them.
//   Every op is the one the Python path calls, in the same order on the same inputs: the outputs
//   are bit-identical to it.
//   LoRA (worker/lora.py): S adapters in the step (S = 0: none); lora_rows[s] int64 [n_s] the
//   token rows of adapter s; lora[12 (L s + l) + 3 j ..] for linear j (0 q|k|v, 1 o, 2 gate|up,
//   3 down) of layer l: A bfloat16 [R, K], B^T bfloat16 [R, N] and its shards int64 [Q, 4] (rank
//   rows r0:r1 write output columns n0:n1; B^T is zero elsewhere; empty: all of it), or three
//   empty tensors where the adapter does not target it. `lora_add` adds x[rows] A^T B^T to the
//   linear's output rows in float32, rounded once to bfloat16, as LoraLinear.forward does (same
//   math, another summation order: close to it, not bit-identical; tests/test_lora.py).
//   `lora_add_(out, x, A, B^T, shards, rows)` is that op alone (tests, benchmarks/lora.py).
// Fails how: the ops' own checks (shapes, dtypes, slots, block tables) raise ValueError /
//   RuntimeError; a weights list of the wrong length or a T=0 input raises ValueError.
// Build: included at the end of cpu_attention.cpp (one translation unit).
// Proven by tests/test_cpu_layers.py (bit-identical hidden states and caches against the Python
// layer loop on SmolLM2 in prefill, decode and mixed steps; greedy tokens of the engine).

#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>

namespace llm_cpu_layers {

constexpr int64_t kPerLinear = 4, kPerLayer = 2 + 4 * kPerLinear;
// LoRA tensors per layer and adapter: (A, B^T, shards) of q|k|v, o, gate|up, down
constexpr int64_t kLoraPerLayer = 12;

// One quantized linear, as Int4Linear._matmul / Int8Linear._matmul would run it (same ATen calls),
// then its bias, as _QuantLinearBase.forward adds it (out + bias, rounded to bfloat16).
at::Tensor matmul(const at::Tensor& x, const at::Tensor* w) {
  const bool vnni = w[0].dim() == 4;
  if (w[0].scalar_type() == at::kByte) {
    if (vnni) return llm_cpu_quant::int4_vnni_linear(x, w[0], w[1]);
    TORCH_CHECK_VALUE(w[2].scalar_type() == at::kLong && w[2].numel() == 3, "int4 linear: bad meta tensor");
    const int64_t* meta = w[2].data_ptr<int64_t>();  // group size, dequantize-from rows, input repeats
    if (meta[1] && x.size(0) >= meta[1])
      return at::mm(x, llm_cpu_quant::int4_dequant_t(w[0], w[1], meta[0], meta[2]));
    const at::Tensor x2 = meta[2] > 1 ? at::cat(std::vector<at::Tensor>(size_t(meta[2]), x), 1) : x;
    return at::_weight_int4pack_mm_for_cpu(x2, w[0], meta[0], w[1]);
  }
  if (vnni) return llm_cpu_quant::int8_vnni_linear(x, w[0], w[1], w[2]);
  TORCH_CHECK_VALUE(w[2].scalar_type() == at::kLong && w[2].numel() == 2, "int8 linear: bad meta tensor");
  const int64_t* meta = w[2].data_ptr<int64_t>();  // dequantize-from rows, tile rows
  if (meta[0] && x.size(0) >= meta[0]) return llm_cpu_quant::int8_linear_tiled(x, w[0], w[1], meta[1]);
  // torch's int8 kernel loads x with aligned loads (worker/model/quant.py int8_mm)
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 64 == 0;
  return at::_weight_int8pack_mm(aligned ? x : x.clone(), w[0], w[1]);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor* w) {
  at::Tensor out = matmul(x, w);
  return w[3].numel() ? at::add(out, w[3]) : out;
}

// out[rows] += x[rows] A^T B^T in float32, rounded once. Rows go in tiles of up to kLoraTile: each
// weight vector read serves every row of the tile. xa = x A^T (R dots of K per row), then per shard
// (r0, r1, n0, n1) and block of output columns, the tile's accumulators stay in registers over the
// shard's rank rows: out[:, n0:n1] += xa[:, r0:r1] B^T[r0:r1, n0:n1]. A fused linear's B is
// block-diagonal (each shard's rank rows are zero outside its output columns): the shards skip the
// zeros. No shards: one, (0, R, 0, N). Tiles split over the pool when the work is large. GCC/Clang
// vector extensions: AVX-512 registers where built for them, two AVX2 halves or scalars elsewhere.
constexpr int64_t kLoraTile = 4;
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32x16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load_bf16x16(const at::BFloat16* p) {
  u16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const u32x16 bits = __builtin_convertvector(raw, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// M rows of a tile; V = 4 / M independent accumulators per row (vectors of 16 columns in B, partial
// sums along K in A), so that four FMA chains are in flight whatever M is.
template <int M>
void lora_tile(const at::BFloat16* ap, const at::BFloat16* bp, const int64_t* sh, int64_t n_sh, int64_t r_,
               int64_t k_, int64_t n_, const float* xf, float* xa, float* acc) {
  constexpr int V = M >= 4 ? 1 : 4 / M;
  for (int64_t r = 0; r < r_; ++r) {
    const at::BFloat16* ar = ap + r * k_;
    f32x16 s[M][V] = {};
    int64_t k = 0;
    for (; k + 16 * V <= k_; k += 16 * V)
      for (int v = 0; v < V; ++v) {
        const f32x16 w = load_bf16x16(ar + k + 16 * v);
        for (int t = 0; t < M; ++t) s[t][v] += load_f32x16(xf + t * k_ + k + 16 * v) * w;
      }
    for (; k + 16 <= k_; k += 16) {
      const f32x16 w = load_bf16x16(ar + k);
      for (int t = 0; t < M; ++t) s[t][0] += load_f32x16(xf + t * k_ + k) * w;
    }
    for (int t = 0; t < M; ++t) {
      f32x16 sum = s[t][0];
      for (int v = 1; v < V; ++v) sum += s[t][v];
      float total = 0.f;
      for (int e = 0; e < 16; ++e) total += sum[e];
      for (int64_t kk = k; kk < k_; ++kk) total += xf[t * k_ + kk] * static_cast<float>(ar[kk]);
      xa[t * r_ + r] = total;
    }
  }
  for (int64_t q = 0; q < n_sh; ++q) {
    const int64_t r0 = sh[4 * q], r1 = sh[4 * q + 1], n0 = sh[4 * q + 2], n1 = sh[4 * q + 3];
    int64_t n = n0;
    for (; n + 16 * V <= n1; n += 16 * V) {
      f32x16 o[M][V];
      for (int t = 0; t < M; ++t)
        for (int v = 0; v < V; ++v) o[t][v] = load_f32x16(acc + t * n_ + n + 16 * v);
      for (int64_t r = r0; r < r1; ++r)
        for (int v = 0; v < V; ++v) {
          const f32x16 w = load_bf16x16(bp + r * n_ + n + 16 * v);
          for (int t = 0; t < M; ++t) o[t][v] += xa[t * r_ + r] * w;
        }
      for (int t = 0; t < M; ++t) std::memcpy(acc + t * n_ + n, o[t], sizeof o[t]);
    }
    for (; n + 16 <= n1; n += 16) {
      f32x16 o[M];
      for (int t = 0; t < M; ++t) o[t] = load_f32x16(acc + t * n_ + n);
      for (int64_t r = r0; r < r1; ++r) {
        const f32x16 w = load_bf16x16(bp + r * n_ + n);
        for (int t = 0; t < M; ++t) o[t] += xa[t * r_ + r] * w;
      }
      for (int t = 0; t < M; ++t) std::memcpy(acc + t * n_ + n, &o[t], sizeof o[t]);
    }
    for (; n < n1; ++n)
      for (int t = 0; t < M; ++t) {
        float v = acc[t * n_ + n];
        for (int64_t r = r0; r < r1; ++r) v += xa[t * r_ + r] * static_cast<float>(bp[r * n_ + n]);
        acc[t * n_ + n] = v;
      }
  }
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& shards, const at::Tensor& rows) {
  const int64_t r_ = a.size(0), k_ = a.size(1), n_ = bt.size(1), n_rows = rows.numel();
  TORCH_CHECK_VALUE(a.scalar_type() == at::kBFloat16 && bt.scalar_type() == at::kBFloat16 &&
                        a.is_contiguous() && bt.is_contiguous() && bt.size(0) == r_,
                    "lora: A [R, K] and B^T [R, N] must be contiguous bfloat16");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                        x.stride(1) == 1 && out.stride(1) == 1 && x.size(1) == k_ && out.size(1) == n_,
                    "lora: x [T, ", k_, "] and out [T, ", n_, "] must be bfloat16 with contiguous rows");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kLong && rows.is_contiguous(), "lora: rows must be int64");
  const int64_t* idx = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_rows; ++i)
    TORCH_CHECK_VALUE(idx[i] >= 0 && idx[i] < x.size(0) && idx[i] < out.size(0), "lora: row ", idx[i],
                      " out of range");
  std::vector<int64_t> whole{0, r_, 0, n_};
  const int64_t* sh = whole.data();
  int64_t n_sh = 1;
  if (shards.numel()) {
    TORCH_CHECK_VALUE(shards.scalar_type() == at::kLong && shards.is_contiguous() && shards.dim() == 2 &&
                          shards.size(1) == 4,
                      "lora: shards must be int64 [S, 4] (r0, r1, n0, n1)");
    sh = shards.data_ptr<int64_t>();
    n_sh = shards.size(0);
    for (int64_t q = 0; q < n_sh; ++q)
      TORCH_CHECK_VALUE(0 <= sh[4 * q] && sh[4 * q] <= sh[4 * q + 1] && sh[4 * q + 1] <= r_ &&
                            0 <= sh[4 * q + 2] && sh[4 * q + 2] <= sh[4 * q + 3] && sh[4 * q + 3] <= n_,
                        "lora: shard ", q, " out of range for A [", r_, ", ", k_, "] and B^T [", r_, ", ", n_, "]");
  }
  int64_t elems = r_ * k_;
  for (int64_t q = 0; q < n_sh; ++q) elems += (sh[4 * q + 1] - sh[4 * q]) * (sh[4 * q + 3] - sh[4 * q + 2]);
  const at::BFloat16* ap = a.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bt.data_ptr<at::BFloat16>();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  const int64_t n_tiles = (n_rows + kLoraTile - 1) / kLoraTile;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, kLoraTile * elems));
  at::parallel_for(0, n_tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kLoraTile * k_), xa(kLoraTile * r_), acc(kLoraTile * n_);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t i0 = tile * kLoraTile, m = std::min(kLoraTile, n_rows - i0);
      for (int64_t t = 0; t < m; ++t) {
        const at::BFloat16* xr = xp + idx[i0 + t] * sx;
        const at::BFloat16* orow = op + idx[i0 + t] * so;
        for (int64_t k = 0; k < k_; ++k) xf[t * k_ + k] = static_cast<float>(xr[k]);
        for (int64_t n = 0; n < n_; ++n) acc[t * n_ + n] = static_cast<float>(orow[n]);
      }
      switch (m) {
        case 1: lora_tile<1>(ap, bp, sh, n_sh, r_, k_, n_, xf.data(), xa.data(), acc.data()); break;
        case 2: lora_tile<2>(ap, bp, sh, n_sh, r_, k_, n_, xf.data(), xa.data(), acc.data()); break;
        case 3: lora_tile<3>(ap, bp, sh, n_sh, r_, k_, n_, xf.data(), xa.data(), acc.data()); break;
        default: lora_tile<4>(ap, bp, sh, n_sh, r_, k_, n_, xf.data(), xa.data(), acc.data()); break;
      }
      for (int64_t t = 0; t < m; ++t) {
        at::BFloat16* orow = op + idx[i0 + t] * so;
        for (int64_t n = 0; n < n_; ++n) orow[n] = static_cast<at::BFloat16>(acc[t * n_ + n]);
      }
    }
  });
}

// Linear j of layer l with every adapter of the step that targets it.
at::Tensor linear_lora(const at::Tensor& x, const at::Tensor* w, at::TensorList lora, at::TensorList rows,
                       int64_t layers, int64_t l, int64_t j) {
  at::Tensor out = linear(x, w);
  for (int64_t s = 0; s < int64_t(rows.size()); ++s) {
    const int64_t at_ = kLoraPerLayer * (layers * s + l) + 3 * j;
    if (lora[at_].numel()) lora_add(out, x, lora[at_], lora[at_ + 1], lora[at_ + 2], rows[s]);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const at::Tensor& positions, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
    double eps, double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t sdpa_min_query_len, at::TensorList lora, at::TensorList lora_rows) {
  const int64_t layers = int64_t(k_caches.size());
  TORCH_CHECK_VALUE(layers > 0 && int64_t(v_caches.size()) == layers, "one K and one V cache per layer");
  TORCH_CHECK_VALUE(int64_t(weights.size()) == kPerLayer * layers, "expected ", kPerLayer * layers,
                    " weight tensors for ", layers, " layers, got ", weights.size());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) > 0, "x must be a non-empty [T, C] tensor");
  TORCH_CHECK_VALUE(int64_t(lora.size()) == kLoraPerLayer * layers * int64_t(lora_rows.size()), "expected ",
                    kLoraPerLayer * layers * int64_t(lora_rows.size()), " LoRA tensors for ", lora_rows.size(),
                    " adapters, got ", lora.size());
  const int64_t t = x.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
  at::Tensor h, residual, cur = x;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kPerLayer * l;
    if (l == 0) {
      h = llm_cpu_fused::rms_norm(cur, w[0], eps);
      residual = cur;
    } else {
      std::tie(h, residual) = llm_cpu_fused::rms_norm_residual(cur, residual, w[0], eps);
    }
    // [T, qs + 2 kvs]; the linears at w + 1, 5, 10, 14
    const at::Tensor qkv = linear_lora(h, w + 1, lora, lora_rows, layers, l, 0);
    const at::Tensor q = qkv.narrow(1, 0, qs).view({t, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, qs, kvs).view({t, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({t, num_kv_heads, head_dim});
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    const at::Tensor qr = llm_cpu_fused::rope_store_kv(positions, q, k, v, cos, sin, kc, vc, slot_mapping);
    const at::Tensor attn = paged_attention(qr, kc, vc, block_tables, seq_lens, query_start_loc, scale,
                                            sdpa_min_query_len);
    const at::Tensor o = linear_lora(attn.reshape({t, qs}), w + 1 + kPerLinear, lora, lora_rows, layers, l, 1);
    std::tie(h, residual) = llm_cpu_fused::rms_norm_residual(o, residual, w[1 + 2 * kPerLinear], eps);
    const at::Tensor* mlp = w + 2 + 2 * kPerLinear;
    const at::Tensor gate_up = linear_lora(h, mlp, lora, lora_rows, layers, l, 2);
    cur = linear_lora(llm_cpu_fused::silu_and_mul(gate_up), mlp + kPerLinear, lora, lora_rows, layers, l, 3);
  }
  return {cur, residual};
}

void lora_add_op(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 const at::Tensor& shards, const at::Tensor& rows) {
  lora_add(out, x, a, bt, shards, rows);
}

}  // namespace llm_cpu_layers

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor cos, "
        "Tensor sin, Tensor[] weights, float eps, float scale, int num_heads, int num_kv_heads, "
        "int head_dim, int sdpa_min_query_len, Tensor[] lora, Tensor[] lora_rows) -> (Tensor, Tensor)");
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor shards, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("decoder_layers", &llm_cpu_layers::decoder_layers);
  m.impl("lora_add_", &llm_cpu_layers::lora_add_op);
}
