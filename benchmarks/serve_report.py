"""The report of `make bench-serve`: the "CPU serving vs llama.cpp" section of docs/benchmarks.md
and the per-point console line.

Contract
- `report_markdown(run, points)` -> the section's Markdown (a "## CPU serving vs llama.cpp"
  heading, the setup, a table of both sides per point with ratios ours / llama.cpp, the picture
  (docs/bench-serve.png, drawn by benchmarks/serve_plot.py beside the section), a shared
  machine caveat when other processes used > 0.5 cores, peak RSS, KV pool, the commands, the
  worker's start-up lines), machine-specific paths shortened (`shorten_paths`). `run` is the
  results JSON dict bench_serve.main writes; `points` are serve_points.Point.
- `table_rows(points)` -> one row of strings per point in `HEADER` order ("–" for a missing
  figure); `format_ratio(ours, theirs)` -> "ratio 1.23x" or "ratio n/a".
- `print_point(point, log, threads)`: the console summary of one point through `log`.
- Pure functions of their arguments: no state, no I/O but `log`.
- Tests: tests/test_bench_serve.py (test_report_table_shows_both_sides_and_ratios,
  test_saved_run_renders_the_same_section_with_the_busy_machine_caveat, test_ratio_is_ours_over_theirs).
"""

from __future__ import annotations

import pathlib

from benchmarks.report import REPO
from benchmarks.serve_points import WARMUP_REQUESTS, Point, ratio

SECTION = "CPU serving vs llama.cpp"


def format_ratio(ours: float | None, theirs: float | None) -> str:
    """`ratio 1.23x` = ours / theirs; "ratio n/a" when either is missing or theirs is 0."""
    value = ratio(ours, theirs)
    return "ratio n/a" if value is None else f"ratio {value:.2f}x"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def table_rows(points: list[Point]) -> list[list[str]]:
    rows = []
    for p in points:
        ours, theirs = p.sides.get("ours", {}), p.sides.get("llama.cpp", {})
        rows.append(
            [
                str(p.concurrency),
                _fmt(ours.get("output_tok_s")),
                _fmt(theirs.get("output_tok_s")),
                format_ratio(ours.get("output_tok_s"), theirs.get("output_tok_s")),
                _fmt(ours.get("tpot_p50_ms")),
                _fmt(theirs.get("tpot_p50_ms")),
                format_ratio(ours.get("tpot_p50_ms"), theirs.get("tpot_p50_ms")),
                _fmt(ours.get("ttft_p50_ms"), 0),
                _fmt(theirs.get("ttft_p50_ms"), 0),
                f"{ours.get('completed', 0)} / {theirs.get('completed', 0)}",
                f"{_fmt(other_cores(ours), 1)} / {_fmt(other_cores(theirs), 1)}",
            ]
        )
    return rows


HEADER = [
    "concurrency",
    "ours tok/s",
    "llama.cpp tok/s",
    "tok/s ours/theirs",
    "ours TPOT p50 ms",
    "llama.cpp TPOT p50 ms",
    "TPOT ours/theirs",
    "ours TTFT p50 ms",
    "llama.cpp TTFT p50 ms",
    "requests ours / llama.cpp",
    "other load, cores (ours / llama.cpp)",
]


def other_cores(numbers: dict) -> float | None:
    return (numbers.get("cpu") or {}).get("other_cores")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} MiB"


