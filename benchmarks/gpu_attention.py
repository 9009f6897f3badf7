"""`make bench-gpu` section: decode attention, our Triton paged kernel vs SDPA, against the
measured memory bandwidth (benchmarks/gpu_bench.py's bandwidth section, which runs first).

Protocol: batch sizes 1-256 and contexts 512-32k (the model's 32 query / 8 kv heads, head_dim 64):
our Triton paged kernel over randomly permuted 16-token blocks, and
`F.scaled_dot_product_attention` on the same K/V laid out contiguously. Bandwidth = bytes of K and
V read / time. Headline: the paged kernel's share of the measured READ bandwidth (attention only
reads K/V, so that is its ceiling; the share of copy bandwidth is kept for comparison with older
runs). Each kernel is recorded in a CUDA graph and timed with `triton.testing.do_bench` (median, L2
flushed before every replay: benchmarks/gpu_common.py `time_ms`), so launch overhead is excluded on
both sides. The paged output is checked against SDPA's (max relative error).
Results: `res["attention"]` (one row per case, saved after each) and `res["summary"]` (contexts
>= LONG_CONTEXT). The markdown leads with the bandwidth figures, the table's denominators.
`attention_case` is also the sweep of benchmarks/gpu_tune.py.
"""

from __future__ import annotations

import functools
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_common import fmt, time_ms
from worker.config import ModelConfig

BLOCK_SIZE = 16
LONG_CONTEXT = 8192
TARGET_READ_FRACTION = 0.70  # of the measured read-only bandwidth, at contexts >= 8k


def attention_case(batch: int, context: int, cfg: ModelConfig, dtype, device) -> dict:
    from worker.kernels.triton_attention import paged_attention

    hkv, d = cfg.num_kv_heads, cfg.head_dim
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, cfg.num_heads, d, generator=gen, device=device, dtype=dtype)  # (B, H, D)
    out = torch.empty_like(q)
    scale = d**-0.5
    paged = functools.partial(
        paged_attention,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=1,
        max_seq_len=context,
        out=out,
    )
    paged_ms, paged_how = time_ms(paged, device)  # leaves the result in `out`
    kv_bytes = 2 * batch * context * hkv * d * q.element_size()
    row = {
        "batch_size": batch,
        "context_len": context,
        "kv_bytes": kv_bytes,
        "paged_us": paged_ms * 1e3,
        "paged_gbps": kv_bytes / paged_ms / 1e6,
        "timed_by": {"paged": paged_how},
    }
    del paged

    def contiguous(cache):  # (B, Hkv, L, D): one run per sequence
        return cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    try:
        # Each paged cache goes as soon as its contiguous copy exists: 256 x 32k is 8 GiB a copy.
        k = contiguous(k_cache)
        del k_cache
        v = contiguous(v_cache)
        del v_cache
        q4 = q[:, :, None, :]  # (B, H, 1, D)
        sdpa_out = torch.empty_like(q4)

        def sdpa():
            sdpa_out.copy_(F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))

        sdpa_ms, row["timed_by"]["sdpa"] = time_ms(sdpa, device)
    except Exception as exc:  # noqa: BLE001 - e.g. OOM in a fallback that repeats K/V per head,
        # or a torch without enable_gqa: the paged figures stand on their own
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    ref = sdpa_out[:, :, 0].float()
    row.update(
        sdpa_us=sdpa_ms * 1e3,
        sdpa_gbps=kv_bytes / sdpa_ms / 1e6,
        max_rel_err_vs_sdpa=float((out.float() - ref).abs().max() / ref.abs().max()),
    )
    return row


