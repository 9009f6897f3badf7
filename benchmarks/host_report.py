"""`make bench-host`'s report (benchmarks/host_overhead.py measures): the least-squares slope of
step time over batch size, the markdown table, the headline and the docs section of
docs/benchmarks.md. Input: the result dict host_overhead.main builds ("rows": one dict per
(sampling mode, batch size) with step_ms, step_wall_ms, step_wall_p90_ms and, except the async
rows, `<phase>_ms` for each of PHASES and graph_inputs_ms; per-mode summaries under "greedy",
"greedy_async", "sampled", "sampled_fused"; "args", "date", "machine", "cpus", "load_before",
"git", "command"). Pure formatting, no torch.
"""

from __future__ import annotations

SECTION = "## Host overhead per engine step"
PHASES = ["schedule", "prepare", "model_stub", "sample", "update", "other"]


def slope_us(rows: list[dict]) -> float:
    """Least-squares slope of step time (ms) over batch size, in microseconds per sequence."""
    xs = [r["batch_size"] for r in rows]
    ys = [r["step_ms"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1e3 if var else 0.0


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| sampling | batch | step ms (CPU) | step ms (wall, median / p90) | us per sequence "
        "| schedule | prepare | model stub | sample | update | other | graph-path inputs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "greedy" if r["temperature"] == 0 else f"T={r['temperature']}, top-p 0.95"
        if r.get("fused"):
            kind += ", fused path (stub kernel)"
        if r.get("async"):
            kind += ", async scheduling (process CPU, 2 threads)"
        lines.append(
            f"| {kind} | {r['batch_size']} | {r['step_ms']:.3f} | {r['step_wall_ms']:.3f} / "
            f"{r['step_wall_p90_ms']:.3f} | {r['step_ms'] / r['batch_size'] * 1e3:.1f} | "
            + " | ".join(f"{r[f'{k}_ms']:.3f}" if f"{k}_ms" in r else "-" for k in PHASES + ["graph_inputs"])
            + " |"
        )
    return lines


def headline(res: dict) -> str:
    g, sampled, fused, overlap = (
        res["greedy"],
        res.get("sampled"),
        res.get("sampled_fused"),
        res.get("greedy_async"),
    )
    line = (
        f"**Greedy: B={g['batch_size']} step {g['step_ms']:.2f} ms, {g['per_sequence_us']:.1f} us per "
        f"added sequence** (least-squares slope of step time over B = "
        f"{', '.join(str(b) for b in res['args']['batch_sizes'])})"
    )
    if overlap:
        line += (
            f"; greedy with async scheduling (process CPU time, both threads): B={overlap['batch_size']} "
            f"step {overlap['step_ms']:.2f} ms, {overlap['per_sequence_us']:.1f} us per added sequence"
        )
    if sampled:
        line += (
            f"; sampled (temperature {res['args']['temperature']}, top-p 0.95): B={sampled['batch_size']} "
            f"step {sampled['step_ms']:.2f} ms, {sampled['per_sequence_us']:.1f} us per added sequence"
        )
    if fused:
        line += (
            f"; the same through the GPU's fused sampling path (stub kernel): B={fused['batch_size']} "
            f"step {fused['step_ms']:.2f} ms, {fused['per_sequence_us']:.1f} us per added sequence"
        )
    return line + "."


def docs_section(res: dict) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {res['date']} on {res['machine']} ({res['cpus']} CPUs visible, one torch thread, "
        f"other jobs sharing the machine; load average {res['load_before']} before the run), "
        f"git {res['git']}. Command: `{res['command']}`.",
        "",
        "What it measures: the host (CPU) time of one engine step when the model costs nothing: the "
        "real scheduler, block manager (prefix caching on), the model runner's input preparation, "
        "the sampler and the scheduler's update/output bookkeeping, with a stub model that returns "
        f"zeros (vocabulary {res['args']['vocab_size']}). Every measured step is a decode step of B "
        f"sequences with contexts drawn uniformly from {res['args']['context'][0]}-"
        f"{res['args']['context'][1]} tokens. Step time: the median over {res['args']['steps']} steps "
        "of the engine thread's CPU time (`time.thread_time`, one torch thread), which the other jobs "
        "on this shared machine do not inflate the way they do wall-clock time (also shown: when "
        "descheduled, a step waits in 4 ms scheduler ticks). The phases (ms, thread CPU time) come from "
        f"a second, instrumented pass of {res['args']['breakdown_steps']} steps; they are medians, so "
        'they need not add up to the step exactly. "graph-path inputs" is `InputBatch.build` + '
        "`graph_rows`, which replaces `prepare` for decode steps replayed as CUDA graphs on a GPU, "
        "timed on the same plans and not included in the step. The async-scheduling rows time "
        "`engine.step()` of the overlap path (plan N+1 and commit N on the engine thread, the launch "
        "on the executor thread) in process CPU time, both threads together.",
        "",
        *table(res["rows"]),
        "",
        headline(res),
        "",
    ]
    return "\n".join(lines)
