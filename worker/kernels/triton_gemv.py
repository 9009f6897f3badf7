"""Triton GEMV / skinny GEMM for decode: `y = x @ W^T (+ bias)` with x [M <= 16, K], W [N, K].

Contract:
- Input: `gemv(x [M, K], weight [N, K], bias [N] | None, out=None, config=None)`; x and weight
  of one dtype (bfloat16, float16 or float32), both with a contiguous last dim (any row stride),
  1 <= M <= MAX_ROWS (16), on one device; `out` [M, N] in x's dtype with a contiguous last dim.
  `config` (a `GemvConfig`) defaults to `best_config(M, N, K, dtype, device)`.
- Output: `out` (new when None): `x @ W^T + bias` accumulated in float32 (products of the stored
  values, no tf32: fp32 dots use "ieee"), bias added in float32, cast once to x's dtype.
- Kernels: each program reads a [BLOCK_N, BLOCK_K] tile of W per step over its share of K, so W
  is read exactly once (masked tails; `evict_first`, it is streamed). `dot=False` configs (M == 1
  only) keep a [BLOCK_N, BLOCK_K] float32 accumulator of products and reduce it once at the end;
  `dot=True` configs pad x to 16 rows and use `tl.dot` (tensor cores for 16-bit types). Split-K
  (`split_k > 1`, the grid is N/BLOCK_N x splits so N = K = 2048 still fills 132 SMs): each split
  writes its float32 partial [M, N] into a scratch buffer and a second kernel sums the splits in
  a fixed order, adds the bias and casts: deterministic (no atomics), and no memset.
- CUDA-graph safety: no host syncs, and the scratch is one buffer per (device, N, splits), sized
  for 16 rows, allocated on first use and then reused by every call (never freed or moved), so a
  captured graph keeps valid pointers. Allocating one during capture raises RuntimeError: run
  the shape once before capturing (`worker.model.gemv.use_triton_gemv` does). Calls sharing a
  buffer must be ordered: one stream per device, as the engine runs.
- Configs: `candidates(M)` (dot=False ones for M == 1, dot=True ones for every M);
  `best_config` times them on CUDA (`tune`: CUDA-graph replay of a chain of calls over copies of
  W that together exceed the L2 cache, CUDA events, median) once per (row bucket 1/2/4/8/16, N, K,
  dtype, device) and caches the winner and every time (`TUNING`, F.linear's too, under "F.linear");
  on CPU, and while a stream is capturing, it returns `DEFAULTS` without timing.
- Cost: one launch (split_k == 1) or two; weight bytes read once; x re-read from L2 by every
  N tile; a split-K scratch of 4 * splits * 16 * N bytes per (N, splits), kept.
- Fails how: ValueError for a wrong rank, shape, dtype, device or stride, M outside 1..16, or a
  dot=False config with M > 1; RuntimeError for a scratch buffer first needed during capture.
- Proven by tests/test_gemv.py (every candidate vs the float32 product on CPU under the
  interpreter, M = 1..16, odd N and K, bias or not, NaN-poisoned output and scratch; on CUDA also
  replay inside a CUDA graph); speed by benchmarks/gpu_gemv.py on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCE_BLOCK_N = 128
ROTATE_BYTES = 256 * 2**20  # weight copies cycled through when timing: > 4x an H200's 60 MiB L2


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
        if DOT:  # W^T tile (BK, BN): column n is W's row n, contiguous along K
            w_mask = n_ok[None, :] & k_ok[:, None]
            wt = tl.load(
                w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
            x_mask = m_ok[:, None] & k_ok[None, :]
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
            if DOT_F32:  # float32 inputs, or the interpreter (it cannot tl.dot bfloat16)
                acc = tl.dot(xs.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, wt, acc)
        else:
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(
                w_rows[:, None] + offs_k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first"
            )
            xs = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)  # the one row
            acc2 += w.to(tl.float32) * xs.to(tl.float32)[None, :]
    if not DOT:
        acc = tl.sum(acc2, axis=1)[None, :]  # (1, BN)
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:  # float32 partial of this split: scratch[pid_k, m, n]
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    idx = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same sum on every run
        acc += tl.load(part_ptr + s * M * N + idx, mask=mask, other=0.0)
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
# CPU (the interpreter) and CUDA while capturing a graph without a tuned entry: no split-K, so
# no scratch buffer is needed.
DEFAULTS = {False: GemvConfig(16, 512), True: GemvConfig(32, 256, dot=True, num_stages=3)}

_SCRATCH: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_BEST: dict[tuple, GemvConfig] = {}
TUNING: dict[tuple, dict[str, float]] = {}  # (bucket, N, K, dtype, device) -> label -> us per call


def row_bucket(m: int) -> int:
    """Rows -> the bucket a config is tuned for: 1, 2, 4, 8 or 16 (the next power of two)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rows must be in 1..{MAX_ROWS}, got {m}")
    return triton.next_power_of_2(m)


