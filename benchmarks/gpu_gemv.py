"""Triton GEMV (worker/kernels/triton_gemv.py) vs cuBLAS (F.linear) on decode-sized inputs (issue 19).

Protocol, per weight shape (default: the 1.24B Llama of benchmarks/gpu_bench.py, LLAMA_1B: q|k|v
3072x2048, o_proj 2048x2048, gate|up 16384x2048, down_proj 2048x8192, bfloat16) and row count M
(default 1, 4, 8, 16):
- Weights: copies of one random [N, K] weight, >= 256 MiB in all (`gemv_tuning.weight_copies`),
  cycled through so every call reads its weight from DRAM as a decode step does (16 layers, ~2 GiB
  of weights per step, far beyond the L2).
- cuBLAS: `F.linear(x, W)`; gemv: `gemv(x, W, config=best_config(M, N, K))`, the best of the
  candidates timed the same way (all their times are kept in the row, `candidates_us`).
- Timing: `gemv_tuning.time_us` (a CUDA graph of >= 32 calls, median of 11 replays between CUDA
  events): GPU time per call as a decode graph runs it, without Python launch overhead.
- Checked in each row: max |out - ref| / max |ref| against the float32 product, for both.
- Reported: us per call, GB/s of weight read (N * K * 2 bytes / time), and in the markdown the
  share of a given bandwidth (the measured read-only bandwidth; `__main__` measures it with
  benchmarks/gpu_bandwidth.py's reader unless --bandwidth-gbs), plus the sum per decode step (each
  shape once per layer, 16 layers) for cuBLAS, gemv, and the faster of the two per shape.
- FP8 rows (`gemv_bench(..., fp8=True)`, the CLI's default; `kind: "fp8"`), per shape and M,
  as `--quantization fp8` runs a projection: an e4m3 copy of the weight (N * K bytes, per-row
  float32 scales: `gemv_tuning.weight_copies` / `weight_scale`), x in the bench dtype. The W8A16
  GEMV (`gemv(x, q, scale=...)`, `best_config(..., weight_dtype=fp8)`) against the W8A8 path
  (`Fp8Linear.forward_w8a8`: the Triton activation quantizer + `torch._scaled_mm`) and against
  the dense row's cuBLAS time; errors vs the float32 product with the dequantized weight. The
  step table sums dense cuBLAS, W8A8, the GEMV and the faster fp8 path per shape (what
  `use_fp8_gemv` picks), with that as a speedup over dense cuBLAS: the projections' part of issue
  19's FP8 target (>= 1.6x bf16 at batch 1 for the whole step, whose LM head stays bf16).
- Grouped FP8 rows (`gemv_bench(..., grouped=True)`, the CLI's default; `kind: "fp8-g128"`): the
  default `--quantization fp8` form (per-row-and-128-column scales, W8A16) as Fp8Linear runs it:
  for each M of `rows` the grouped GEMV (`path: "gemv"`), for each of `gemm_rows` (default 64: a
  graph-captured decode batch; 512: a prefill chunk) the Triton fp8 GEMM
  (worker/kernels/triton_fp8_gemm.py, `path: "gemm"`), each against F.linear on the bf16 weight
  (`cublas_us`) and against what the GEMM replaced, the weight dequantized + F.linear
  (`dense_us`); errors vs the float32 product with the dequantized weight.
On CPU (`TRITON_INTERPRET=1 ... --smoke`, tests/test_gemv.py, tests/test_fp8_gemm.py) the same code
runs tiny shapes with Triton interpreted: the times mean nothing there, only that it runs and the
values are right.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.gpu_bandwidth import read_bandwidth
from worker.kernels import gemv_tuning, triton_fp8_gemm, triton_gemv
from worker.model.fp8 import FP8, Fp8Linear

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
    fp8: bool = False,
    grouped: bool = False,
    gemm_rows=(64, 512),
) -> list[dict]:
    device = torch.device(device)
    results = []
    for name, n, k in shapes:
        dense = _dense_rows(device, name, n, k, rows, dtype)
        results += dense
        if fp8:
            results += _fp8_rows(device, name, n, k, rows, dtype, {r["rows"]: r["cublas_us"] for r in dense})
        if grouped:
            results += _grouped_rows(device, name, n, k, rows, gemm_rows, dtype)
    return results


def _grouped_rows(device, name, n, k, rows, gemm_rows, dtype, group: int = 128) -> list[dict]:
    """The per-group fp8 form: grouped GEMV (rows) or fp8 GEMM (gemm_rows) vs bf16 F.linear and vs
    dequantize + F.linear."""
    dense_w = gemv_tuning.weight_copies(n, k, dtype, device, seed=n + k)
    copies = gemv_tuning.weight_copies(n, k, FP8, device, seed=n + k)
    scale = gemv_tuning.weight_scale(n, k, device, seed=n + k, group_size=group)
    layers = [Fp8Linear(q, scale, None, dtype, group) for q in copies]
    ref_w = layers[0].dequantize()
    results = []
    for m in [*rows, *gemm_rows]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
        if m <= triton_gemv.MAX_ROWS:
            config = gemv_tuning.best_config(m, n, k, dtype, device, FP8, group)
            kernel = partial(triton_gemv.gemv, x, config=config, scale=scale, group_size=group)
        else:
            config = triton_fp8_gemm.config_for(m)
            kernel = partial(triton_fp8_gemm.fp8_gemm, x, scale=scale, group_size=group)
        kernel_us = gemv_tuning.time_us([lambda q=q: kernel(q) for q in copies], device)
        cublas_us = gemv_tuning.time_us([lambda w=w: F.linear(x, w) for w in dense_w], device)
        dense_us = gemv_tuning.time_us([lambda f=f: f.forward_dense(x) for f in layers], device)
        ref = x.float() @ ref_w.T
        path = "gemv" if m <= triton_gemv.MAX_ROWS else "gemm"
        results.append(
            dict(shape=name, kind=f"fp8-g{group}", path=path, n=n, k=k, rows=m, group_size=group)
            | dict(x_dtype=str(dtype).removeprefix("torch."), weight_bytes=n * k, config=str(config))
            | dict(kernel_us=kernel_us, cublas_us=cublas_us, dense_us=dense_us)
            | dict(speedup_vs_cublas=cublas_us / kernel_us, speedup_vs_dense=dense_us / kernel_us)
            | dict(kernel_rel_err=rel_err(kernel(copies[0]), ref))
            | dict(dense_rel_err=rel_err(layers[0].forward_dense(x), ref))
        )
    del dense_w, copies, layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def grouped_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "FP8 per group (e4m3, one scale per row and 128 columns, W8A16: the default form): the grouped GEMV "
        "(<= 16 rows) or the Triton fp8 GEMM vs F.linear on the bf16 weight and vs dequantize + F.linear.",
        "",
        "| shape | N x K | rows | path | kernel us | cuBLAS bf16 us | dequant + F.linear us | vs bf16 "
        "| vs dequant | config | rel. err. kernel / dequant |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in (r for r in rows if r.get("kind", "").startswith("fp8-g")):
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['path']} | {r['kernel_us']:.1f} | "
            f"{r['cublas_us']:.1f} | {r['dense_us']:.1f} | {r['speedup_vs_cublas']:.2f}x | "
            f"{r['speedup_vs_dense']:.2f}x | {r['config']} | "
            f"{r['kernel_rel_err']:.1e} / {r['dense_rel_err']:.1e} |"
        )
    return lines


def _dense_rows(device, name, n, k, rows, dtype) -> list[dict]:
    results = []
    weights = gemv_tuning.weight_copies(n, k, dtype, device, seed=n + k)
    nbytes = n * k * weights[0].element_size()
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
        config = gemv_tuning.best_config(m, n, k, dtype, device)
        cublas_us = gemv_tuning.time_us([lambda w=w: F.linear(x, w) for w in weights], device)
        gemv_us = gemv_tuning.time_us(
            [lambda w=w: triton_gemv.gemv(x, w, config=config) for w in weights], device
        )
        ref = x.float() @ weights[0].float().T
        results.append(
            dict(
                shape=name,
                kind="dense",
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
                candidates_us=gemv_tuning.tuning_times(m, n, k, dtype, device),
            )
        )
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _fp8_rows(device, name, n, k, rows, dtype, bf16_us: dict[int, float]) -> list[dict]:
    copies = gemv_tuning.weight_copies(n, k, FP8, device, seed=n + k)
    scale = gemv_tuning.weight_scale(n, k, device, seed=n + k)
    layers = [Fp8Linear(q, scale, None, dtype) for q in copies]  # W8A8 as the model runs it
    ref_w = copies[0].float() * scale[:, None]
    results = []
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
        config = gemv_tuning.best_config(m, n, k, dtype, device, FP8)
        w8a8_us = gemv_tuning.time_us([lambda f=f: f.forward_w8a8(x) for f in layers], device)
        gemv_us = gemv_tuning.time_us(
            [lambda q=q: triton_gemv.gemv(x, q, config=config, scale=scale) for q in copies], device
        )
        ref = x.float() @ ref_w.T
        results.append(
            dict(
                shape=name,
                kind="fp8",
                n=n,
                k=k,
                rows=m,
                dtype="float8_e4m3fn",
                x_dtype=str(dtype).removeprefix("torch."),
                weight_bytes=n * k,
                config=str(config),
                cublas_us=bf16_us[m],
                w8a8_us=w8a8_us,
                gemv_us=gemv_us,
                speedup_vs_cublas=bf16_us[m] / gemv_us,
                speedup_vs_w8a8=w8a8_us / gemv_us,
                gemv_gbs=n * k / gemv_us / 1e3,
                w8a8_gbs=n * k / w8a8_us / 1e3,
                gemv_rel_err=rel_err(triton_gemv.gemv(x, copies[0], config=config, scale=scale), ref),
                w8a8_rel_err=rel_err(layers[0].forward_w8a8(x), ref),
                candidates_us=gemv_tuning.tuning_times(m, n, k, dtype, device, FP8),
            )
        )
    del copies, layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def step_totals(rows: list[dict], layers: int = LLAMA_1B_LAYERS) -> list[dict]:
    """Per row count: the shapes' times summed once per layer (one decode step's projections)."""
    totals = []
    rows = dense_rows(rows)
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


def dense_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind", "dense") == "dense"]


def fp8_step_totals(rows: list[dict], layers: int = LLAMA_1B_LAYERS) -> list[dict]:
    """Per row count, the fp8 rows summed once per layer: dense cuBLAS, W8A8, the GEMV, and the
    faster fp8 path per shape (what use_fp8_gemv picks); speedup = cuBLAS / that."""
    totals = []
    rows = [r for r in rows if r.get("kind") == "fp8"]
    for m in sorted({r["rows"] for r in rows}):
        sel = [r for r in rows if r["rows"] == m]
        t = dict(rows=m, weight_bytes=layers * sum(r["weight_bytes"] for r in sel))
        for key in ("cublas_us", "w8a8_us", "gemv_us"):
            t[key] = layers * sum(r[key] for r in sel)
        t["best_us"] = layers * sum(min(r["w8a8_us"], r["gemv_us"]) for r in sel)
        t["speedup_vs_cublas"] = t["cublas_us"] / t["best_us"]
        totals.append(t)
    return totals


def fp8_markdown(rows: list[dict], bandwidth_gbs: float, layers: int) -> list[str]:
    lines = [
        "",
        "FP8 weights (e4m3, per-row scales; N x K bytes): W8A16 Triton GEMV vs W8A8 (Triton activation "
        "quantizer + torch._scaled_mm, as Fp8Linear) vs the dense weight's cuBLAS; rel. err. vs the float32 "
        "product with the dequantized weight.",
        "",
        "| shape | N x K | rows | cuBLAS us (dense) | W8A8 us | fp8 gemv us | gemv vs cuBLAS | gemv vs W8A8 "
        "| fp8 gemv GB/s | gemv config | rel. err. gemv / W8A8 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.get("kind") != "fp8":
            continue
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['cublas_us']:.1f} | "
            f"{r['w8a8_us']:.1f} | {r['gemv_us']:.1f} | {r['speedup_vs_cublas']:.2f}x | "
            f"{r['speedup_vs_w8a8']:.2f}x | "
            f"{r['gemv_gbs']:.4g} ({r['gemv_gbs'] / bandwidth_gbs:.0%}) | {r['config']} | "
            f"{r['gemv_rel_err']:.1e} / {r['w8a8_rel_err']:.1e} |"
        )
    lines += [
        "",
        f"FP8 per decode step ({layers} layers x these shapes; target: >= 1.6x the dense step at batch 1):",
        "",
        "| rows | cuBLAS us (dense) | W8A8 us | fp8 gemv us | faster fp8 path per shape, us | speedup "
        "| its share of bandwidth |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in fp8_step_totals(rows, layers):
        best_gbs = t["weight_bytes"] / t["best_us"] / 1e3
        lines.append(
            f"| {t['rows']} | {t['cublas_us']:.0f} | {t['w8a8_us']:.0f} | {t['gemv_us']:.0f} | "
            f"{t['best_us']:.0f} | {t['speedup_vs_cublas']:.2f}x | {best_gbs / bandwidth_gbs:.0%} |"
        )
    return lines


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
    for r in dense_rows(rows):
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
    if any(r.get("kind") == "fp8" for r in rows):
        lines += fp8_markdown(rows, bandwidth_gbs, layers)
    if any(r.get("kind", "").startswith("fp8-g") for r in rows):
        lines += grouped_markdown(rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", default="1,4,8,16", help="row counts M, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--bandwidth-gbs", type=float, help="default: measured (4 GiB read-only reduction)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreted)")
    p.add_argument("--no-fp8", action="store_true", help="dense rows only")
    p.add_argument("--gemm-rows", default="64,512", help="row counts of the grouped fp8 GEMM rows")
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
        fp8=not args.no_fp8,
        grouped=not args.no_fp8,
        gemm_rows=tuple(int(v) for v in args.gemm_rows.split(",")),
    )
    bandwidth = args.bandwidth_gbs
    if bandwidth is None and device.type == "cuda":
        bandwidth = read_bandwidth(2**32, device)["gbps"]
    bandwidth = bandwidth or statistics.median(r["gemv_gbs"] for r in dense_rows(rows))  # CPU: a placeholder
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