def report_markdown(run: dict, points: list[Point]) -> str:
    m, mem, kv = run["machine"], run["peak_rss_mib"], run.get("kv_pool")
    kv_text = (
        f"{kv['blocks']:,} blocks of 16 = {kv['tokens']:,} tokens, {kv['mib']:,} MiB"
        if kv
        else "not found in the worker's log"
    )
    lines = [
        f"## {SECTION}",
        "",
        f"`make bench-serve{' ARGS=--quick' if run['quick'] else ''}` on {run['date']}: "
        f"{m['cpu']}, {m['cores']} cores ({m['memory_gib']} GiB), load average before the run "
        f"{m['load_average'][0]:.2f}; commit `{run['commit']}`; model `{run['model_name']}`; "
        f"{run['threads']} threads each side; llama.cpp {run['llamacpp_version']} (llama-cpp-python "
        "sdist, Release, CPU only, GGML_NATIVE on, AMX off).",
        "",
        f"Closed loop, prompts of {run['input_len'].replace('uniform:', '').replace(':', '-')} tokens "
        f"(synthetic, seeded), {run['output_len']} output tokens (ignore_eos), greedy; each point "
        f"{run['duration_s']:g} s of sending per side after {WARMUP_REQUESTS} unmeasured short "
        "requests, the two servers "
        "taking turns (never at once, the first side alternating). Ratios are ours / llama.cpp: "
        'above 1 is better for tok/s, below 1 is better for TPOT. "Other load" is the CPU that '
        "every other process on the machine used during each side's measurement (/proc/stat less "
        "the side's servers and the load tester): this machine is shared with other jobs.",
        "",
    ]
    lines += markdown_table(HEADER, table_rows(points))
    lines += ["", "![ours vs llama.cpp per concurrency](bench-serve.png)"]
    others = [
        c
        for p in points
        for c in (other_cores(p.sides.get("ours", {})), other_cores(p.sides.get("llama.cpp", {})))
        if c is not None
    ]
    if others and max(others) > 0.5 and run["threads"] == 1:
        lines += [
            "",
            f"**The machine was shared** (other processes used {min(others):.1f}-"
            f"{max(others):.1f} of its {m['cores']} cores during the measurements), so absolute "
            "figures are low; with one thread each, neither side waits on a descheduled sibling "
            "thread.",
        ]
    elif others and max(others) > 0.5:
        lines += [
            "",
            f"**Caveat: the machine was shared** (other processes used {min(others):.1f}-"
            f"{max(others):.1f} of its {m['cores']} cores during the measurements). llama.cpp's "
            "threads meet at a spinning barrier after every op, so with threads = cores and other work "
            "on those cores a thread that is descheduled holds up the one spinning for it for a whole "
            "time slice; it slows down far more than our stack does. These figures say how each "
            "behaves on a busy machine, not how fast either is: rerun on an idle machine, or compare "
            'with `ARGS="--threads 1"`.',
        ]
    lines += [
        "",
        f"Peak RSS: our worker {_mib(mem.get('worker'))}, our router {_mib(mem.get('router'))}, "
        f"llama-server {_mib(mem.get('llama-server'))} (VmHWM / sampled VmRSS, max over points; "
        "llama-server's includes its memory-mapped GGUF). Our KV pool: "
        f"{kv_text} (the worker's default: a fraction of available RAM, allocated lazily).",
        "",
        "Commands:",
        "",
        "```",
    ]
    lines += [f"# ours: {c}" for c in run["commands"]["ours"]]
    lines += [f"# llama.cpp: {c}" for c in run["commands"]["llama.cpp"]]
    seen = set()
    for p in points:
        for side, cmd in p.commands.items():
            key = (side, cmd.split(" --seed")[0])
            if key not in seen:
                seen.add(key)
                lines.append(cmd)
    lines += ["```", ""]
    if run.get("worker_log"):
        lines += ["Our worker said at start-up:", "", "```", *run["worker_log"], "```", ""]
    lines += [
        "Our stack is `python -m worker` + `python -m router` as plain processes, every setting at its "
        "default but threads and ports. `make serve` (deploy/local.py) runs the same worker code with "
        "the same engine defaults as a Ray actor (one worker per two cores, each with its share of the "
        "cores as threads) and the router inside the Ray driver; plain processes are used here so the "
        "worker's memory, log and threads are its own and no Ray daemons share the two cores. "
        "The defaults include speculative decoding with n-gram drafts (CPU, at most 4 running "
        "sequences): the output this load forces past EOS (ignore_eos) often repeats itself, which "
        "drafts predict, so concurrency 1 gains more here than on natural prompts; the same load "
        "with drafts off, and natural prompts, are in docs/speculative.md.",
        f"Raw numbers: `{run['json']}` (not committed).",
        "",
    ]
    return shorten_paths("\n".join(lines))


def shorten_paths(text: str) -> str:
    """Machine-specific prefixes out of the docs: the repo root and the home directory."""
    return text.replace(str(REPO) + "/", "").replace(str(pathlib.Path.home()), "~")


def print_point(p: Point, log, threads: int) -> None:
    ours, theirs = p.sides.get("ours", {}), p.sides.get("llama.cpp", {})
    log(
        f"concurrency {p.concurrency}: output tok/s ours {_fmt(ours.get('output_tok_s'))} vs llama.cpp "
        f"{_fmt(theirs.get('output_tok_s'))} "
        f"{format_ratio(ours.get('output_tok_s'), theirs.get('output_tok_s'))}; "
        f"TPOT p50 {_fmt(ours.get('tpot_p50_ms'))} vs {_fmt(theirs.get('tpot_p50_ms'))} ms "
        f"{format_ratio(ours.get('tpot_p50_ms'), theirs.get('tpot_p50_ms'))}; "
        f"TTFT p50 {_fmt(ours.get('ttft_p50_ms'), 0)} vs {_fmt(theirs.get('ttft_p50_ms'), 0)} ms; "
        f"other processes used {_fmt(other_cores(ours))} / {_fmt(other_cores(theirs))} cores meanwhile"
    )
    busy = [c for c in (other_cores(ours), other_cores(theirs)) if c is not None]
    if busy and max(busy) > 0.5 and threads > 1:
        log(
            "  note: the machine was shared during this point; llama.cpp's spinning thread barriers "
            "slow down far more than our torch threads when its threads are descheduled"
        )
