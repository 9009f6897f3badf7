"""Timing and formatting helpers shared by `make bench-gpu`'s modules (benchmarks/gpu_bench.py and
its sections): `time_ms` times a callable by CUDA-graph replay (`triton.testing.do_bench`, median,
L2 flushed before every replay; eager where the callable cannot be captured, wall clock on CPU),
`fmt` formats a figure that may be missing.
"""

from __future__ import annotations

import statistics
import time

import torch


def time_ms(fn, device: torch.device) -> tuple[float, str]:
    """Median time of fn in ms and how it was timed (graph replay where possible)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), "cpu wall clock"
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # not capturable: time eagerly, launch overhead included
        return do_bench(fn, warmup=10, rep=50, return_mode="median"), f"eager ({exc})"[:120]
    return do_bench(graph.replay, warmup=10, rep=50, return_mode="median"), "cuda graph"


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
