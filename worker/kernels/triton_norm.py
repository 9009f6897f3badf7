"""Triton fused RMSNorm (with optional residual add), rotary embedding and SiLU-and-multiply for
the GPU path.

Contract (the plain-torch twins are `RMSNorm` and `RotaryEmbedding` in worker/model/llama.py):
- `rms_norm(x [T, C], weight [C], eps, residual=None)`: with a residual, first
  `x = x + residual` (rounded to x's dtype, as torch adds) and that sum is also returned as the new
  residual; then `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` with the mean in float32.
  Returns `out` (dtype = promote(x, weight)) or `(out, new_residual)`.
- `rotary_embedding(positions [T] int, q [T, H, D], k [T, Hkv, D], cos [P, D/2], sin [P, D/2])`:
  non-interleaved (rotate-half) RoPE on q and k in one launch, in float32, returned in their
  dtypes as new tensors `(q_out, k_out)`.
- `silu_and_mul(x [T, 2F])`: `silu(x[:, :F]) * x[:, F:]` ([T, F], x's dtype) in one kernel, rounded
  as torch rounds `F.silu(gate) * up` (the SiLU rounded to x's dtype, then the product); the MLP's
  activation (two kernels and a [T, F] temporary in torch).
- State: none; inputs are not modified.
- Shared: the RoPE jit helpers (`_rope_cos_sin`, `_rope_halves`, `_rope_rotate`) and the argument
  check `_check_rope_args` are also worker/kernels/triton_rope_kv.py's (RoPE + store_kv in one
  launch), so both round the same expressions.
- Fails how: shape, dtype, device or stride mismatch raises ValueError before launch. Positions
  past the cos/sin tables are not checked (that would need a device sync).
- Proven by: tests/test_kernels.py::test_rms_norm, ::test_rotary_embedding and
  ::test_silu_and_mul (vs the torch formulas of worker/model/llama.py); compiled for sm_80/sm_90
  by tests/test_triton_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per token row; the whole row fits in one tile.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    # Round to x's dtype before the weight multiply, as the torch module does.
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"residual {None if residual is None else tuple(residual.shape)}"
        )
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (
        not all(t.is_floating_point() for t in tensors)
        or len({t.device for t in tensors}) != 1
        or (residual is not None and residual.dtype != x.dtype)
    ):
        raise ValueError(
            f"rms_norm needs float tensors on one device, residual in x's dtype: "
            f"{[(t.dtype, str(t.device)) for t in tensors]}"
        )
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("rms_norm needs x, weight and residual contiguous in the last dim")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    block_c = triton.next_power_of_2(x.shape[1])
    if x.shape[0] > 0:
        # Without a residual, x stands in for the residual pointers (HAS_RESIDUAL skips them).
        _rms_norm_kernel[(x.shape[0],)](
            x,
            x if residual is None else residual,
            weight,
            out,
            x if new_residual is None else new_residual,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            0 if new_residual is None else new_residual.stride(0),
            x.shape[1],
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_C=block_c,
            num_warps=max(1, min(16, block_c // 256)),  # about 8 fp32 values of the row per thread
        )
    return out if residual is None else (out, new_residual)


@triton.jit
def _rope_cos_sin(
    positions_ptr, token, cos_ptr, sin_ptr, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr
):
    """The (1, D/2) float32 cos and sin rows of `token`'s position (shared with triton_rope_kv)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_halves(
    src_ptr,
    token,
    stride_s_t,
    stride_s_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate-half RoPE of `token`'s heads in float32: the (H, D/2) first and second halves
    (shared with triton_rope_kv, so both kernels round the same expressions)."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < num_heads) & (d < HALF)
    src = src_ptr + token * stride_s_t + h * stride_s_h + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)  # (H, D/2)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_rotate(
    src_ptr,
    dst_ptr,
    token,
    stride_s_t,
    stride_s_h,
    stride_d_t,
    stride_d_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    o1, o2 = _rope_halves(
        src_ptr, token, stride_s_t, stride_s_h, num_heads, cos, sin, HALF, HEADS_PAD, HALF_PAD
    )
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < num_heads) & (d < HALF)
    dst = dst_ptr + token * stride_d_t + h * stride_d_h + d
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_qo_t,
    stride_qo_h,
    stride_ko_t,
    stride_ko_h,
    stride_cs,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
):
    # One program per token: its position's cos/sin row is loaded once for all q and k heads.
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
    _rope_rotate(
        k_ptr,
        k_out_ptr,
        token,
        stride_k_t,
        stride_k_h,
        stride_ko_t,
        stride_ko_h,
        num_kv_heads,
        cos,
        sin,
        HALF,
        KV_HEADS_PAD,
        HALF_PAD,
    )


def _check_rope_args(positions, q, k, cos, sin, name: str = "rotary_embedding") -> None:
    """ValueError unless q [T, H, D], k [T, Hkv, D], D even, positions [T] int32/int64, cos/sin
    [P, D/2] of one dtype and strides, all on one device with contiguous last dims."""
    if (
        q.dim() != 3
        or k.dim() != 3
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
        or q.shape[2] % 2
        or positions.shape != (q.shape[0],)
        or cos.dim() != 2
        or cos.shape != sin.shape
        or cos.shape[1] != q.shape[2] // 2
    ):
        raise ValueError(
            f"{name} shapes: positions {tuple(positions.shape)}, q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    if (
        positions.dtype not in (torch.int32, torch.int64)
        or not q.is_floating_point()
        or not k.is_floating_point()
        or cos.dtype != sin.dtype
    ):
        raise ValueError(
            f"{name} dtypes: positions {positions.dtype}, q {q.dtype}, "
            f"k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}"
        )
    tensors = (positions, q, k, cos, sin)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{name} tensors on several devices: {[str(t.device) for t in tensors]}")
    if any(t.stride(-1) != 1 for t in tensors) or cos.stride() != sin.stride():
        raise ValueError(f"{name} needs contiguous last dims and equal cos/sin strides")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rope_args(positions, q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    half = q.shape[2] // 2
    if q.shape[0] > 0:
        _rope_kernel[(q.shape[0],)](
            positions,
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            q.shape[1],
            k.shape[1],
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            HEADS_PAD=triton.next_power_of_2(q.shape[1]),
            KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        )
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + F + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded to the input dtype
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2 or not x.is_floating_point() or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul needs [T, 2F], floating point, last dim contiguous; got {x.shape}")
    t, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(f), 1024)
    if t > 0:
        _silu_mul_kernel[(t, triton.cdiv(f, block))](x, out, f, x.stride(0), out.stride(0), BLOCK=block)
    return out
