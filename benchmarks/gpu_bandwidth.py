"""The bandwidth section of `make bench-gpu` (benchmarks/gpu_bench.py runs it first: the other
sections' denominator), and `read_bandwidth` for benchmarks/gpu_gemv.py.

Protocol: READ-ONLY bandwidth (a float32 tensor, 4 GiB in the full run, reduced by torch `sum` and
by a Triton kernel that loads every element once and writes one float per 128 KiB; both checked
against a float64 sum; the better of the two is "read bandwidth"), and a device-to-device `copy_`
of the same size counted as bytes read + bytes written. Timing: benchmarks/gpu_common.py `time_ms`.
Result: `res["read"]` and `res["copy"]` (a failure recorded as {"error": ...}, the rest still runs).
Proven by tests/test_gpu_bench.py (the smoke run, tiny sizes on CPU, Triton interpreted).
"""

from __future__ import annotations

import functools
import traceback

import torch

from benchmarks.gpu_common import fmt, time_ms


def copy_bandwidth(num_bytes: int, device: torch.device) -> dict:
    src = torch.randn(num_bytes // 4, device=device)  # float32: vectorized like K/V reads
    dst = torch.empty_like(src)
    ms, how = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": num_bytes, "ms": ms, "gbps": 2 * num_bytes / ms / 1e6, "timed_by": how}


READ_BLOCK, READ_ITERS = 4096, 8  # one Triton program reads 4096 x 8 floats = 128 KiB


@functools.cache
def _read_kernel():
    """A Triton kernel that reads every element once and writes one partial sum per program."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def read_bandwidth(num_bytes: int, device: torch.device) -> dict:
    """Read-only bandwidth: bytes read / time of a reduction over a float32 tensor (its output is
    one float, or one per 128 KiB for the Triton kernel: negligible writes). Both results are
    checked against a float64 sum; "gbps" is the better of the two kernels."""
    src = torch.rand(num_bytes // 4, device=device)
    n = src.numel()
    ref = float(src.sum(dtype=torch.float64))
    out = {"bytes": num_bytes}
    acc = torch.empty((), device=device)
    ms, how = time_ms(lambda: torch.sum(src, dim=0, out=acc), device)
    out["torch_sum"] = {
        "ms": ms,
        "gbps": num_bytes / ms / 1e6,
        "timed_by": how,
        "rel_err": abs(float(acc) - ref) / ref,
    }
    try:
        kernel = _read_kernel()
        grid = -(-n // (READ_BLOCK * READ_ITERS))
        partial = torch.empty(grid, device=device)
        ms, how = time_ms(
            lambda: kernel[(grid,)](src, partial, n, BLOCK=READ_BLOCK, ITERS=READ_ITERS), device
        )
        out["triton_read"] = {
            "ms": ms,
            "gbps": num_bytes / ms / 1e6,
            "timed_by": how,
            "rel_err": abs(float(partial.double().sum()) - ref) / ref,
        }
    except Exception as exc:  # noqa: BLE001 - torch's sum alone still gives a read bandwidth
        traceback.print_exc()
        out["triton_read"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    best = max((v for v in (out["torch_sum"], out["triton_read"]) if "gbps" in v), key=lambda v: v["gbps"])
    out["gbps"] = best["gbps"]
    out["best"] = "torch_sum" if best is out["torch_sum"] else "triton_read"
    return out


def bandwidth_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    """Read-only bandwidth (the attention and roofline denominator), then copy bandwidth."""
    try:
        res["read"] = read_bandwidth(sizes["read_bytes"], device)
        r = res["read"]
        print(
            f"read-only bandwidth: {r['gbps']:.0f} GB/s (torch sum {r['torch_sum']['gbps']:.0f}, "
            f"Triton read {fmt(r['triton_read'].get('gbps'), '.0f')})",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - the copy figure and attention still run
        traceback.print_exc()
        res["read"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save()
    try:
        res["copy"] = copy_bandwidth(sizes["copy_bytes"], device)
        print(f"device-to-device copy: {res['copy']['gbps']:.0f} GB/s (read + write)", flush=True)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res["copy"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save()
