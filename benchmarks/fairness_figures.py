"""Figures of `make bench-fairness` (benchmarks/fairness.py): what one run of one mode at one load
level shows about the fair queue, and the verdict.

Contract
- input: a load-test point (`loadtest.sweep.PointResult`: records with send / first-token / chunk
  times on the run's clock) of one router, the tenants (weights, offered rates), the measured
  window [warmup_s, warmup_s + duration_s], the bound's K (one worker's KV capacity in tokens).
- output: `fairness_figures` -> a JSON-able dict: per tenant the usual figures; the share of the
  window in which the two heavy tenants (a, b) were both backlogged; their service in that time,
  its ratio against the weights, the largest swing of the weighted service difference within a
  stretch of continuous backlog next to the bound 2U of docs/fairness.md section 3; `verdict`
  -> None when the VTC run shows the weights honoured within the tolerance, else the reason.
  `markdown` and `plot` render a whole run (every level, both modes).
- "backlogged": a tenant is backlogged in a 0.5 s cell when at every 0.1 s sample in it one of
  its requests was sent and had no first token yet (waiting in the router's queue, or for at most
  one engine step in the worker's prefill). Refused requests (RESOURCE_EXHAUSTED) wait for nothing.
- service = input tokens (at the first token) + 2 x output tokens (as they arrive), measured at the
  client, as the VTC counts it; weighted service divides by the weight.
- failure modes: none raised for thin data: a run with no backlog gets fraction 0 and a verdict
  saying so; the plot draws every series against its own time axis.
- proven by: tests/test_bench_fairness.py (synthetic records).
"""

from __future__ import annotations

import math

from loadtest.record import NS_PER_S
from loadtest.summary import OUTPUT_WEIGHT

CELL_S = 0.5
SAMPLE_S = 0.1
HEAVY = ("a", "b")


def fair_shares(demand: dict[str, float], weights: dict[str, float], total: float) -> dict[str, float]:
    """Weighted max-min fair split of `total` service over tenants offering `demand` (water-filling)."""
    share = {name: 0.0 for name in demand}
    active = {n for n in demand if demand[n] > 0}
    left = total
    while active and left > 1e-9:
        level = left / sum(weights[n] for n in active)
        capped = {n for n in active if demand[n] - share[n] <= level * weights[n]}
        if not capped:
            for n in active:
                share[n] += level * weights[n]
            break
        for n in capped:
            left -= demand[n] - share[n]
            share[n] = demand[n]
        active -= capped
    return share


def waiting_intervals(records, tenant: str) -> list[tuple[int, int]]:
    """[sent, first token) of each of the tenant's requests (the end of a call that got none)."""
    out = []
    for r in records:
        if r.tenant != tenant or not r.sent_ns or r.status == "RESOURCE_EXHAUSTED":
            continue
        end = r.chunk_ns[0] if r.chunk_ns else r.end_ns
        if end > r.sent_ns:
            out.append((r.sent_ns, end))
    return out


def backlogged_cells(records, tenant: str, start_s: float, num_cells: int) -> list[bool]:
    """Per cell of CELL_S from `start_s`: did the tenant have a request waiting at every sample?"""
    intervals = waiting_intervals(records, tenant)
    per_cell = round(CELL_S / SAMPLE_S)
    cells = []
    for c in range(num_cells):
        ok = True
        for k in range(per_cell):
            t_ns = (start_s + c * CELL_S + (k + 0.5) * SAMPLE_S) * NS_PER_S
            if not any(a <= t_ns < b for a, b in intervals):
                ok = False
                break
        cells.append(ok)
    return cells


def service_cells(records, tenant: str, start_s: float, num_cells: int) -> tuple[list[float], list[int]]:
    """Raw service (input + 2 x output tokens) and output tokens per cell, at the client."""
    service, tokens = [0.0] * num_cells, [0] * num_cells

    def cell(t_ns: int) -> int | None:
        i = math.floor((t_ns / NS_PER_S - start_s) / CELL_S)
        return i if 0 <= i < num_cells else None

    for r in records:
        if r.tenant != tenant or not r.chunk_ns:
            continue
        if (i := cell(r.chunk_ns[0])) is not None:
            service[i] += r.input_tokens
        for t_ns, n in zip(r.chunk_ns, r.chunk_tokens):
            if (i := cell(t_ns)) is not None:
                service[i] += OUTPUT_WEIGHT * n
                tokens[i] += n
    return service, tokens


