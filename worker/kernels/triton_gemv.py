"""Triton GEMV / skinny GEMM for decode: `y = x @ W^T (+ bias)` with x [M <= 16, K], W [N, K];
also W8A16: `y = x @ (W.float() * scale)^T (+ bias)` for a float8_e4m3fn W with per-row scales or
per-(row, group of K columns) scales.

Contract:
- Input: `gemv(x [M, K], weight [N, K], bias [N] | None, out=None, config=None, scale=None,
  group_size=0)`; x of bfloat16, float16 or float32; weight of x's dtype, or float8_e4m3fn with a
  contiguous float32 `scale` (only then): [N] per row (group_size 0), or [N, cdiv(K, group_size)]
  for group_size a power of two >= 16 (column k of row n scaled by scale[n, k // group_size]; K
  need not be a multiple of it); both with a contiguous last dim (any row stride), 1 <= M <= MAX_ROWS
  (16), on one device; `out` [M, N] in x's dtype with a contiguous last dim. `config` (a
  `GemvConfig`) defaults to `default_config(M)` (untuned); a tuned one is the caller's to pass
  (`gemv_tuning.best_config(M, N, K, dtype, device, weight dtype)`, as worker/model/gemv.py and
  worker/model/fp8.py do).
- Output: `out` (new when None): `x @ W^T` accumulated in float32 (products of the stored values,
  no tf32: fp32 dots use "ieee"), times `scale[n]` once at the end (fp8 per row) or each group's
  float32 partial times its scale inside the K loop (per group: the tile's block_k is capped at
  group_size, so a tile never straddles two groups; split-K partials are then already scaled),
  plus bias in float32,
  cast once to x's dtype. fp8 weights are widened in registers (exact: every e4m3 value is a
  bfloat16 / float16 / float32 value) and x is not quantized.
- Kernels: each program reads a [BLOCK_N, BLOCK_K] tile of W per step over its share of K, so W
  is read exactly once (masked tails; `evict_first`, it is streamed). `dot=False` configs (M == 1
  only) keep a [BLOCK_N, BLOCK_K] float32 accumulator of products and reduce it once at the end;
  `dot=True` configs pad x to 16 rows and use `tl.dot` (tensor cores for 16-bit types; an fp8
  tile is converted to x's dtype first). Split-K (`split_k > 1`, the grid is N/BLOCK_N x splits so
  N = K = 2048 still fills 132 SMs): each split writes its unscaled float32 partial [M, N] into a
  scratch buffer and a second kernel sums the splits in a fixed order, applies the scale, adds the
  bias and casts: deterministic (no atomics), and no memset.
- CUDA-graph safety: no host syncs, and the scratch is one buffer per (device, N, splits), sized
  for 16 rows, allocated on first use and then reused by every call (never freed or moved), so a
  captured graph keeps valid pointers. Allocating one during capture raises RuntimeError: run
  the shape once before capturing (`worker.model.gemv.use_triton_gemv` and
  `worker.model.fp8.use_fp8_gemv` do). Calls sharing a buffer must be ordered: one stream per
  device, as the engine runs.
- Configs: `candidates(M, weight_dtype)` (dot=False ones for M == 1, dot=True ones for every M;
  fp8 weights add tiles twice as deep in K, the same bytes per tile as the 16-bit ones);
  timing and the cache of winners live in worker/kernels/gemv_tuning.py (which imports this
  module; this one never imports it). `DEFAULTS` (no split-K): `default_config(M)`.
- Cost: one launch (split_k == 1) or two; weight bytes read once; x re-read from L2 by every
  N tile; a split-K scratch of 4 * splits * 16 * N bytes per (N, splits), kept.
- Fails how: ValueError for a wrong rank, shape, dtype, device or stride, a scale missing for an
  fp8 weight or given for another, a group_size that is not 0 or a power of two >= 16 (or given
  for a 16-bit weight), a scale whose shape does not match the group size, M outside 1..16, or
  a dot=False config with M > 1; RuntimeError for a scratch buffer first needed during capture.
- Proven by tests/test_gemv.py (every candidate vs the float32 product on CPU under the
  interpreter, M = 1..16, odd N and K, bias or not, fp8 weights with scales, NaN-poisoned output
  and scratch; on CUDA also replay inside a CUDA graph) and tests/test_gemv_groups.py (per-group
  scales: every fp8 candidate, K not a multiple of the group); speed by benchmarks/gpu_gemv.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn
REDUCE_BLOCK_N = 128


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    group_size,
    n_groups,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    GROUPED: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # (BN,)
    k_lo = pid_k * k_per_split
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # Even K: the mask folds to all-true along K, so loads stay vectorized.
        k_ok = (offs_k < K) | EVEN_K
        if GROUPED:  # the tile lies in one group of K (BLOCK_K divides group_size): one scale per row
            # (a split's last tiles can lie wholly past K, their W and x loads all masked to 0: they
            # read the last group's scale, not one past the end of the scale tensor)
            g = tl.minimum(k0 // group_size, n_groups - 1)
            s = tl.load(s_ptr + offs_n.to(tl.int64) * n_groups + g, mask=n_ok, other=0.0)
        if DOT:  # W^T tile (BK, BN): column n is W's row n, contiguous along K
            w_mask = n_ok[None, :] & k_ok[:, None]
            wt = tl.load(
                w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
            x_mask = m_ok[:, None] & k_ok[None, :]
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
            if GROUPED:  # this group's partial product, scaled in float32
                if DOT_F32:
                    part = tl.dot(xs.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(xs, wt.to(xs.dtype))
                acc += part * s[None, :]
            elif DOT_F32:  # float32 inputs, or the interpreter (it cannot tl.dot bfloat16)
                acc = tl.dot(xs.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
            else:  # an fp8 tile widened to x's 16-bit type (exact); a no-op for 16-bit weights
                acc = tl.dot(xs, wt.to(xs.dtype), acc)
        else:
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(
                w_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
            xs = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)  # the one row
            if GROUPED:
                acc2 += w.to(tl.float32) * s[:, None] * xs.to(tl.float32)[None, :]
            else:
                acc2 += w.to(tl.float32) * xs.to(tl.float32)[None, :]
    if not DOT:
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BN)
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:  # unscaled float32 partial of this split: scratch[pid_k, m, n]
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_SCALE and not GROUPED:  # fp8 weight: its per-row scale, once
            acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,
    b_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    idx = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same sum on every run
        acc += tl.load(part_ptr + s * M * N + idx, mask=mask, other=0.0)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


# Under TRITON_INTERPRET=1 (set before triton's import) @triton.jit gives interpreter objects.
INTERPRETED = not isinstance(_gemv_kernel, triton.runtime.JITFunction)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False  # tl.dot over x padded to 16 rows (any M); False: M == 1 only

    def __post_init__(self) -> None:
        if not all(_pow2(v) for v in (self.block_n, self.block_k, self.num_warps)) or self.split_k < 1:
            raise ValueError(f"block sizes and num_warps must be powers of two, split_k >= 1: {self}")
        if self.dot and min(self.block_n, self.block_k) < 16:
            raise ValueError(f"tl.dot needs block_n and block_k >= 16: {self}")

    def __str__(self) -> str:
        kind = "dot" if self.dot else "fma"
        return f"{kind}-n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"


# Sized for a 1.24B Llama's projections (N = 2048..16384, K = 2048 or 8192) on 132 SMs: each
# candidate gives >= 256 programs at N = K = 2048, from narrow tiles without split-K to split-K 8.
FMA_CANDIDATES = (
    GemvConfig(8, 512),
    GemvConfig(16, 512),
    GemvConfig(16, 256, split_k=2),
    GemvConfig(32, 256, split_k=4),
    GemvConfig(8, 1024, split_k=2, num_warps=8),
    GemvConfig(64, 128, split_k=8),
)
DOT_CANDIDATES = (
    GemvConfig(16, 256, dot=True, num_stages=3),
    GemvConfig(32, 256, dot=True, num_stages=3),
    GemvConfig(32, 128, split_k=2, dot=True, num_stages=4),
    GemvConfig(64, 128, split_k=4, dot=True, num_stages=3),
    GemvConfig(64, 256, split_k=2, num_warps=8, dot=True, num_stages=3),
    GemvConfig(128, 128, split_k=8, dot=True, num_stages=3),
)
# fp8 weights: the same, plus tiles twice as deep in K (as many bytes per tile as the 16-bit
# candidates above; num_warps 8 keeps the fma accumulator at 64 registers per thread).
FP8_FMA_EXTRA = (
    GemvConfig(16, 1024, num_warps=8),
    GemvConfig(16, 512, split_k=2),
    GemvConfig(32, 512, split_k=4, num_warps=8),
)
FP8_DOT_EXTRA = (
    GemvConfig(32, 512, dot=True, num_stages=3, num_warps=8),
    GemvConfig(64, 256, split_k=4, num_warps=8, dot=True, num_stages=3),
)
# CPU (the interpreter) and CUDA while capturing a graph without a tuned entry: no split-K, so
# no scratch buffer is needed.
DEFAULTS = {False: GemvConfig(16, 512), True: GemvConfig(32, 256, dot=True, num_stages=3)}

_SCRATCH: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def row_bucket(m: int) -> int:
    """Rows -> the bucket a config is tuned for: 1, 2, 4, 8 or 16 (the next power of two)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rows must be in 1..{MAX_ROWS}, got {m}")
    return triton.next_power_of_2(m)


