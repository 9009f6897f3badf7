"""The "cpu" backend's fused small ops: RMSNorm (with the residual add), RoPE and SiLU-and-multiply
as single C++ op calls (worker/kernels/cpu_fused.cpp, in the llm_cpu extension that
worker/kernels/cpu_ext.py builds and loads).

Why: an eager decode step of SmolLM2 (30 layers) ran each norm as ~8 torch ops, RoPE as ~10 per
tensor, the residual adds and the MLP activation as a few more: ~1,300 small ops per step, each a
few microseconds of Python and dispatch, which at batch 1 cost about as much as the quantized
matmuls (docs/cpu-serving.md). Fused, a layer runs 4 such calls.

Contract: the `fused` namespace of worker/attention.py, with the semantics of
worker/kernels/triton_norm.py (the GPU's):
- `rms_norm(x [T, C], weight [C], eps, residual=None)` -> `out`, or `(out, x + residual)` with a
  residual (the sum rounded to x's dtype, carried to the next norm).
- `rotary_embedding(positions [T] int64, q [T, H, D], k [T, Hkv, D], cos [P, D/2], sin [P, D/2])`
  -> `(q_out, k_out)`, new tensors.
- `silu_and_mul(x [T, 2F])` -> `[T, F]`.
- `argmax_rows(logits [S, V])` -> `[S]` int64: greedy sampling's argmax with torch.argmax's
  answer (first maximum, NaN counts as the maximum), over bfloat16 logits without a float32 copy
  (the model runner's plain-greedy batches on CPU).
- `rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)` -> `q_out`: the
  backend's `rope_store_kv` (worker/kernels/triton_rope_kv.py's contract): RoPE on q and k, the
  rotated k and v written into the cache rows of their slots (slots < 0 skipped), in one call.
  Caches of another dtype than k, or not contiguous, take `rotary_embedding` + the reference
  `store_kv` instead (same values).
Inputs other than the caches are not modified. Float32, bfloat16 and float16; the model runner
uses these ops for bfloat16 / float16 activations only (float32 stays the plain-torch reference
path).
Fails how: bad shapes, dtypes or strides, positions outside the cos/sin tables or slots outside
the cache raise ValueError; a library that does not build, RuntimeError naming why (cpu_ext.load).
The ops' meta implementations are registered by cpu_ext when the library loads (torch.compile can
trace them).
Proven by tests/test_cpu_fused.py: each op against the torch formulas of worker/model/llama.py
(every dtype, strided views, rows enough to run in parallel), bad arguments, and the engine's
greedy tokens with the fused ops against the torch path.
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_ext, reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is None:
        return cpu_ext.ops().rms_norm(x, weight, float(eps))
    out, summed = cpu_ext.ops().rms_norm_residual(x, residual, weight, float(eps))
    return out, summed


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = cpu_ext.ops().rotary_embedding(positions, q, k, cos, sin)
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return cpu_ext.ops().silu_and_mul(x)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (float32 / bfloat16 / float16, unit column stride) -> [S] int64: torch.argmax's
    answer (the first maximum; a NaN counts as the maximum), read in the logits' own dtype."""
    return cpu_ext.ops().argmax_rows(logits)


def rope_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    slot_mapping = slot_mapping.long()
    if (
        k_cache.dtype != k.dtype
        or v_cache.dtype != k.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        q_out, k_out = rotary_embedding(positions, q, k, cos, sin)
        reference.store_kv(k_out, v, k_cache, v_cache, slot_mapping)
        return q_out
    return cpu_ext.ops().rope_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
