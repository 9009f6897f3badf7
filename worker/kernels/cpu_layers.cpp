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
//     weights[18 L], eps, scale, num_heads, num_kv_heads, head_dim, sdpa_min_query_len)
//     -> (h [T, C], residual [T, C])
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

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const at::Tensor& positions, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
    double eps, double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t sdpa_min_query_len) {
  const int64_t layers = int64_t(k_caches.size());
  TORCH_CHECK_VALUE(layers > 0 && int64_t(v_caches.size()) == layers, "one K and one V cache per layer");
  TORCH_CHECK_VALUE(int64_t(weights.size()) == kPerLayer * layers, "expected ", kPerLayer * layers,
                    " weight tensors for ", layers, " layers, got ", weights.size());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) > 0, "x must be a non-empty [T, C] tensor");
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
    const at::Tensor qkv = linear(h, w + 1);  // [T, qs + 2 kvs]; the linears at w + 1, 5, 10, 14
    const at::Tensor q = qkv.narrow(1, 0, qs).view({t, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, qs, kvs).view({t, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({t, num_kv_heads, head_dim});
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    const at::Tensor qr = llm_cpu_fused::rope_store_kv(positions, q, k, v, cos, sin, kc, vc, slot_mapping);
    const at::Tensor attn = paged_attention(qr, kc, vc, block_tables, seq_lens, query_start_loc, scale,
                                            sdpa_min_query_len);
    const at::Tensor o = linear(attn.reshape({t, qs}), w + 1 + kPerLinear);
    std::tie(h, residual) = llm_cpu_fused::rms_norm_residual(o, residual, w[1 + 2 * kPerLinear], eps);
    const at::Tensor* mlp = w + 2 + 2 * kPerLinear;
    cur = linear(llm_cpu_fused::silu_and_mul(linear(h, mlp)), mlp + kPerLinear);
  }
  return {cur, residual};
}

}  // namespace llm_cpu_layers

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor cos, "
        "Tensor sin, Tensor[] weights, float eps, float scale, int num_heads, int num_kv_heads, "
        "int head_dim, int sdpa_min_query_len) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("decoder_layers", &llm_cpu_layers::decoder_layers);
}