def attention_section(res: dict, sizes: dict, device: torch.device, deadline: float, save) -> None:
    read_gbps = res.get("read", {}).get("gbps")
    copy_gbps = res.get("copy", {}).get("gbps")
    res["attention"] = []
    for batch in sizes["attn_batch_sizes"]:
        for context in sizes["contexts"]:
            row = {"batch_size": batch, "context_len": context}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
            else:
                try:
                    row = attention_case(batch, context, sizes["model"], sizes["dtype"], device)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the other cases
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            res["attention"].append(row)
            if "paged_us" in row:
                if read_gbps:
                    row["read_fraction"] = row["paged_gbps"] / read_gbps
                    if "sdpa_gbps" in row:
                        row["sdpa_read_fraction"] = row["sdpa_gbps"] / read_gbps
                if copy_gbps:
                    row["copy_fraction"] = row["paged_gbps"] / copy_gbps
                print(
                    f"  attention batch {batch:4d} context {context:6d}: paged {row['paged_us']:9.1f} us "
                    f"{row['paged_gbps']:6.0f} GB/s ({fmt(row.get('read_fraction'), '4.0%')} of read, "
                    f"{fmt(row.get('copy_fraction'), '4.0%')} of copy); SDPA "
                    f"{fmt(row.get('sdpa_us'), '9.1f')} us {fmt(row.get('sdpa_gbps'), '6.0f')} GB/s; "
                    f"rel err {fmt(row.get('max_rel_err_vs_sdpa'), '.1e')}",
                    flush=True,
                )
            save()
    long_rows = [r for r in res["attention"] if r["context_len"] >= LONG_CONTEXT and "paged_us" in r]
    summary = {"long_context_cases": len(long_rows)}
    for key in ("read_fraction", "copy_fraction", "sdpa_read_fraction"):
        values = [r[key] for r in long_rows if key in r]
        if values:
            summary[f"long_context_{key}_min"], summary[f"long_context_{key}_max"] = min(values), max(values)
    reads = [r["read_fraction"] for r in long_rows if "read_fraction" in r]
    summary["long_context_target_met"] = sum(f >= TARGET_READ_FRACTION for f in reads)
    speedups = [r["sdpa_us"] / r["paged_us"] for r in long_rows if "sdpa_us" in r]
    if speedups:
        summary["long_context_sdpa_time_over_paged_min"] = min(speedups)
        summary["long_context_sdpa_time_over_paged_max"] = max(speedups)
    if long_rows:
        res["summary"] = summary


def attention_markdown(res: dict) -> list[str]:
    read, copy = res.get("read", {}), res.get("copy", {})
    lines = [
        f"Read-only bandwidth: **{fmt(read.get('gbps'), '.0f')} GB/s** (bytes read / time of a "
        f"{fmt(read.get('bytes', 0) / 2**30, '.2g')} GiB float32 reduction: torch sum "
        f"{fmt(read.get('torch_sum', {}).get('gbps'), '.0f')}, Triton read kernel "
        f"{fmt(read.get('triton_read', {}).get('gbps'), '.0f')} GB/s"
        f"{'; ' + read['error'] if 'error' in read else ''}). Device-to-device copy: "
        f"{fmt(copy.get('gbps'), '.0f')} GB/s (read + write). Decode attention, one query token per "
        f"sequence, {res['model']['num_heads']} query / {res['model']['num_kv_heads']} kv heads, "
        f"head_dim {res['model']['head_dim']}; GB/s = K/V bytes read / time:",
        "",
        "| batch | context | K/V MiB | paged us | paged GB/s | % of read BW | % of copy | SDPA us "
        "| SDPA GB/s | SDPA % of read | SDPA time / paged time | max rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.get("attention", []):
        if "paged_us" not in r:
            lines.append(
                f"| {r['batch_size']} | {r['context_len']} | "
                f"{r.get('error') or r.get('skipped')} | | | | | | | | | |"
            )
            continue
        speedup = r["sdpa_us"] / r["paged_us"] if "sdpa_us" in r else None
        lines.append(
            f"| {r['batch_size']} | {r['context_len']} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r['paged_us']:.1f} | {r['paged_gbps']:.0f} | {fmt(r.get('read_fraction'), '.0%')} | "
            f"{fmt(r.get('copy_fraction'), '.0%')} | {fmt(r.get('sdpa_us'), '.1f')} | "
            f"{fmt(r.get('sdpa_gbps'), '.0f')} | {fmt(r.get('sdpa_read_fraction'), '.0%')} | "
            f"{fmt(speedup, '.2f')}x | "
            f"{r.get('sdpa_error', fmt(r.get('max_rel_err_vs_sdpa'), '.1e'))[:80]} |"
        )
    s = res.get("summary")
    if s and "long_context_read_fraction_min" in s:
        lines += [
            "",
            f"**Long contexts (>= {LONG_CONTEXT}): paged attention reaches "
            f"{s['long_context_read_fraction_min']:.0%}-{s['long_context_read_fraction_max']:.0%} "
            f"of the measured read bandwidth** (target >= {TARGET_READ_FRACTION:.0%}: met in "
            f"{s['long_context_target_met']}/{s['long_context_cases']} cases); SDPA on contiguous K/V "
            f"{fmt(s.get('long_context_sdpa_read_fraction_min'), '.0%')}-"
            f"{fmt(s.get('long_context_sdpa_read_fraction_max'), '.0%')}; SDPA time / paged time "
            f"{fmt(s.get('long_context_sdpa_time_over_paged_min'), '.2f')}-"
            f"{fmt(s.get('long_context_sdpa_time_over_paged_max'), '.2f')}x.",
        ]
    return lines
