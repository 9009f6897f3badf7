"""Triton W8A16 GEMM for fp8 weights at any row count (prefill, mixed steps, decode batches > 16):
`y = x @ (W.float() * scale)^T (+ bias)` with W float8_e4m3fn and per-(row, group of K columns)
or per-row float32 scales, x in 16-bit (or float32), without materialising a dequantized weight.

Contract:
- Input: `fp8_gemm(x [M, K], weight [N, K] float8_e4m3fn, scale, bias [N] | None, group_size=0,
  out=None, config=None)`; M >= 1 (meant for M > 16: fewer rows take worker/kernels/triton_gemv.py);
  x of bfloat16, float16 or float32; `scale` contiguous float32, [N, cdiv(K, group_size)] for a
  group_size that is a power of two >= 16 (column k of row n scaled by scale[n, k // group_size];
  K need not be a multiple of it, nor of BLOCK_K), or [N] with group_size 0 (per row); x and weight
  with a contiguous last dim (any row stride), all on one device; `out` [M, N] in x's dtype with a
  contiguous last dim. `config` (a `GemmConfig`) defaults to `config_for(M)`.
- Output: `out` (new when None): per K tile of `block_k` columns (capped at group_size, so a tile
  never straddles two groups) the float32 `tl.dot` of the fp8 tile widened to x's dtype (exact:
  every e4m3 value is a bf16 / fp16 value) with the x tile, times that group's scale per output
  column, summed in float32 (per row: the scale once at the end), plus the bias in float32, cast
  once to x's dtype. float32 x: "ieee" dots (no tf32); the interpreter (which cannot tl.dot
  16-bit types) widens both tiles to float32, the same products.
- Kernel: one program per (BLOCK_M rows, BLOCK_N columns) output tile, numbered in grouped-M
  order (GROUP_M row tiles share each weight tile while it is in L2). It computes the transposed
  tile `W_tile @ x_tile^T` ([BLOCK_N, BLOCK_M]): the widened weight is the dot's first operand,
  which Hopper's wgmma can take from registers (x, the second, stays in shared memory), and
  BLOCK_N (>= 64) fills wgmma's 64-row M side even when M is 16..64. M is not a specialization
  key (`do_not_specialize`), so every row count of a config reuses one compiled kernel.
- Configs (`CONFIGS`, keyed by M; after vLLM's / SGLang's block-fp8 Triton defaults: 128-column
  K tiles, BLOCK_N 64..128, 3-4 stages, 4-8 warps, GROUP_M 8..32, BLOCK_M from 16 up with M), sized
  to fit sm_89's 99 KiB of shared memory: (x tile 2 B + weight tile 1 B per element) x stages.
  Compiled for sm_90 / sm_89 (every config, bf16 / fp16, per group / per row): no spills, wgmma on
  sm_90 (at most 195 registers per thread), mma on sm_89 (at most 242).
- CUDA-graph safety: no host syncs, and nothing is allocated except `out` (when not given): it
  can be captured once its configs compiled (run each shape once first; `worker.model.fp8.
  use_fp8_gemv` does it for the model's grouped layers, the graph runner's warm-up for its sizes).
- Fails how: ValueError for a wrong rank, shape, dtype (a weight that is not float8_e4m3fn),
  device or stride, a missing scale or one of the wrong shape, a bad group_size, or M < 1
  (`triton_gemv._check`, shared).
- Proven by tests/test_fp8_gemm.py (vs the float32 product with the dequantized weight under the
  interpreter: M 1..130, odd N, K not a multiple of the group or tile, bias or not, bf16 / fp16 /
  fp32, group 64 / 128 / per row, NaN-poisoned output; bad inputs; on CUDA also CUDA-graph
  replay), tests/test_fp8.py (Fp8Linear's path on CUDA); compiled for sm_90 / sm_89 by
  worker/kernels/compile_check.py; speed by benchmarks/gpu_gemv.py (its `gemm` rows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from worker.kernels.triton_gemv import FP8, INTERPRETED, _check, _pow2


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    group_size,
    n_groups,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Grouped-M order: GROUP_M row tiles walk the N tiles together (each weight tile read once
    # from DRAM, then from L2 by the group's other row tiles).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows / columns past the end re-read valid ones (wrapped) instead of masking every load;
    # only the store is masked.
    x_rows = x_ptr + (offs_m % M).to(tl.int64) * stride_xm
    w_rows = w_ptr + (offs_n % N).to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n % N).to(tl.int64) * n_groups
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # the transposed output tile
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < K) | EVEN_K  # folds to all-true for an even K: unmasked, vector loads
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=k_ok[None, :], other=0.0)  # (BN, BK)
        xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=k_ok[:, None], other=0.0)  # (BK, BM)
        if DOT_F32:  # float32 x, or the interpreter
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:  # e4m3 -> bf16 / fp16 is exact
            part = tl.dot(w.to(xt.dtype), xt)
        if GROUPED:  # the whole tile lies in group k0 // group_size: one scale per weight row
            acc += part * tl.load(s_rows + k0 // group_size)[:, None]
        else:
            acc += part
    if not GROUPED:
        acc *= tl.load(s_rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n % N).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if not all(_pow2(v) for v in (self.block_m, self.block_n, self.block_k, self.num_warps)):
            raise ValueError(f"block sizes and num_warps must be powers of two: {self}")
        if min(self.block_m, self.block_n, self.block_k) < 16 or self.group_m < 1:
            raise ValueError(f"tl.dot needs blocks >= 16, group_m >= 1: {self}")

    def __str__(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}w{self.num_warps}p{self.num_stages}"
        )


# (max rows, config): the first whose bound holds. Shared memory per stage: block_k x (2 B x
# block_m + 1 B x block_n); all <= 72 KiB. Up to 64 rows (decode batches) the tiles stay narrow in
# N so a 2048-wide projection still gives 32 programs; prefill takes 128 x 128 tiles.
CONFIGS = (
    (16, GemmConfig(16, 64, 128, group_m=16, num_warps=4, num_stages=4)),
    (32, GemmConfig(32, 64, 128, group_m=16, num_warps=4, num_stages=4)),
    (64, GemmConfig(64, 64, 128, group_m=16, num_warps=4, num_stages=3)),
    (128, GemmConfig(64, 128, 64, group_m=8, num_warps=8, num_stages=4)),
    (None, GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)),
)


def config_for(m: int) -> GemmConfig:
    """The config for M rows: CONFIGS' first entry whose bound holds."""
    return next(c for bound, c in CONFIGS if bound is None or m <= bound)


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int = 0,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    if weight.dtype != FP8 or scale is None:
        raise ValueError(f"fp8_gemm takes a {FP8} weight with its float32 scale, got {weight.dtype}")
    m, n, k = _check(x, weight, bias, out, scale, group_size, max_rows=None)
    config = config or config_for(m)
    if group_size and config.block_k > group_size:  # every K tile inside one scale group
        config = replace(config, block_k=group_size)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else scale,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        max(group_size, 1),
        triton.cdiv(k, group_size) if group_size else 1,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        EVEN_K=k % config.block_k == 0,
        HAS_BIAS=bias is not None,
        GROUPED=group_size > 0,
        DOT_F32=INTERPRETED or x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
