"""The fused RMSNorm, RoPE, SiLU-and-mul, RoPE + store_kv and two-pass argmax Triton kernels against
the code they replace (a `make bench-gpu` part).

Issue 3 wants them wired into the model only "if they pay off in the GPU benchmark"; this is that
measurement. Per token count (decode batches and a prefill chunk), on the benchmark's model shape
and dtype:
- norm: torch `x + residual` then `RMSNorm` (what a decoder layer does between its blocks) vs
  `triton_norm.rms_norm(x, weight, eps, residual=residual)` (one kernel, returns both);
- rope: torch `RotaryEmbedding.apply` on q and k (the cos/sin gather is done once per step, outside
  the timing, as the model does) vs `triton_norm.rotary_embedding` (which gathers them itself);
- silu: torch `F.silu(gate) * up` on the [T, 2 x intermediate] gate|up output vs
  `triton_norm.silu_and_mul`;
- ropekv: the two launches the triton backend made per layer before (`rotary_embedding`, then
  `triton_store_kv.store_kv` of the rotated k and v into a paged cache) vs
  `triton_rope_kv.rope_store_kv` (one launch; q and both caches must be bit-identical);
- argmax: torch `logits.argmax(-1)` on [min(T, 256), vocab] model-dtype logits (what the sampler
  took for plain-greedy batches) vs `triton_argmax.argmax` (two passes; tokens must be equal).
Times come from `gpu_common.time_ms` (CUDA-graph replay, median); outputs are compared (max
relative error; `argmax_equal`). Speedup = old time / fused time; a layer runs two norms, one RoPE
and one SiLU-and-mul, so `layer_saving_us` = 2 x norm saving + rope saving + silu saving; a step
saves that and the RoPE + store saving (two launches -> one) per layer, and the argmax saving once:
`step_saving_us` = (layer_saving_us + ropekv saving) x layers + argmax saving.
"""

from __future__ import annotations

import time
import traceback

import torch

