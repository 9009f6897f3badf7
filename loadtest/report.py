"""Writes a run's report: `report.json` (everything needed to repeat and recompute it) and
`report.md` (the tables a person reads).

Contract
- input: the report dict built by `cli` — "created", "config" (with the seed), "git", "machine",
  "targets" (server info per target), "points" (per target and sweep point: "summary" from
  `loadtest.summary`, "all_requests" counts, "server_counters").
- output: `write_json(report, points, dir)` (`report.json` + `requests.jsonl`, one line per
  request with its target and point) and `write_markdown(report, dir, plot_files)` return the
  paths written. Markdown: one header with the run's identity, a summary table per point (mean, p50,
  p90, p95, p99, max of TTFT, ITL, TPOT, E2E in ms), throughput, goodput, errors by status, a
  per-tenant table with Jain's index, a sweep table when there are several points, and a side-by-
  side table with ratios (second / first) when there are two targets.
- `markdown_point(point)` is exposed for other tools (and docs) to reuse.
"""

from __future__ import annotations

import json
import pathlib

LATENCIES = (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s"))
QUANTILES = ("mean", "p50", "p90", "p95", "p99", "max")
COMPARED = (
    ("requests/s", "request_throughput", None),
    ("output tok/s", "output_token_throughput", None),
    ("TTFT p50 ms", "ttft_s", "p50"),
    ("TTFT p99 ms", "ttft_s", "p99"),
    ("ITL p50 ms", "itl_s", "p50"),
    ("TPOT p50 ms", "tpot_s", "p50"),
    ("TPOT p99 ms", "tpot_s", "p99"),
    ("E2E p50 ms", "e2e_s", "p50"),
    ("E2E p99 ms", "e2e_s", "p99"),
)


def write_json(report: dict, points, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """`report.json` (indented) and `requests.jsonl`: one line per request, every point."""
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    requests = out_dir / "requests.jsonl"
    with open(requests, "w", encoding="utf-8") as f:
        for point in points:
            for record in point.records:
                f.write(json.dumps({"target": point.target, "point": point.label, **record.to_json()}) + "\n")
    return [path, requests]


def _ms(summary: dict | None, key: str) -> str:
    return "–" if not summary else f"{summary[key] * 1e3:.1f}"


def _metric(summary: dict, key: str, quantile: str | None) -> float | None:
    if quantile is None:
        return summary.get(key)
    value = summary.get(key)
    return None if not value else value[quantile] * 1e3


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown_point(point: dict, slo: dict) -> list[str]:
    s = point["summary"]
    if not s.get("num_requests"):
        return ["No measured requests."]
    lines = [
        f"{s['completed']} completed, {s['failed']} failed in {s['duration_s']:.1f} s: "
        f"**{s['request_throughput']:.2f} req/s**, **{s['output_token_throughput']:.1f} output tok/s** "
        f"(peak {s['peak_output_token_throughput']:.0f} in a 1-s bucket), "
        f"{s['total_token_throughput']:.1f} total tok/s, peak {s['peak_in_flight']} in flight."
    ]
    if "goodput" in s:
        bounds = ", ".join(f"{k} ≤ {v * 1e3:g} ms" for k, v in slo.items())
        lines.append(
            f"Goodput ({bounds}): **{s['goodput']['requests_per_s']:.2f} req/s** "
            f"({s['goodput']['fraction']:.0%} of requests)."
        )
    lines += [""] + _table(
        ["ms", *QUANTILES], [[name, *(_ms(s[key], q) for q in QUANTILES)] for name, key in LATENCIES]
    )
    errors = ", ".join(f"{k} × {v}" for k, v in sorted(s["errors"].items())) or "none"
    lines += ["", f"Errors by status: {errors}."]
    lines.append(
        f"Tokens: {s['input_tokens']} in, {s['output_tokens']} out (server usage for "
        f"{s['num_with_server_usage']} requests: {s['server_prompt_tokens']} prompt, "
        f"{s['server_cached_prompt_tokens']} of them cached, "
        f"{s['server_completion_tokens']} completion; "
        f"token ids the client received: {s['client_output_tokens']})."
    )
    waits = [
        f"{name} p50 {_ms(s[key], 'p50')} ms, p99 {_ms(s[key], 'p99')} ms"
        for name, key in (("server queue", "server_queue_s"), ("client wait", "client_wait_s"))
        if s[key]
    ]
    if waits:
        lines.append("Queueing: " + "; ".join(waits) + ".")
    counters = point.get("server_counters")
    if counters:
        sent = point["all_requests"]
        lines.append(
            "Server counters (Prometheus, after − before): "
            + (
                counters["error"]
                if "error" in counters
                else ", ".join(f"`{k}` {v:.0f}" for k, v in sorted(counters.items()))
            )
            + f"; the client sent {sent['sent']} requests ({sent['ok']} OK, warm-up included), "
            f"usage {sent['server_prompt_tokens']} prompt + {sent['server_completion_tokens']} "
            "completion tokens."
        )
    tenants = s.get("tenants", {})
    if len(tenants) > 1:
        rows = [
            [
                name,
                f"{t['weight']:g}",
                str(t["completed"]),
                str(t["failed"]),
                f"{t['request_throughput']:.2f}",
                f"{t['output_token_throughput']:.1f}",
                _ms(t["ttft_s"], "p50"),
                _ms(t["ttft_s"], "p99"),
                _ms(t["tpot_s"], "p50"),
                _ms(t["e2e_s"], "p50"),
                f"{t['weighted_service']:.0f}",
            ]
            for name, t in tenants.items()
        ]
        lines += [""] + _table(
            [
                "tenant",
                "weight",
                "ok",
                "failed",
                "req/s",
                "out tok/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "E2E p50 ms",
                "service / weight",
            ],
            rows,
        )
        fair = s["fairness"]
        jain = "–" if fair["jain_index"] is None else f"{fair['jain_index']:.3f}"
        lines += [
            "",
            f"Jain's fairness index over tenants' weighted service (input + 2 × output tokens): "
            f"**{jain}**; largest gap between tenants over time: {fair['max_service_gap']:.0f}.",
        ]
    return lines


def _sweep_table(points: list[dict]) -> list[str]:
    rows = []
    for p in points:
        s = p["summary"]
        if not s.get("num_requests"):
            continue
        good = f"{s['goodput']['requests_per_s']:.2f}" if "goodput" in s else "–"
        rows.append(
            [
                p["target"],
                p["label"],
                f"{s['request_throughput']:.2f}",
                f"{s['output_token_throughput']:.1f}",
                _ms(s["ttft_s"], "p50"),
                _ms(s["ttft_s"], "p99"),
                _ms(s["tpot_s"], "p50"),
                _ms(s["tpot_s"], "p99"),
                _ms(s["e2e_s"], "p50"),
                good,
                str(s["failed"]),
            ]
        )
    return _table(
        [
            "target",
            "point",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "E2E p50",
            "goodput req/s",
            "failed",
        ],
        rows,
    )


def comparison_rows(first: dict, second: dict) -> list[list[str]]:
    rows = []
    for name, key, quantile in COMPARED:
        a, b = _metric(first, key, quantile), _metric(second, key, quantile)
        ratio = f"{b / a:.2f}×" if a and b is not None else "–"
        rows.append([name, _fmt(a), _fmt(b), ratio])
    return rows


def write_markdown(report: dict, out_dir: pathlib.Path, plot_files: list[pathlib.Path]) -> pathlib.Path:
    config, git, mach = report["config"], report["git"], report["machine"]
    slo = config["slo_s"]
    bound = (
        f"{config['duration_s']:g} s"
        if config["duration_s"] is not None
        else f"{config['num_requests']} requests"
    )
    lines = [
        f"# Load test report, {report['created']}",
        "",
        f"- git `{git['commit'][:12]}`{' (uncommitted changes)' if git.get('dirty') else ''}, "
        f"seed {config['seed']}, {bound} per point after {config['warmup_s']:g} s warm-up",
        f"- machine: {mach['cpu']}, {mach['logical_cores']} logical cores"
        f"{', ' + '; '.join(mach['gpus']) if mach['gpus'] else ''}, load average "
        f"{', '.join(f'{x:.1f}' for x in mach['load_average'] or [])} at start",
    ]
    for name, info in report["targets"].items():
        models = ", ".join(f"{m['id']}" for m in info.get("server_info", {}).get("models", [])) or "?"
        lines.append(f"- target **{name}**: {info['api']} `{info['address']}`, model {models}")
    for t in config["tenants"]:
        shape = f" (shape {t['burstiness']:g})" if t["arrival"] == "gamma" else ""
        load = (
            f"closed loop × {t['concurrency']}"
            if t["arrival"] == "closed"
            else f"{t['arrival']} {t['rate_per_s']:g} req/s{shape}"
        )
        prompts = (
            f"synthetic {t['input_len']} tokens" if t["prompts"] == "synthetic" else f"prompts {t['prompts']}"
        )
        prefix = f" + shared prefix {t['shared_prefix_len']}" if t["shared_prefix_len"] else ""
        lines.append(
            f"- tenant **{t['name']}** (weight {t['weight']:g}): {load}, {prompts}{prefix}, "
            f"output {t['output_len']} tokens"
        )
    lines.append(f"- command: `{' '.join(report['command'])}`")
    lines.append(
        "- measured on the client (docs/metrics.md): TTFT = first token-carrying chunk − request sent; "
        "ITL = every gap between chunks, pooled; TPOT = (E2E − TTFT) / (output tokens − 1); "
        "E2E = last message − request sent"
    )
    for point in report["points"]:
        lines += ["", f"## {point['target']}: {point['label']}", ""] + markdown_point(point, slo)
    if len(report["points"]) > len(report["targets"]):
        lines += ["", "## Sweep", ""] + _sweep_table(report["points"])
    names = list(report["targets"])
    if len(names) == 2:
        by_key = {(p["target"], p["label"]): p["summary"] for p in report["points"]}
        lines += ["", f"## Comparison: {names[1]} / {names[0]}"]
        for label in dict.fromkeys(p["label"] for p in report["points"]):
            first, second = by_key.get((names[0], label)), by_key.get((names[1], label))
            if first and second and first.get("num_requests") and second.get("num_requests"):
                lines += ["", f"{label}:", ""] + _table(
                    ["metric", names[0], names[1], "ratio"], comparison_rows(first, second)
                )
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plot_files]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