def fairness_figures(
    point, tenants, rates: dict[str, float], warmup_s: float, duration_s: float, capacity_tokens: int
) -> dict:
    """The figures of one mode at one level (see the module docstring)."""
    weights = {t.name: t.weight for t in tenants}
    num_cells = max(1, int(duration_s / CELL_S))
    records = point.records
    backlog = {n: backlogged_cells(records, n, warmup_s, num_cells) for n in weights}
    served = {n: service_cells(records, n, warmup_s, num_cells) for n in weights}
    both = [all(backlog[n][i] for n in HEAVY) for i in range(num_cells)]
    in_backlog = {n: sum(s for s, b in zip(served[n][0], both) if b) for n in HEAVY}
    tokens_in_backlog = {n: sum(s for s, b in zip(served[n][1], both) if b) for n in HEAVY}
    a, b = HEAVY
    weighted = {n: in_backlog[n] / weights[n] for n in HEAVY}
    ratio = weighted[b] / weighted[a] if weighted[a] > 0 else None
    # the weighted difference W_a - W_b within each stretch of continuous backlog, and its swing
    swing, gap_t, gap = 0.0, [], []
    lo = hi = acc = 0.0
    for i, is_backlogged in enumerate(both):
        if not is_backlogged:
            lo = hi = acc = 0.0
            continue
        acc += served[a][0][i] / weights[a] - served[b][0][i] / weights[b]
        lo, hi = min(lo, acc), max(hi, acc)
        swing = max(swing, hi - lo)
        gap_t.append(warmup_s + (i + 1) * CELL_S)
        gap.append(acc)
    max_cost = max(t.max_cost / t.weight for t in tenants)
    bound_u = max_cost + 2 * capacity_tokens / min(weights.values())
    summary = point.summary
    per_tenant = {}
    for t in tenants:
        s = summary["tenants"].get(t.name, {})
        ttfts = sorted(r.ttft_s for r in records if r.tenant == t.name and not r.warmup and r.ttft_s)
        per_tenant[t.name] = {
            "weight": t.weight,
            "offered_per_s": rates[t.name],
            "completed": s.get("completed", 0),
            "refused": s.get("errors", {}).get("RESOURCE_EXHAUSTED", 0),
            "other_failures": s.get("failed", 0) - s.get("errors", {}).get("RESOURCE_EXHAUSTED", 0),
            "output_tokens": sum(served[t.name][1]),
            "output_tokens_per_s": sum(served[t.name][1]) / duration_s,
            "weighted_service": sum(served[t.name][0]) / t.weight,
            "backlogged_fraction": sum(backlog[t.name]) / num_cells,
            # medians and maxima: a p99 over the few requests of a light tenant would be its maximum
            "ttft_n": len(ttfts),
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
            "ttft_max_s": ttfts[-1] if ttfts else None,
        }
    return {
        "mode": point.target,
        "tenants": per_tenant,
        "both_backlogged_fraction": sum(both) / num_cells,
        "backlogged_service": in_backlog,
        "backlogged_output_tokens": tokens_in_backlog,
        "expected_ratio": weights[b] / weights[a],
        "service_ratio_b_a": None if ratio is None else ratio * weights[b] / weights[a],
        "weighted_ratio": ratio,
        "max_window_difference": swing,
        "bound_u": bound_u,
        "bound_window": 2 * bound_u,
        "capacity_tokens": capacity_tokens,
        "gap_series": {"t_s": gap_t, "gap": gap},
    }


