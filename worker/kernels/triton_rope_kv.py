"""Triton RoPE + store_kv in one launch: rotate q and k, write the rotated k and v into the paged
KV cache (what `triton_norm.rotary_embedding` then `triton_store_kv.store_kv` do in two).

Contract:
- Input: `rope_store_kv(positions [T] int32/int64, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D],
  cos [P, D/2], sin [P, D/2], k_cache, v_cache [num_blocks, block_size, Hkv, D],
  slot_mapping [T] int64/int32, q_out=None)`: the argument rules of `rotary_embedding` (D even,
  float q/k, one cos/sin dtype and stride) and of `store_kv` (k/v of one shape, float caches of
  one dtype, last dims contiguous; any token / head strides, e.g. views into the fused q|k|v
  projection), all on one device. `q_out` (default: a new tensor like q) is q's shape and dtype
  with a contiguous last dim, not overlapping q: in place is refused, because a program's threads
  can hold copies of one element (a tile smaller than the warps) and one could read q after
  another wrote it.
- Output: `q_out`, RoPE'd q. Rotated k is written only into k_cache: k and v are not modified.
- Arithmetic: the rotation is triton_norm's own jit helpers (`_rope_cos_sin`, `_rope_halves`,
  `_rope_rotate`: non-interleaved "rotate half", cos/sin gathered at each token's position in the
  kernel, float32); rotated k is rounded to k's dtype and then converted to the cache dtype, and v
  goes through triton_store_kv's `_store_heads`, so q_out and both caches are bit-identical to
  `rotary_embedding` + `store_kv` (the same conversions, fp8 e4m3 caches included: round to k's
  dtype first, then to fp8, as that pair does).
- Slots < 0 (padding) write nothing to either cache; their q is still rotated.
- State: the cache rows named by slot_mapping, and q_out.
- Fails how: ValueError before launch for any argument `rotary_embedding` or `store_kv` rejects
  (odd head_dim included: rotate-half needs two equal halves), for k/v head dims that differ from
  q's, or for a bad q_out. Positions past cos/sin and slots past the cache are not checked (that
  would need a device sync): callers own them.
- Cost: one program per token: q's and k's heads read once, cos/sin rows once, q_out, the k row
  and the v row written once; no temporaries. On CUDA no host sync, so a graph can hold it.
- Proven by tests/test_triton_rope_kv.py: q_out and the caches bit-identical to the two-launch
  pair in fp32/bf16/fp16, into an fp8 cache, GQA, non-power-of-two head_dim, padding slots
  untouched, a given q_out (an overlapping one refused); the engine's greedy tokens with the
  triton backend unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton_norm import _check_rope_args, _rope_cos_sin, _rope_halves, _rope_rotate
from worker.kernels.triton_store_kv import _check_store_args, _store_heads


@triton.jit
def _rope_kv_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_q_t,
    stride_q_h,
    stride_qo_t,
    stride_qo_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cs,
    stride_kc_b,
    stride_kc_r,
    stride_kc_h,
    stride_vc_b,
    stride_vc_r,
    stride_vc_h,
    num_heads,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: the cos/sin row is loaded once for q's and k's heads.
    token = tl.program_id(0)
    cos, sin = _rope_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cs, HALF, HALF_PAD)
    _rope_rotate(
        q_ptr,
        q_out_ptr,
        token,
        stride_q_t,
        stride_q_h,
        stride_qo_t,
        stride_qo_h,
        num_heads,
        cos,
        sin,
        HALF,
        HEADS_PAD,
        HALF_PAD,
    )
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        k1, k2 = _rope_halves(
            k_ptr, token, stride_k_t, stride_k_h, NUM_KV_HEADS, cos, sin, HALF, KV_HEADS_PAD, HALF_PAD
        )
        h = tl.arange(0, KV_HEADS_PAD)[:, None]
        d = tl.arange(0, HALF_PAD)[None, :]
        ok = (h < NUM_KV_HEADS) & (d < HALF)
        dst = k_cache_ptr + block * stride_kc_b + row * stride_kc_r + h * stride_kc_h + d
        # Round to k's dtype first (what rotary_embedding returns), then to the cache's (store_kv).
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(dst, k1.to(k_ptr.dtype.element_ty).to(cache_ty), mask=ok)
        tl.store(dst + HALF, k2.to(k_ptr.dtype.element_ty).to(cache_ty), mask=ok)
        _store_heads(
            v_ptr,
            v_cache_ptr,
            token,
            block,
            row,
            stride_v_t,
            stride_v_h,
            stride_vc_b,
            stride_vc_r,
            stride_vc_h,
            NUM_KV_HEADS,
            HEAD_DIM,
            KV_HEADS_PAD,
            HEAD_DIM_PAD,
        )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges a and b span intersect (conservative: strided views count whole)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        start = t.data_ptr()
        return start, start + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


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
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_rope_args(positions, q, k, cos, sin, "rope_store_kv")
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    if q.device != k_cache.device:
        raise ValueError(f"rope_store_kv: q on {q.device}, caches on {k_cache.device}")
    if q_out is None:
        q_out = torch.empty_like(q)
    elif (
        q_out.shape != q.shape
        or q_out.dtype != q.dtype
        or q_out.device != q.device
        or q_out.stride(-1) != 1
        or _overlap(q_out, q)
    ):
        raise ValueError(
            f"rope_store_kv q_out {tuple(q_out.shape)} {q_out.dtype} on {q_out.device} (stride "
            f"{q_out.stride()}) for q {tuple(q.shape)} {q.dtype} on {q.device}; it must not overlap q"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    _rope_kv_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        q_out,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
    return q_out