def candidates(m: int, weight_dtype: torch.dtype | None = None) -> tuple[GemvConfig, ...]:
    """The configs timed for bucket(m) rows; weight_dtype FP8 adds the deeper fp8 tiles."""
    fma, dot = FMA_CANDIDATES, DOT_CANDIDATES
    if weight_dtype == FP8:
        fma, dot = fma + FP8_FMA_EXTRA, dot + FP8_DOT_EXTRA
    return fma + dot if row_bucket(m) == 1 else dot


def default_config(m: int) -> GemvConfig:
    return DEFAULTS[row_bucket(m) > 1]


def split_plan(k: int, config: GemvConfig) -> tuple[int, int]:
    """(splits actually launched, K per split): K per split is a multiple of block_k and no split
    is empty, so a small K runs fewer splits than asked."""
    per = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return triton.cdiv(k, per), per


def _scratch(device: torch.device, splits: int, n: int) -> torch.Tensor:
    key = (device, splits, n)
    buf = _SCRATCH.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"gemv: split-K scratch for N={n}, {splits} splits first needed during CUDA graph "
                "capture; run the shape once before capturing"
            )
        buf = _SCRATCH[key] = torch.empty(splits * MAX_ROWS * n, dtype=torch.float32, device=device)
    return buf


def _check(x, weight, bias, out, scale, group_size: int = 0, max_rows: int | None = MAX_ROWS):
    """(M, N, K) of valid arguments, else ValueError; max_rows None: any M >= 1 (shared with
    worker/kernels/triton_fp8_gemm.py)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m < 1 or (max_rows is not None and m > max_rows):
        raise ValueError(f"takes 1..{max_rows or 'any'} rows, got {m}")
    fp8 = weight.dtype == FP8
    if x.dtype not in DTYPES or not (fp8 or weight.dtype == x.dtype):
        raise ValueError(
            f"x must be one of {DTYPES} and weight of x's dtype or {FP8}, got {x.dtype} and {weight.dtype}"
        )
    if fp8 != (scale is not None):
        raise ValueError(f"scale goes with a {FP8} weight, and only with one")
    if group_size and not (_pow2(group_size) and group_size >= 16 and fp8):
        raise ValueError(f"group_size must be 0 or a power of two >= 16 (fp8 weights only), got {group_size}")
    shape = (n, triton.cdiv(k, group_size)) if group_size else (n,)
    if scale is not None and (
        scale.shape != shape or scale.dtype != torch.float32 or not scale.is_contiguous()
    ):
        raise ValueError(
            f"scale must be contiguous {list(shape)} float32, got {tuple(scale.shape)} {scale.dtype}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"x and weight need a contiguous last dim, got strides {x.stride()}, {weight.stride()}"
        )
    tensors = [weight] + [t for t in (bias, out, scale) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, weight, bias, scale and out must be on one device")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with a contiguous last dim")
    return m, n, k


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
    group_size: int = 0,
) -> torch.Tensor:
    m, n, k = _check(x, weight, bias, out, scale, group_size)
    if config is None:
        config = default_config(m)  # untuned: callers pass gemv_tuning.best_config(...)
    if not config.dot and m != 1:
        raise ValueError(f"config {config} (dot=False) takes one row, got {m}")
    if group_size and config.block_k > group_size:  # every K tile inside one scale group
        config = replace(config, block_k=group_size)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    splits, per = split_plan(k, config)
    has_bias = bias is not None
    b = bias if has_bias else weight  # never read without HAS_BIAS
    s = scale if scale is not None else weight  # never read without HAS_SCALE
    partial = _scratch(x.device, splits, n) if splits > 1 else out
    grid = (triton.cdiv(n, config.block_n), splits)
    groups = triton.cdiv(k, group_size) if group_size else 1
    args = (
        x,
        weight,
        b,
        s,
        partial,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        per,
        max(group_size, 1),
        groups,
    )
    _gemv_kernel[grid](
        *args,
        BLOCK_M=16 if config.dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT=config.dot,
        EVEN_K=k % per == 0,
        PARTIAL=splits > 1,
        HAS_BIAS=has_bias,
        HAS_SCALE=scale is not None,
        GROUPED=group_size > 0,
        DOT_F32=INTERPRETED or x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        meta = dict(
            SPLIT_K=splits,
            BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=REDUCE_BLOCK_N,
            HAS_BIAS=has_bias,
            HAS_SCALE=scale is not None and not group_size,
        )
        grid = (triton.cdiv(n, REDUCE_BLOCK_N),)
        _splitk_reduce_kernel[grid](partial, b, s, out, m, n, out.stride(0), **meta)
    return out
