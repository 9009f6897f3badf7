"""Timing and config search for the Triton GEMV (worker/kernels/triton_gemv.py).

Contract:
- `time_us(fns, device)`: median GPU time per call of a list of calls run in turn (CUDA: CUDA-graph
  replay between events; CPU: wall clock, meaningless beyond "it runs").
- `weight_copies(n, k, dtype, device, seed)`: random [N, K] weights, on CUDA enough copies to
  cycle through more than the L2 cache (ROTATE_BYTES, at most a quarter of the free memory) so
  each timed call reads from DRAM. 16-bit / fp32: N(0, 1/K). float8_e4m3fn: N(0, 1) rounded to
  e4m3, meant for the per-row scales of `weight_scale(n, k, device, seed)` (about 1/sqrt(K)), so
  the dequantized weight has the 16-bit copies' spread; with `group_size` > 0 the scales are
  [N, cdiv(K, group_size)] (one per group of K columns, as the fp8 GEMV's grouped form takes them).
- `tune(m, n, k, dtype, device, weight_dtype=None, group_size=0)`: us per call of every candidate
  (`candidates(bucket, weight_dtype)`) for bucket(m) rows of x in `dtype` against weights of
  `weight_dtype` (default: dtype), and of F.linear ("F.linear") when the weight is dense. fp8
  weights have no F.linear entry: worker/model/fp8.py times its own W8A8 path against the winner.
- `best_config(m, n, k, dtype, device, weight_dtype=None, group_size=0)`: the fastest candidate,
  timed once per key (row bucket 1/2/4/8/16, N, K, x dtype, weight dtype, fp8 scale group size,
  device) on CUDA and cached with every
  time (`TUNING`); `default_config(m)` on CPU and while a stream is capturing (no timing there).
  `tuning_times(...)` returns the cached times of a key (empty when never timed).
- Cost: per key, on CUDA, one graph capture + 11 replays per candidate over ~256 MiB of weight
  copies (freed afterwards, then `torch.cuda.empty_cache`), plus the candidates' compiles.
- Proven by tests/test_gemv.py (best_config on CPU; on CUDA, that the winner is the fastest timed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton

from worker.kernels.triton_gemv import FP8, GemvConfig, candidates, default_config, gemv, row_bucket

ROTATE_BYTES = 256 * 2**20  # weight copies cycled through when timing: > 4x an H200's 60 MiB L2

_BEST: dict[tuple, GemvConfig] = {}
# (bucket, N, K, x dtype, weight dtype, device) -> config label (and "F.linear") -> us per call
TUNING: dict[tuple, dict[str, float]] = {}


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
    """Random [N, K] weights (fp8: unit scale, see `weight_scale`), on CUDA enough copies to cycle
    through more than the L2 cache (ROTATE_BYTES, at most a quarter of the free memory)."""
    device = torch.device(device)
    size = n * k * torch.empty((), dtype=dtype).element_size()
    count = 1
    if device.type == "cuda":
        count = max(1, min(64, min(ROTATE_BYTES, torch.cuda.mem_get_info(device)[0] // 4) // max(size, 1)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = torch.randn(n, k, generator=gen)
    first = (first if dtype == FP8 else first * k**-0.5).to(device=device, dtype=dtype)
    return [first] + [first.clone() for _ in range(count - 1)]


def weight_scale(n: int, k: int, device: torch.device, seed: int = 0, group_size: int = 0) -> torch.Tensor:
    """float32 scales in [0.5, 1.5) / sqrt(K) for `weight_copies`' fp8 weights: [N] per row, or
    [N, cdiv(K, group_size)] per group of K columns."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    shape = (n, triton.cdiv(k, group_size)) if group_size else (n,)
    return ((0.5 + torch.rand(shape, generator=gen)) * k**-0.5).to(device)


def tune(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    weight_dtype: torch.dtype | None = None,
    group_size: int = 0,
) -> dict[str, float]:
    """us per call of every candidate for bucket(m) rows (and of F.linear for a dense weight)."""
    device = torch.device(device)
    weight_dtype = weight_dtype or dtype
    rows = row_bucket(m)
    weights = weight_copies(n, k, weight_dtype, device)
    scale = weight_scale(n, k, device, group_size=group_size) if weight_dtype == FP8 else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    times = {}
    if weight_dtype == dtype:
        times["F.linear"] = time_us([lambda w=w: F.linear(x, w) for w in weights], device)
    for config in candidates(rows, weight_dtype):
        fns = [
            lambda w=w, c=config: gemv(x, w, config=c, scale=scale, group_size=group_size) for w in weights
        ]
        times[str(config)] = time_us(fns, device)
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def tuning_key(m, n, k, dtype, device, weight_dtype=None, group_size: int = 0) -> tuple:
    """(row bucket, N, K, x dtype, weight dtype, scale group size, device with its index): TUNING's
    key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (row_bucket(m), n, k, dtype, weight_dtype or dtype, group_size, device)


def best_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    weight_dtype: torch.dtype | None = None,
    group_size: int = 0,
) -> GemvConfig:
    """The fastest candidate for bucket(m) rows of an [N, K] weight, timed once per key on CUDA
    (and cached, with every time in TUNING); DEFAULTS on CPU or while a stream is capturing."""
    key = tuning_key(m, n, k, dtype, device, weight_dtype, group_size)
    if key[-1].type != "cuda" or (key not in _BEST and torch.cuda.is_current_stream_capturing()):
        return default_config(m)
    if key not in _BEST:
        times = TUNING[key] = tune(m, n, k, dtype, key[-1], key[4], group_size)
        by_label = {str(c): c for c in candidates(m, key[4])}
        _BEST[key] = by_label[min(by_label, key=times.__getitem__)]
    return _BEST[key]


def tuning_times(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    weight_dtype: torch.dtype | None = None,
    group_size: int = 0,
) -> dict[str, float]:
    """TUNING's entry (us per call by config label, and "F.linear" for dense) for that key; empty
    when never timed (always on CPU)."""
    return TUNING.get(tuning_key(m, n, k, dtype, device, weight_dtype, group_size), {})


def choose_buckets(
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    buckets: Sequence[int],
    baseline: tuple[str, Callable[[int], float]],
    force: bool = False,
    weight_dtype: torch.dtype | None = None,
    group_size: int = 0,
) -> tuple[dict[int, GemvConfig], list[dict], list[str]]:
    """Per row bucket of an [N, K] weight (fp8 with `group_size` > 0: per-group scales, tuned
    under their own key): the GEMV's best config where it was timed faster than
    the path it replaces (`baseline` = (its name, its time in us for a bucket), timed the same way),
    or every bucket's default config with `force` (no timing). Returns (the configs to use by
    bucket, one report row per bucket: rows, config, gemv_us, `<name>_us`, use; log notes)."""
    name, baseline_us = baseline
    configs: dict[int, GemvConfig] = {}
    rows, notes = [], []
    for bucket in buckets:
        if force:
            config, gemv_us, base_us = default_config(bucket), None, None
        else:
            config = best_config(bucket, n, k, dtype, device, weight_dtype, group_size)
            gemv_us = tuning_times(bucket, n, k, dtype, device, weight_dtype, group_size)[str(config)]
            base_us = baseline_us(bucket)
            notes.append(f"{bucket} row(s) {gemv_us:.1f} vs {base_us:.1f} us ({config})")
        use = force or gemv_us < base_us
        if use:
            configs[bucket] = config
        row = {"rows": bucket, "config": str(config), "gemv_us": gemv_us, f"{name}_us": base_us}
        rows.append(row | {"use": use})
    return configs, rows, notes
