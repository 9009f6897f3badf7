"""Triton GEMV (worker/kernels/triton_gemv.py) vs cuBLAS (F.linear) on decode-sized inputs (issue 19).

Protocol, per weight shape (default: the 1.24B Llama of benchmarks/gpu_bench.py, LLAMA_1B: q|k|v
3072x2048, o_proj 2048x2048, gate|up 16384x2048, down_proj 2048x8192, bfloat16) and row count M
(default 1, 4, 8, 16):
- Weights: copies of one random [N, K] weight, >= 256 MiB in all (`triton_gemv.weight_copies`),
  cycled through so every call reads its weight from DRAM as a decode step does (16 layers, ~2 GiB
  of weights per step, far beyond the L2).
- cuBLAS: `F.linear(x, W)`; gemv: `gemv(x, W, config=best_config(M, N, K))`, the best of the
  candidates timed the same way (all their times are kept in the row, `candidates_us`).
- Timing: `triton_gemv.time_us` (a CUDA graph of >= 32 calls, median of 11 replays between CUDA
  events): GPU time per call as a decode graph runs it, without Python launch overhead.
- Checked in each row: max |out - ref| / max |ref| against the float32 product, for both.
- Reported: us per call, GB/s of weight read (N * K * 2 bytes / time), and in the markdown the
  share of a given bandwidth (the measured read-only bandwidth; `__main__` measures it with
  benchmarks/gpu_bench.py's reader unless --bandwidth-gbs), plus the sum per decode step (each
  shape once per layer, 16 layers) for cuBLAS, gemv, and the faster of the two per shape.
On CPU (`--smoke`, tests/test_gemv.py) the same code runs tiny shapes with Triton interpreted:
the times mean nothing there, only that it runs and the values are right.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from worker.kernels import triton_gemv

# (name, N, K) of benchmarks/gpu_bench.py's LLAMA_1B (checked by tests/test_gemv.py: shapes_of).
LLAMA_1B_SHAPES = (
    ("qkv_proj", 3072, 2048),
    ("o_proj", 2048, 2048),
    ("gate_up_proj", 16384, 2048),
    ("down_proj", 2048, 8192),
)
LLAMA_1B_LAYERS = 16
SMOKE_SHAPES = (("qkv_proj", 40, 72), ("down_proj", 24, 130))


def shapes_of(cfg) -> tuple[tuple[str, int, int], ...]:
    """The decoder's four projections (name, N, K) for a ModelConfig."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (
        ("qkv_proj", q + 2 * kv, cfg.hidden_size),
        ("o_proj", cfg.hidden_size, q),
        ("gate_up_proj", 2 * cfg.intermediate_size, cfg.hidden_size),
        ("down_proj", cfg.hidden_size, cfg.intermediate_size),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def gemv_bench(
    device: torch.device | str,
    shapes=LLAMA_1B_SHAPES,
    rows=(1, 4, 8, 16),
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    device = torch.device(device)
    results = []
    for name, n, k in shapes:
        weights = triton_gemv.weight_copies(n, k, dtype, device, seed=n + k)
        nbytes = n * k * weights[0].element_size()
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
            config = triton_gemv.best_config(m, n, k, dtype, device)
            cublas_us = triton_gemv.time_us([lambda w=w: F.linear(x, w) for w in weights], device)
            gemv_us = triton_gemv.time_us(
                [lambda w=w: triton_gemv.gemv(x, w, config=config) for w in weights], device
            )
            ref = x.float() @ weights[0].float().T
            results.append(
                dict(
                    shape=name,
                    n=n,
                    k=k,
                    rows=m,
                    dtype=str(dtype).removeprefix("torch."),
                    weight_bytes=nbytes,
                    config=str(config),
                    cublas_us=cublas_us,
                    gemv_us=gemv_us,
                    speedup=cublas_us / gemv_us,
                    cublas_gbs=nbytes / cublas_us / 1e3,
                    gemv_gbs=nbytes / gemv_us / 1e3,
                    gemv_rel_err=rel_err(triton_gemv.gemv(x, weights[0], config=config), ref),
                    cublas_rel_err=rel_err(F.linear(x, weights[0]), ref),
                    candidates_us=triton_gemv.tuning_times(m, n, k, dtype, device),
                )
            )
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def step_totals(rows: list[dict], layers: int = LLAMA_1B_LAYERS) -> list[dict]:
    """Per row count: the shapes' times summed once per layer (one decode step's projections)."""
    totals = []
    for m in sorted({r["rows"] for r in rows}):
        sel = [r for r in rows if r["rows"] == m]
        totals.append(
            dict(
                rows=m,
                weight_bytes=layers * sum(r["weight_bytes"] for r in sel),
                cublas_us=layers * sum(r["cublas_us"] for r in sel),
                gemv_us=layers * sum(r["gemv_us"] for r in sel),
                best_us=layers * sum(min(r["cublas_us"], r["gemv_us"]) for r in sel),
            )
        )
    return totals


def rows_to_markdown(rows: list[dict], bandwidth_gbs: float, layers: int = LLAMA_1B_LAYERS) -> str:
    def share(gbs: float) -> str:
        return f"{gbs:.4g} ({gbs / bandwidth_gbs:.0%})"

    lines = [
        f"Weight read in GB/s and as a share of {bandwidth_gbs:.4g} GB/s; us per call (CUDA-graph "
        "replay, median); rel. err. vs the float32 product.",
        "",
        "| shape | N x K | rows | cuBLAS us | gemv us | speedup | cuBLAS GB/s | gemv GB/s | gemv config "
        "| rel. err. gemv / cuBLAS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['cublas_us']:.1f} | "
            f"{r['gemv_us']:.1f} | {r['speedup']:.2f}x | {share(r['cublas_gbs'])} | {share(r['gemv_gbs'])} | "
            f"{r['config']} | {r['gemv_rel_err']:.1e} / {r['cublas_rel_err']:.1e} |"
        )
    lines += [
        "",
        f"Per decode step ({layers} layers x these shapes):",
        "",
        "| rows | cuBLAS us | gemv us | faster of the two per shape, us | its share of bandwidth |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t in step_totals(rows, layers):
        best_gbs = t["weight_bytes"] / t["best_us"] / 1e3
        lines.append(
            f"| {t['rows']} | {t['cublas_us']:.0f} | {t['gemv_us']:.0f} | {t['best_us']:.0f} | "
            f"{best_gbs / bandwidth_gbs:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", default="1,4,8,16", help="row counts M, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--bandwidth-gbs", type=float, help="default: measured (4 GiB read-only reduction)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreted)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--md", help="write the markdown table here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        p.error("no CUDA device: run with --smoke (tiny shapes, Triton interpreted)")
    rows = gemv_bench(
        device,
        SMOKE_SHAPES if args.smoke else LLAMA_1B_SHAPES,
        tuple(int(v) for v in args.rows.split(",")),
        getattr(torch, args.dtype),
    )
    bandwidth = args.bandwidth_gbs
    if bandwidth is None and device.type == "cuda":
        from benchmarks.gpu_bench import read_bandwidth  # lazy: gpu_bench may import this module

        bandwidth = read_bandwidth(2**32, device)["gbps"]
    bandwidth = bandwidth or statistics.median(r["gemv_gbs"] for r in rows)  # CPU: a placeholder
    text = rows_to_markdown(rows, bandwidth)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbs": bandwidth, "device": str(device), "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
