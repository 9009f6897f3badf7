"""Per-row FP8 activation quantization in one Triton kernel (the W8A8 linears' input side).

Contract: `quantize_rows_fp8(x [M, K], out_dtype=float8_e4m3fn) -> (q [M, K] out_dtype, scale [M, 1]
float32)` with `scale = max|x[m]| / 448` (1 for an all-zero row) and `q = clamp(x / scale, -448,
448)` computed in float32 and cast to out_dtype (round to nearest even on the GPU): exactly
`worker.model.fp8.quantize_fp8(x, dim=1)`, which takes ~6 torch kernels per call where this takes
one (a 1B model's decode step runs 64 of them: at batch 1 the launches would cost more than the
halved weight read saves). `out_dtype=float32` returns the clamped scaled values unrounded: the
Triton interpreter rounds to fp8 wrongly (1.953125 became 1.0), so CPU tests check that form and
the cast is checked on CUDA.
State: none. Fails how: x not 2-D or last dim not contiguous raises ValueError.
Proven by tests/test_fp8.py::test_triton_quantize_rows_* (interpreted on CPU, and on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_o, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, 0)
    scale = tl.where(m > 0, tl.math.div_rn(m, 448.0), 1.0)  # IEEE division, as torch
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(out_ptr + row * stride_o + k0 + offs, q.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_rows_fp8(
    x: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    m, k = x.shape
    out = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block_k = min(triton.next_power_of_2(k), 2048)
        _quantize_rows_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0), BLOCK_K=block_k)
    return out, scale
