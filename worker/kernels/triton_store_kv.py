"""Triton `store_kv`: write new keys/values into the paged KV cache (the GPU twin of the reference).

Contract (same as `worker.kernels.reference.store_kv`):
- Input: key/value `[num_tokens, num_kv_heads, head_dim]` (last dim contiguous, any float dtype),
  k_cache/v_cache `[num_blocks, block_size, num_kv_heads, head_dim]` (last dim contiguous),
  `slot_mapping [num_tokens]` int64 (int32 accepted). Token i goes to block
  `slot // block_size`, row `slot % block_size`.
- Output: none; the cache rows named by `slot_mapping` are overwritten in place, converted to the
  cache dtype. Slots < 0 (padding) are skipped and their tokens write nothing.
- State: only the two cache tensors, and only at the named slots.
- Shared: `_store_heads` (one token's heads into a cache row, converted) and `_check_store_args`
  are also worker/kernels/triton_rope_kv.py's, which writes v (and rotated k) the same way.
- Fails how: shape, dtype, device or stride mismatch raises ValueError before launch. Slots past
  the end of the cache are not checked (that would need a device sync): callers own slot validity.
- Proven by: tests/test_kernels.py::test_store_kv (bit-exact vs the reference, skipped slots
  untouched); compiled for sm_80/sm_90 by tests/test_triton_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_heads(
    src_ptr,
    cache_ptr,
    token,
    block,
    row,
    stride_s_t,
    stride_s_h,
    stride_c_b,
    stride_c_r,
    stride_c_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Copy `token`'s heads of src into cache row (block, row), converted to the cache dtype
    (shared with triton_rope_kv, which stores v through it)."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    x = tl.load(src_ptr + token * stride_s_t + h * stride_s_h + d, mask=mask)
    tl.store(
        cache_ptr + block * stride_c_b + row * stride_c_r + h * stride_c_h + d,
        x.to(cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_r,
    stride_kc_h,
    stride_vc_b,
    stride_vc_r,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: copies all of its kv heads for K and V.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    _store_heads(
        key_ptr,
        k_cache_ptr,
        token,
        block,
        row,
        stride_key_t,
        stride_key_h,
        stride_kc_b,
        stride_kc_r,
        stride_kc_h,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
    )
    _store_heads(
        value_ptr,
        v_cache_ptr,
        token,
        block,
        row,
        stride_value_t,
        stride_value_h,
        stride_vc_b,
        stride_vc_r,
        stride_vc_h,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
    )


def _check_store_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    if (
        key.dim() != 3
        or key.shape != value.shape
        or k_cache.dim() != 4
        or k_cache.shape != v_cache.shape
        or key.shape[1:] != k_cache.shape[2:]
    ):
        raise ValueError(
            f"store_kv shapes: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} for {key.shape[0]} tokens")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if (
        not all(t.is_floating_point() for t in (key, value, k_cache, v_cache))
        or k_cache.dtype != v_cache.dtype
    ):
        raise ValueError(
            f"store_kv dtypes: key {key.dtype}, value {value.dtype}, "
            f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    tensors = (key, value, k_cache, v_cache, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"store_kv tensors on several devices: {[str(t.device) for t in tensors]}")
    if any(t.stride(-1) != 1 for t in tensors[:4]):
        raise ValueError("store_kv needs key, value and caches contiguous in the last dim")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
