"""`make bench-serve`: our serving stack and llama.cpp's `llama-server` side by side on this
machine, the same GGUF, the same thread count, the same seeded workload, through our load tester.

Contract
- Builds (once, cached) llama.cpp's llama-server with `benchmarks.llamacpp_build.ensure_built`.
- Our stack: `python -m worker --port 0 --num-threads N` + `python -m router --port 0 --workers W
  --metrics-port 0` on 127.0.0.1, every other setting at its default (tests/procs.py's way: log
  files, "listening on" + grpc.health SERVING + the router seeing its worker, each under a
  deadline). `make serve` (deploy/local.py) runs the same worker code with the same engine
  defaults as a Ray actor and the router in the Ray driver; plain processes are used here so the
  worker's RSS, log and threads are its own and no Ray daemons share the cores.
- llama-server: `-m GGUF -t N -np P -c P*(max prompt + output + 16)` on 127.0.0.1, ready when
  `GET /health` answers 200 (deadline).
- The two servers never run at the same time: per point (closed loop, concurrency 1, 8, 32) each
  side is started, warmed up (2 short requests, not measured), measured, and stopped; the side
  that goes first alternates between points (ours first at the first point) so slow drift on a
  shared machine does not favour one side. Requests get `--request-timeout-s` (900 s) each and
  the last ones of a point as long to finish.
- Load: `python -m loadtest` (called in-process: `loadtest.cli.parse_args` + `execute`) with
  `--concurrency C --duration-s D --warmup-s 0 --input-len uniform:64:256 --output-len 128
  --seed S+i` (i = point index; ignore_eos and greedy are the load tester's defaults): our side
  over gRPC, llama-server over its OpenAI `/v1/completions` stream. Same seed, same requests.
- Output: per point output tok/s, TPOT p50, TTFT p50 of both, `ratio N.NNx` (ours / theirs) for
  output tok/s and TPOT p50; peak RSS of our worker, our router and llama-server (VmRSS sampled
  every 0.25 s and the kernel's VmHWM); our KV pool and start-up lines from the worker's log; the
  CPU every other process on the machine used during each measurement (/proc/stat less the side's
  processes and the load tester: the machine is shared). JSON to
  `results/bench_serve/<UTC time>.json` always; the "CPU serving vs llama.cpp" section of
  docs/benchmarks.md (other sections untouched) and its picture, docs/bench-serve.png (the
  README's; benchmarks/serve_plot.py), only for a run where both sides served every request of
  every point with our worker's defaults (`--worker-arg FLAG` adds a worker flag; such a run
  writes only its JSON).
- failure modes: a side that fails to start, errors or streams no tokens is named with the reason
  (and the log tail) and the exit status is 1; a failed llama.cpp build exits 1 with the reason.
  No traceback for these. Exit 2 for a bad command line.
- Pieces: the two sides as processes (benchmarks/serve_sides.py), one measured point and its
  figures (benchmarks/serve_points.py), the docs section (benchmarks/serve_report.py), machine,
  memory and CPU figures shared with benchmarks/eval_ppl.py (benchmarks/host_stats.py); the git
  revision and the docs section writer: benchmarks/report.py.
- Here: the command line (`parse_args`), llama-server's -c (`llama_ctx`), the run (`main`), and
  `render` (rewrite the docs section from a saved JSON). Tests: tests/test_bench_serve.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone

from benchmarks.host_stats import machine_info
from benchmarks.report import REPO, git_short, write_section
from benchmarks.serve_plot import PLOT, write_plot
from benchmarks.serve_points import REQUEST_TIMEOUT_S, Point, SideError, run_side_point, side_problem
from benchmarks.serve_report import SECTION, print_point, report_markdown
from benchmarks.serve_sides import LlamaSide, OurStack

DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "results" / "bench_serve"
CONCURRENCIES = (1, 8, 32)
INPUT_LEN = "uniform:64:256"
OUTPUT_LEN = 128
# Seconds of sending per measured point and side. 3 points x 2 sides, plus start-up (~15 s ours,
# ~3 s llama-server), warm-up and the drain of the last wave, keep the default run near 12 minutes
# on the 2-core machine here when it is otherwise idle (a busy machine makes it longer).
DURATION_S = 90.0
QUICK_DURATION_S = 10.0
QUICK_CONCURRENCIES = (1, 8, 32)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serve",
        description="our router + worker vs llama.cpp's llama-server, same GGUF, "
        "same threads, same seeded load (docs/benchmarks.md)",
    )
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument(
        "--threads", type=int, default=default_threads(), help="threads per side (default: all cores)"
    )
    p.add_argument("--concurrencies", default=None, help="comma-separated (default 1,8,32)")
    p.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help=f"seconds of sending per point and side (default {DURATION_S:g}; --quick {QUICK_DURATION_S:g})",
    )
    p.add_argument("--input-len", default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--seed", type=int, default=0, help="point i uses seed + i, the same on both sides")
    p.add_argument(
        "--parallel", type=int, default=None, help="llama-server -np (default: the largest concurrency)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_DURATION_S:g} s per point and side (~4 min on an idle machine)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="llama.cpp build cache (default $LLM_SERVE_LLAMACPP_DIR or ~/.cache/llm-serve/llama.cpp-0.3.36)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help="per request, and for the last requests of a point to finish",
    )
    p.add_argument(
        "--worker-arg",
        dest="worker_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="a further flag for our worker, e.g. --worker-arg=--stream-interval=4 (repeatable); a run "
        "with any leaves docs/benchmarks.md and the picture as they are (they show the defaults)",
    )
    p.add_argument("--no-docs", dest="docs", action="store_false", help="do not rewrite docs/benchmarks.md")
    p.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="only rewrite the docs section from a saved results/bench_serve/*.json",
    )
    a = p.parse_args(argv)
    if a.concurrencies is None:
        a.concurrencies = ",".join(map(str, QUICK_CONCURRENCIES if a.quick else CONCURRENCIES))
    try:
        a.concurrency_list = [int(c) for c in a.concurrencies.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrencies must be integers, got {a.concurrencies!r}")
    if not a.concurrency_list or min(a.concurrency_list) < 1:
        p.error("--concurrencies needs values >= 1")
    if a.duration_s is None:
        a.duration_s = QUICK_DURATION_S if a.quick else DURATION_S
    if a.duration_s <= 0 or a.threads < 1 or a.output_len < 1 or a.request_timeout_s <= 0:
        p.error("--duration-s, --threads, --output-len and --request-timeout-s must be > 0")
    a.parallel = a.parallel or max(a.concurrency_list)
    from loadtest.lengths import LengthDist

    try:
        dist = LengthDist.parse(a.input_len)
    except ValueError as exc:
        p.error(str(exc))
    a.max_input = int(
        dist.params[1]
        if dist.kind == "uniform"
        else max(dist.values)
        if dist.kind == "file"
        else dist.params[0] + 4 * dist.params[1]
        if dist.kind == "normal"
        else dist.params[0]
    )
    return a


def llama_ctx(parallel: int, max_input: int, output_len: int, slack: int = 16) -> int:
    """llama-server's -c: every slot holds its longest prompt and output (+ a little slack for a
    different tokenization); -c is split among the -np slots."""
    return parallel * (max_input + output_len + slack)


def points_from_json(run: dict) -> list[Point]:
    return [
        Point(p["concurrency"], p["seed"], p["order"], p["sides"], p["problems"], p["commands"])
        for p in run["points"]
    ]


def render(path: pathlib.Path, log) -> int:
    """Rewrites the docs section from a saved run (after a change to the report's wording)."""
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
        points = points_from_json(run)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log(f"bench-serve: cannot read {path}: {exc}")
        return 1
    if run.get("failure") or any(p.problems for p in points):
        log(f"bench-serve: {path} is from a failed run; docs left as they were")
        return 1
    if run.get("worker_args"):
        flags = shlex.join(run["worker_args"])
        log(f"bench-serve: {path} ran our worker with {flags}: docs left as they were")
        return 1
    write_section(DOCS, SECTION, report_markdown(run, points))
    log(f"wrote section '{SECTION}' of {DOCS} from {path}")
    draw(run, log)
    return 0


def draw(run: dict, log) -> None:
    """The README's picture of the run (benchmarks/serve_plot.py); skipped, said so, without matplotlib."""
    try:
        log(f"wrote {write_plot(run, PLOT)}")
    except ImportError as exc:
        log(f"bench-serve: picture skipped ({exc})")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if a.render:
        return render(pathlib.Path(a.render), log)
    from benchmarks.llamacpp_build import VERSION, BuildError, ensure_built
    from common.model_files import default_model_path, read_gguf_metadata

    model_path = pathlib.Path(a.model) if a.model else default_model_path()
    if not model_path.is_file():
        log(f"bench-serve: no model file {model_path}")
        return 1
    try:
        bins = ensure_built(a.cache_dir, log=log)
    except BuildError as exc:
        log(f"bench-serve: llama.cpp build failed: {exc}")
        return 1
    started = datetime.now(timezone.utc)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{stamp}.json"
    out_root = pathlib.Path(tempfile.mkdtemp(prefix="bench-serve-"))
    run = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "commit": git_short(),
        "command": shlex.join(
            ["python", "-m", "benchmarks.bench_serve", *(sys.argv[1:] if argv is None else argv)]
        ),
        "quick": a.quick,
        "model": str(model_path),
        "model_name": read_gguf_metadata(model_path).get("general.name", model_path.name),
        "threads": a.threads,
        "worker_args": a.worker_args,
        "concurrencies": a.concurrency_list,
        "duration_s": a.duration_s,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "seed": a.seed,
        "llamacpp_version": VERSION,
        "llamacpp_server": str(bins.server),
        "llama_server_np": a.parallel,
        "llama_server_ctx": llama_ctx(a.parallel, a.max_input, a.output_len),
        "json": str(json_path.relative_to(REPO)),
        "work_dir": str(out_root),
    }
    ours = OurStack(a.model, a.threads, out_root, a.worker_args)
    theirs = LlamaSide(bins.server, model_path, a.threads, a.parallel, run["llama_server_ctx"])
    run["commands"] = {"ours": ours.commands(), "llama.cpp": theirs.commands()}
    log(
        f"bench-serve: {run['model_name']} ({model_path.name}), {a.threads} threads, concurrencies "
        f"{a.concurrency_list}, {a.duration_s:g} s per point and side; logs in {out_root}"
    )
    points: list[Point] = []
    peaks: dict[str, float] = {}
    failure = ""
    try:
        for i, concurrency in enumerate(a.concurrency_list):
            order = [ours, theirs] if i % 2 == 0 else [theirs, ours]
            point = Point(concurrency, a.seed + i, [s.name for s in order])
            points.append(point)
            log(
                f"point {i + 1}/{len(a.concurrency_list)}: concurrency {concurrency} "
                f"({' then '.join(point.order)})"
            )
            for side in order:
                numbers, side_peaks, command = run_side_point(side, concurrency, point.seed, a, out_root, log)
                point.sides[side.name], point.commands[side.name] = numbers, command
                for k, v in side_peaks.items():
                    if v is not None:
                        peaks[k] = max(peaks.get(k, 0.0), v)
                problem = side_problem(numbers, a.output_len)
                if problem:
                    point.problems[side.name] = problem
                    log(f"  {side.name}: PROBLEM: {problem}")
            print_point(point, log, a.threads)
    except SideError as exc:
        failure = str(exc)
        log(f"bench-serve: {failure}")
    except KeyboardInterrupt:
        failure = "interrupted"
        log("bench-serve: interrupted; servers stopped")
    run["kv_pool"] = ours.kv_pool
    run["worker_log"] = ours.start_log
    run["peak_rss_mib"] = peaks
    run["points"] = [{**asdict(p), "ratios": p.ratios()} for p in points]
    run["failure"] = failure
    run["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    json_path.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    problems = [
        f"concurrency {p.concurrency}, {side}: {why}" for p in points for side, why in p.problems.items()
    ]
    complete = not failure and not problems and len(points) == len(a.concurrency_list)
    md = report_markdown(run, points)
    log("")
    log(md)
    log(f"wrote {json_path}")
    if complete and a.docs and a.worker_args:
        flags = shlex.join(a.worker_args)
        log(f"bench-serve: docs left as they were (worker flags {flags}: not the defaults)")
    elif complete and a.docs:
        write_section(DOCS, SECTION, md)
        log(f"wrote section '{SECTION}' of {DOCS}")
        draw(run, log)
    if not complete:
        for line in problems:
            log(f"bench-serve: {line}")
        log("bench-serve: FAILED (docs/benchmarks.md left as it was)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
