"""The picture of `make bench-serve`: our stack vs llama.cpp's `llama-server` per concurrency.

Contract
- `write_plot(run, path)` -> path: one PNG (matplotlib, Agg backend, imported here only) with
  three panels against the closed-loop concurrency: output tok/s (higher is better), TPOT p50 and
  TTFT p50 in ms (lower is better); one bar per side per point, the ratio ours / llama.cpp written
  over each pair; the title names the model file, the CPU, the threads and the date. `run` is the
  results JSON dict benchmarks.bench_serve writes (`machine`, `date`, `model` or `model_name`, `threads`,
  `points[*].concurrency` and `points[*].sides[side]` with `output_tok_s`, `tpot_p50_ms`,
  `ttft_p50_ms`). A missing figure draws no bar and "n/a" for its ratio.
- `python -m benchmarks.serve_plot RUN.json [--out PNG]`: redraws the picture from a saved run
  (default `docs/bench-serve.png`, the one the README shows); exit 1 with the reason for an
  unreadable run, 2 for a bad command line.
- failure modes: with matplotlib missing, `write_plot` raises ImportError (bench_serve reports the
  picture as skipped; the run's result stands).
- Tests: tests/test_bench_serve.py (test_plot_of_a_saved_run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from benchmarks.report import REPO
from benchmarks.serve_points import ratio

PLOT = REPO / "docs" / "bench-serve.png"
SIDES = (("ours", "llm-serve", "#1f77b4"), ("llama.cpp", "llama.cpp llama-server", "#ff7f0e"))
PANELS = (
    ("output_tok_s", "output tokens / s (higher is better)"),
    ("tpot_p50_ms", "TPOT p50, ms (lower is better)"),
    ("ttft_p50_ms", "TTFT p50, ms (lower is better)"),
)


def write_plot(run: dict, path: pathlib.Path = PLOT) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = run["points"]
    xs = range(len(points))
    width = 0.38
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 4.2))
    for ax, (key, title) in zip(axes, PANELS):
        tops = []
        for offset, (side, label, color) in zip((-width / 2, width / 2), SIDES):
            values = [p["sides"].get(side, {}).get(key) for p in points]
            shown = [(x + offset, v) for x, v in zip(xs, values) if v is not None]
            if shown:
                ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=label, color=color)
            tops.append(values)
        for x, (ours, theirs) in zip(xs, zip(*tops)):
            value = ratio(ours, theirs)
            height = max(v for v in (ours, theirs, 0.0) if v is not None)
            ax.annotate(
                "n/a" if value is None else f"{value:.2f}x",
                (x, height),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=9,
            )
        ax.set_xticks(list(xs), [str(p["concurrency"]) for p in points])
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=9)
    m = run["machine"]
    model = pathlib.Path(run["model"]).name if run.get("model") else run["model_name"]
    fig.suptitle(
        f"{model}, the same file on both sides: {m['cpu']}, {run['threads']} threads each, "
        f"{run['date']} (ratio = ours / llama.cpp)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Redraw the bench-serve picture from a saved run.")
    p.add_argument("run", help="results/bench_serve/<time>.json")
    p.add_argument("--out", default=str(PLOT), help=f"PNG to write (default {PLOT.relative_to(REPO)})")
    a = p.parse_args(argv)
    try:
        run = json.loads(pathlib.Path(a.run).read_text(encoding="utf-8"))
        path = write_plot(run, pathlib.Path(a.out))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"serve_plot: cannot draw {a.run}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