def verdict(f: dict, tolerance: float, min_backlogged: float) -> str | None:
    """None when the run shows VTC's weights honoured; else why not (for the exit message)."""
    frac = f["both_backlogged_fraction"]
    if frac < min_backlogged:
        return (
            f"{f['mode']}: a and b were both backlogged in only {frac:.0%} of the measured time (need "
            f"{min_backlogged:.0%}): the run cannot show the weights; raise --loads or --duration-s"
        )
    ratio = f["weighted_ratio"]
    if ratio is None or abs(ratio - 1) > tolerance:
        got = "no service" if ratio is None else f"b / a service {f['service_ratio_b_a']:.2f}"
        return (
            f"{f['mode']}: weights not honoured while backlogged: {got}, expected "
            f"{f['expected_ratio']:.2f} within {tolerance:.0%}"
        )
    if f["max_window_difference"] > f["bound_window"]:
        return (
            f"{f['mode']}: weighted service difference swung {f['max_window_difference']:.0f} within a "
            f"backlogged stretch, over the bound 2U = {f['bound_window']:.0f} (docs/fairness.md section 3)"
        )
    return None


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(levels: list[dict]) -> str:
    """levels: [{"load": L, "rates": {...}, "figures": [vtc, fcfs]}]."""
    lines = [
        "## Fairness: VTC vs FCFS",
        "",
        "| load | mode | tenant | weight | offered req/s | ok | refused | out tok/s | backlogged | "
        "TTFT p50 / max ms (n) | service / weight |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        for f in level["figures"]:
            for name, t in f["tenants"].items():
                p50 = None if t["ttft_p50_s"] is None else t["ttft_p50_s"] * 1e3
                worst = None if t["ttft_max_s"] is None else t["ttft_max_s"] * 1e3
                lines.append(
                    f"| {level['load']:g}× | {f['mode']} | {name} | {t['weight']:g} | "
                    f"{t['offered_per_s']:.2f} | {t['completed']} | {t['refused']} | "
                    f"{t['output_tokens_per_s']:.1f} | {t['backlogged_fraction']:.0%} | "
                    f"{_fmt(p50, 0)} / {_fmt(worst, 0)} ({t['ttft_n']}) | {t['weighted_service']:.0f} |"
                )
    lines += [
        "",
        "| load | mode | a and b backlogged | b / a service while backlogged (weights "
        "2 : 1 → 2.00) | largest swing of W_a − W_b | bound 2U |",
        "|---|---|---|---|---|---|",
    ]
    for level in levels:
        for f in level["figures"]:
            lines.append(
                f"| {level['load']:g}× | {f['mode']} | {f['both_backlogged_fraction']:.0%} | "
                f"{_fmt(f['service_ratio_b_a'], 2)} | {f['max_window_difference']:.0f} | "
                f"{f['bound_window']:.0f} |"
            )
    for level in levels:
        p50 = {f["mode"]: f["tenants"].get("c", {}).get("ttft_p50_s") for f in level["figures"]}
        if p50.get("vtc") and p50.get("fcfs"):
            lines.append(
                f"\nLight tenant c at {level['load']:g}×: TTFT p50 {p50['vtc'] * 1e3:.0f} ms with VTC, "
                f"{p50['fcfs'] * 1e3:.0f} ms with FCFS ({p50['fcfs'] / p50['vtc']:.1f}×)."
            )
    k = levels[0]["figures"][0]["capacity_tokens"] if levels else 0
    lines += [
        "",
        "Load: offered load of a and b together as a multiple of the measured capacity (a sends 2× "
        "b's requests); c sends a little. Backlogged: a request waiting for its first token at every "
        "0.1 s sample of a 0.5 s cell. Service = input + 2 × output tokens, at the client; the ratio "
        "counts only the cells in which a and b were both backlogged. The bound is docs/fairness.md "
        f"§3 with K = {k} tokens (one worker's KV capacity).",
        "",
        "![fairness](fairness.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(levels: list[dict], points: list[list], path) -> None:
    """Per level and mode: cumulative weighted service, W_a − W_b while backlogged, TTFTs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(level, f, p) for level, pts in zip(levels, points) for f, p in zip(level["figures"], pts)]
    fig, axes = plt.subplots(3, len(columns), figsize=(5 * len(columns), 10), squeeze=False)
    for col, (level, f, point) in enumerate(columns):
        title = f"{f['mode']}, load {level['load']:g}×"
        timeline = point.summary.get("fairness", {}).get("timeline")
        ax = axes[0][col]
        if timeline:
            for name, series in timeline["service"].items():
                xs = timeline["t_s"][: len(series)]
                weight = f["tenants"].get(name, {}).get("weight")
                ax.plot(xs, series[: len(xs)], label=name if weight is None else f"{name} (w {weight:g})")
            ax.legend(fontsize=8)
        ax.set_title(f"{title}: service / weight")
        ax = axes[1][col]
        gap = f["gap_series"]
        if gap["t_s"]:
            ax.plot(gap["t_s"], gap["gap"], ".", color="black", markersize=3)
        ax.axhline(f["bound_window"], color="red", linestyle="--", label="2U")
        ax.axhline(-f["bound_window"], color="red", linestyle="--")
        ax.set_title(f"{title}: W_a − W_b while backlogged")
        ax.legend(fontsize=8)
        ax = axes[2][col]
        for name in f["tenants"]:
            ok = [r for r in point.records if r.tenant == name and not r.warmup and r.ttft_s is not None]
            ax.scatter([r.sent_ns / 1e9 for r in ok], [r.ttft_s * 1e3 for r in ok], s=6, label=name)
        if any(len(c.get_offsets()) for c in ax.collections):
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_title(f"{title}: TTFT (ms) by send time (s)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