from worker.model.llama import RMSNorm, RotaryEmbedding


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def fused_case(tokens: int, cfg, dtype, device, time_ms) -> dict:
    from worker.kernels.triton_argmax import argmax
    from worker.kernels.triton_norm import rms_norm, rotary_embedding, silu_and_mul
    from worker.kernels.triton_rope_kv import rope_store_kv
    from worker.kernels.triton_store_kv import store_kv

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

    # RoPE + store_kv: k/v into a paged cache of 16-token blocks at shuffled slots, as decode writes.
    v = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, generator=gen, device=device, dtype=dtype)
    num_blocks = tokens // 16 + 2
    caches = {
        side: [
            torch.zeros(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype)
            for _ in "kv"
        ]
        for side in ("pair", "fused")
    }
    slots = torch.randperm(num_blocks * 16, generator=gen, device=device)[:tokens]

    def pair_ropekv():
        q_rot, k_rot = rotary_embedding(positions, q, k, rope.cos, rope.sin)
        store_kv(k_rot, v, *caches["pair"], slots)
        out["pair_q"] = q_rot

    def fused_ropekv():
        out["ropekv_q"] = rope_store_kv(positions, q, k, v, rope.cos, rope.sin, *caches["fused"], slots)

    rows = min(tokens, 256)
    logits = torch.randn(rows, cfg.vocab_size, generator=gen, device=device, dtype=dtype)

    def torch_argmax():
        out["torch_argmax"] = logits.argmax(dim=-1)

    def triton_argmax():
        out["triton_argmax"] = argmax(logits)

    cases = (
        ("norm_torch", torch_norm),
        ("norm_fused", fused_norm),
        ("rope_torch", torch_rope),
        ("rope_fused", fused_rope),
        ("silu_torch", torch_silu),
        ("silu_fused", fused_silu),
        ("ropekv_pair", pair_ropekv),
        ("ropekv_fused", fused_ropekv),
        ("argmax_torch", torch_argmax),
        ("argmax_triton", triton_argmax),
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
    row["ropekv_speedup"] = row["ropekv_pair_us"] / row["ropekv_fused_us"]
    row["argmax_rows"] = rows
    row["argmax_speedup"] = row["argmax_torch_us"] / row["argmax_triton_us"]
    row["argmax_equal"] = bool(torch.equal(out["triton_argmax"], out["torch_argmax"]))
    row["layer_saving_us"] = (
        2 * (row["norm_torch_us"] - row["norm_fused_us"])
        + row["rope_torch_us"]
        - row["rope_fused_us"]
        + row["silu_torch_us"]
        - row["silu_fused_us"]
    )
    row["step_saving_us"] = (
        row["layer_saving_us"] + row["ropekv_pair_us"] - row["ropekv_fused_us"]
    ) * cfg.num_layers + (row["argmax_torch_us"] - row["argmax_triton_us"])
    row["max_rel_err"] = max(
        rel_err(out["fused_norm"], out["torch_norm"]),
        rel_err(out["fused_residual"], x + residual),
        rel_err(out["fused_q"], out["torch_q"]),
        rel_err(out["fused_k"], out["torch_k"]),
        rel_err(out["fused_silu"], out["torch_silu"]),
        rel_err(out["ropekv_q"], out["pair_q"]),
        *(rel_err(a, b) for a, b in zip(caches["fused"], caches["pair"])),
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
                    f"{row['silu_fused_us']:8.1f} us ({row['silu_speedup']:.2f}x), rope+store "
                    f"{row['ropekv_pair_us']:8.1f} -> {row['ropekv_fused_us']:8.1f} us "
                    f"({row['ropekv_speedup']:.2f}x), argmax x{row['argmax_rows']} "
                    f"{row['argmax_torch_us']:8.1f} -> {row['argmax_triton_us']:8.1f} us "
                    f"({row['argmax_speedup']:.2f}x, equal {row['argmax_equal']}), rel err "
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
        "layer runs 2 norms + 1 RoPE + 1 SiLU-and-mul, and RoPE + store_kv as 2 Triton launches "
        "or 1; argmax over min(tokens, 256) rows of the vocabulary, torch vs two-pass Triton; "
        "step saving = (layer saving + RoPE+store saving) x layers + argmax saving):",
        "",
        "| tokens | norm torch | norm fused | speedup | RoPE torch | RoPE fused | speedup "
        "| SiLU*up torch | SiLU*up fused | speedup | RoPE+store 2 launches | RoPE+store fused | speedup "
        "| argmax rows | argmax torch | argmax 2-pass | speedup | argmax equal | step saving us "
        "| max rel err |",
        "|" + "---:|" * 17 + "---|---:|---:|",
    ]
    for r in res["fused"]:
        if "norm_speedup" not in r:
            lines.append(f"| {r['tokens']} | {r.get('error') or r.get('skipped')} |" + " |" * 18)
            continue
        lines.append(
            f"| {r['tokens']} | {r['norm_torch_us']:.1f} | {r['norm_fused_us']:.1f} | "
            f"{r['norm_speedup']:.2f}x | {r['rope_torch_us']:.1f} | {r['rope_fused_us']:.1f} "
            f"| {r['rope_speedup']:.2f}x | {r['silu_torch_us']:.1f} | {r['silu_fused_us']:.1f} "
            f"| {r['silu_speedup']:.2f}x | {r['ropekv_pair_us']:.1f} | {r['ropekv_fused_us']:.1f} "
            f"| {r['ropekv_speedup']:.2f}x | {r['argmax_rows']} | {r['argmax_torch_us']:.1f} "
            f"| {r['argmax_triton_us']:.1f} | {r['argmax_speedup']:.2f}x | {r['argmax_equal']} "
            f"| {r['step_saving_us']:.0f} | {r['max_rel_err']:.1e} |"
        )
    return lines
