"""PNG plots of a run (matplotlib, Agg backend; imported only when plots are written).

Contract
- input: the run's `PointResult`s (target, label, records, summary) and an output directory.
- output: the paths written: `latency_cdf.png` (empirical CDFs of TTFT, ITL, TPOT and E2E, one
  line per target and point), `sweep.png` when a target has several points (TTFT and TPOT p50/p99
  against output token throughput), `tenant_service.png` when there are several tenants
  (cumulative weighted service per tenant over time, one panel per point, at most 6).
- failure modes: none of its own; with matplotlib missing, `write_plots` raises ImportError and
  the caller reports that plots were skipped.
"""

from __future__ import annotations

import pathlib

LATENCIES = (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))
MAX_SERVICE_PANELS = 6


def _values(records, key: str) -> list[float]:
    ok = [r for r in records if r.ok and not r.warmup]
    if key == "itl_s":
        return [gap for r in ok for gap in r.itl_s]
    return [v for v in (getattr(r, key) for r in ok) if v is not None]


def _latency_cdf(plt, points, path: pathlib.Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, key) in zip(axes.flat, LATENCIES):
        for p in points:
            values = sorted(v * 1e3 for v in _values(p.records, key))
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    label=f"{p.target} {p.label}",
                )
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Latency CDFs (client-side)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep(plt, points, path: pathlib.Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for target in dict.fromkeys(p.target for p in points):
        mine = [p for p in points if p.target == target and p.summary.get("completed")]
        x = [p.summary["output_token_throughput"] for p in mine]
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                y = [p.summary[key][q] * 1e3 if p.summary.get(key) else float("nan") for p in mine]
                ax.plot(x, y, style, label=f"{target} {q}")
                for xi, yi, p in zip(x, y, mine):
                    ax.annotate(
                        p.label.split("=")[-1],
                        (xi, yi),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
    for ax, name in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs throughput across the sweep")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tenant_service(plt, points, path: pathlib.Path) -> None:
    shown = points[:MAX_SERVICE_PANELS]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.8), squeeze=False)
    for ax, p in zip(axes[0], shown):
        timeline = p.summary["fairness"]["timeline"]
        for tenant, series in timeline["service"].items():
            ax.plot(timeline["t_s"], series, label=tenant)
        ax.set_title(f"{p.target} {p.label}", fontsize=9)
        ax.set_xlabel("s since first measured request")
        ax.set_ylabel("(input + 2 × output tokens) / weight")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Per-tenant service over time (cumulative)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(points, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = [out_dir / "latency_cdf.png"]
    _latency_cdf(plt, points, written[0])
    targets = [p.target for p in points]
    if any(targets.count(t) > 1 for t in set(targets)):
        written.append(out_dir / "sweep.png")
        _sweep(plt, points, written[-1])
    with_tenants = [p for p in points if len(p.summary.get("tenants", {})) > 1]
    if with_tenants:
        written.append(out_dir / "tenant_service.png")
        _tenant_service(plt, with_tenants, written[-1])
    return written