def candidates(m: int) -> tuple[GemvConfig, ...]:
    return FMA_CANDIDATES + DOT_CANDIDATES if row_bucket(m) == 1 else DOT_CANDIDATES


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


def _check(x, weight, bias, out) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"x and weight need a contiguous last dim, got strides {x.stride()}, {weight.stride()}"
        )
    tensors = [weight] + [t for t in (bias, out) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, weight, bias and out must be on one device")
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
) -> torch.Tensor:
    m, n, k = _check(x, weight, bias, out)
    if config is None:
        config = best_config(m, n, k, x.dtype, x.device)
    if not config.dot and m != 1:
        raise ValueError(f"config {config} (dot=False) takes one row, got {m}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    splits, per = split_plan(k, config)
    has_bias = bias is not None
    b = bias if has_bias else weight  # never read without HAS_BIAS
    partial = _scratch(x.device, splits, n) if splits > 1 else out
    grid = (triton.cdiv(n, config.block_n), splits)
    args = (x, weight, b, partial, m, n, k, x.stride(0), weight.stride(0), out.stride(0), per)
    _gemv_kernel[grid](
        *args,
        BLOCK_M=16 if config.dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT=config.dot,
        EVEN_K=k % per == 0,
        PARTIAL=splits > 1,
        HAS_BIAS=has_bias,
        DOT_F32=INTERPRETED or x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        meta = dict(
            SPLIT_K=splits, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=REDUCE_BLOCK_N, HAS_BIAS=has_bias
        )
        _splitk_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK_N),)](partial, b, out, m, n, out.stride(0), **meta)
    return out


def time_us(
    fns: Sequence[Callable[[], object]], device: torch.device, min_calls: int = 32, replays: int = 11
) -> float:
    """Median time per call of `fns` run in turn. CUDA: one untimed round on a side stream (compiles,
    allocates scratch and cuBLAS workspaces), then a CUDA graph of >= min_calls calls replayed
    `replays` times between CUDA events: GPU time as a decode graph sees it, without Python launch
    overhead. CPU: wall clock of whole rounds, median of three."""
    device = torch.device(device)
    if device.type != "cuda":
        rounds = []
        for _ in range(4):  # the first round warms up
            start = time.perf_counter()
            for fn in fns:
                fn()
            rounds.append((time.perf_counter() - start) * 1e6 / len(fns))
        return statistics.median(rounds[1:])
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    main.wait_stream(side)
    torch.cuda.synchronize(device)
    repeat = triton.cdiv(min_calls, len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in fns:
                fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (repeat * len(fns)))
    return statistics.median(times)


def weight_copies(
    n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> list[torch.Tensor]:
    """Random [N, K] weights, on CUDA enough copies to cycle through more than the L2 cache
    (ROTATE_BYTES, at most a quarter of the free memory) so each timed call reads from DRAM."""
    size = n * k * torch.empty((), dtype=dtype).element_size()
    count = 1
    if device.type == "cuda":
        count = max(1, min(64, min(ROTATE_BYTES, torch.cuda.mem_get_info(device)[0] // 4) // max(size, 1)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
    return [first] + [first.clone() for _ in range(count - 1)]


def tune(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """us per call of every candidate for bucket(m) rows, and of F.linear, same weights and x."""
    device = torch.device(device)
    rows = row_bucket(m)
    weights = weight_copies(n, k, dtype, device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    times = {"F.linear": time_us([lambda w=w: F.linear(x, w) for w in weights], device)}
    for config in candidates(rows):
        times[str(config)] = time_us([lambda w=w, c=config: gemv(x, w, config=c) for w in weights], device)
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def _key(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (row_bucket(m), n, k, dtype, device)


def best_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> GemvConfig:
    """The fastest candidate for bucket(m) rows of an [N, K] weight, timed once per key on CUDA
    (and cached, with every time in TUNING); DEFAULTS on CPU or while a stream is capturing."""
    key = _key(m, n, k, dtype, device)
    if key[-1].type != "cuda" or (key not in _BEST and torch.cuda.is_current_stream_capturing()):
        return default_config(m)
    if key not in _BEST:
        times = TUNING[key] = tune(m, n, k, dtype, key[-1])
        by_label = {str(c): c for c in candidates(m)}
        _BEST[key] = by_label[min(by_label, key=times.__getitem__)]
    return _BEST[key]


def tuning_times(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> dict[str, float]:
    """TUNING's entry (us per call by config label and "F.linear") for that key; empty on CPU."""
    return TUNING.get(_key(m, n, k, dtype, device), {})
