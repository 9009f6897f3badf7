"""The fused RMSNorm, RoPE and SiLU-and-mul Triton kernels against the model's torch code (a
`make bench-gpu` part).

Issue 3 wants them wired into the model only "if they pay off in the GPU benchmark"; this is that
measurement. Per token count (decode batches and a prefill chunk), on the benchmark's model shape
and dtype:
- norm: torch `x + residual` then `RMSNorm` (what a decoder layer does between its blocks) vs
  `triton_norm.rms_norm(x, weight, eps, residual=residual)` (one kernel, returns both);
- rope: torch `RotaryEmbedding.apply` on q and k (the cos/sin gather is done once per step, outside
  the timing, as the model does) vs `triton_norm.rotary_embedding` (which gathers them itself);
- silu: torch `F.silu(gate) * up` on the [T, 2 x intermediate] gate|up output vs
  `triton_norm.silu_and_mul`.
Times come from `gpu_common.time_ms` (CUDA-graph replay, median); outputs are compared (max
relative error). Speedup = torch time / fused time; a layer runs two norms, one RoPE and one SiLU-and-mul, so
`layer_saving_us` = 2 x norm saving + rope saving + silu saving, times the model's layers per step.
"""

from __future__ import annotations

import time
import traceback

import torch

from worker.model.llama import RMSNorm, RotaryEmbedding


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def fused_case(tokens: int, cfg, dtype, device, time_ms) -> dict:
    from worker.kernels.triton_norm import rms_norm, rotary_embedding, silu_and_mul

    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    residual = torch.randn(tokens, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    out = {}

    def torch_norm():
        out["torch_norm"] = norm(x + residual)

    def fused_norm():
        out["fused_norm"], out["fused_residual"] = rms_norm(x, norm.weight, cfg.rms_eps, residual)

    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling).to(device)
    positions = torch.randint(0, min(cfg.max_position, 4096), (tokens,), generator=gen, device=device)
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)

    cos_sin = rope.tables(positions)  # the model gathers these once per step, for all layers

    def torch_rope():
        out["torch_q"], out["torch_k"] = RotaryEmbedding.apply(cos_sin, q), RotaryEmbedding.apply(cos_sin, k)

    def fused_rope():
        out["fused_q"], out["fused_k"] = rotary_embedding(positions, q, k, rope.cos, rope.sin)

    gate_up = torch.randn(tokens, 2 * cfg.intermediate_size, generator=gen, device=device, dtype=dtype)

    def torch_silu():
        gate, up = gate_up.chunk(2, dim=-1)
        out["torch_silu"] = torch.nn.functional.silu(gate) * up

    def fused_silu():
        out["fused_silu"] = silu_and_mul(gate_up)

    cases = (
        ("norm_torch", torch_norm),
        ("norm_fused", fused_norm),
        ("rope_torch", torch_rope),
        ("rope_fused", fused_rope),
        ("silu_torch", torch_silu),
        ("silu_fused", fused_silu),
    )
    with torch.no_grad():
        row = {"tokens": tokens}
        for name, fn in cases:
            ms, _ = time_ms(fn, device)
            row[f"{name}_us"] = ms * 1e3
        for _, fn in cases:  # eager results to compare
            fn()
    row["norm_speedup"] = row["norm_torch_us"] / row["norm_fused_us"]
    row["rope_speedup"] = row["rope_torch_us"] / row["rope_fused_us"]
    row["silu_speedup"] = row["silu_torch_us"] / row["silu_fused_us"]
    row["layer_saving_us"] = (
        2 * (row["norm_torch_us"] - row["norm_fused_us"])
        + row["rope_torch_us"]
        - row["rope_fused_us"]
        + row["silu_torch_us"]
        - row["silu_fused_us"]
    )
    row["step_saving_us"] = row["layer_saving_us"] * cfg.num_layers
    row["max_rel_err"] = max(
        rel_err(out["fused_norm"], out["torch_norm"]),
        rel_err(out["fused_residual"], x + residual),
        rel_err(out["fused_q"], out["torch_q"]),
        rel_err(out["fused_k"], out["torch_k"]),
        rel_err(out["fused_silu"], out["torch_silu"]),
    )
    return row


def fused_section(res: dict, sizes: dict, device: torch.device, deadline: float, save, time_ms) -> None:
    res["fused"] = []
    for tokens in sizes["fused_tokens"]:
        row = {"tokens": tokens}
        if time.perf_counter() > deadline:
            row["skipped"] = "time budget"
        else:
            try:
                row = fused_case(tokens, sizes["model"], sizes["dtype"], device, time_ms)
                print(
                    f"  fused tokens {tokens:5d}: norm {row['norm_torch_us']:8.1f} -> "
                    f"{row['norm_fused_us']:8.1f} us ({row['norm_speedup']:.2f}x), rope "
                    f"{row['rope_torch_us']:8.1f} -> {row['rope_fused_us']:8.1f} us "
                    f"({row['rope_speedup']:.2f}x), silu {row['silu_torch_us']:8.1f} -> "
                    f"{row['silu_fused_us']:8.1f} us ({row['silu_speedup']:.2f}x), rel err "
                    f"{row['max_rel_err']:.1e}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - keep the benchmark's other sections
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["fused"].append(row)
        save()


def fused_markdown(res: dict) -> list[str]:
    if not res.get("fused"):
        return []
    lines = [
        "",
        "Fused kernels vs the model's torch code (per call, us, CUDA-graph replay, so launch "
        "overhead is excluded: the engine runs prefill eagerly, where fusing saves more; a "
        "layer runs 2 norms + 1 RoPE + 1 SiLU-and-mul; step saving = layer saving x layers):",
        "",
        "| tokens | norm torch | norm fused | speedup | RoPE torch | RoPE fused | speedup "
        "| SiLU*up torch | SiLU*up fused | speedup | step saving us | max rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["fused"]:
        if "norm_speedup" not in r:
            lines.append(f"| {r['tokens']} | {r.get('error') or r.get('skipped')} | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['tokens']} | {r['norm_torch_us']:.1f} | {r['norm_fused_us']:.1f} | "
            f"{r['norm_speedup']:.2f}x | {r['rope_torch_us']:.1f} | {r['rope_fused_us']:.1f} "
            f"| {r['rope_speedup']:.2f}x | {r['silu_torch_us']:.1f} | {r['silu_fused_us']:.1f} "
            f"| {r['silu_speedup']:.2f}x | {r['step_saving_us']:.0f} | {r['max_rel_err']:.1e} |"
        )
    return lines
