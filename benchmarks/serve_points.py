"""One measured point of `make bench-serve`: a side started, warmed up, put under the seeded
closed-loop load of `python -m loadtest` (called in-process), and stopped; the figures that come out.

Contract
- `loadtest_argv(target, concurrency, seed, duration_s, input_len, output_len, out_dir,
  num_requests=None, timeout_s=REQUEST_TIMEOUT_S)` -> the loadtest command line (warm-up 0,
  no plots or progress; `--num-requests` instead of `--duration-s` when given).
- `run_load(argv)` -> (loadtest PointResult, server info) of one loadtest point.
- `point_numbers(summary)` -> output tok/s, TPOT/TTFT/e2e p50 in ms, completed/failed/errors,
  output tokens (server and client counts), mean output tokens, duration (s) from a loadtest
  point summary; `side_problem(numbers, want_output)` -> why it is not a valid measurement, or None.
- `Point(concurrency, seed, order)`: state = per side numbers, problems and loadtest commands;
  `ratios()` -> ours / llama.cpp output tok/s and TPOT p50 (`ratio`: None when either is missing,
  NaN or theirs is 0).
- `run_side_point(side, concurrency, seed, args, out_root, log)` -> (numbers + "cpu" from
  host_stats.CpuMeter, {process: peak RSS MiB}, loadtest command with address and dir replaced).
  The side is stopped whatever happens.
- failure modes: a side that does not start, fails its warm-up or whose load test raises ->
  `SideError(side, reason)` carrying its log tail; Ctrl-C passes through after the stop.
- Tests: tests/test_bench_serve.py (point numbers from a real loadtest summary, side problems,
  the loadtest command line, the ratios).
"""

from __future__ import annotations

import asyncio
import math
import pathlib
import shlex
import time
import uuid
from dataclasses import dataclass, field

from benchmarks.host_stats import CpuMeter

WARMUP_REQUESTS = 2  # per start: this many short requests, min(concurrency, 2) at a time
WARMUP_OUTPUT_LEN = 8
REQUEST_TIMEOUT_S = 900.0  # loadtest's per-request limit and drain time (its defaults: 300 / 120 s)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not theirs or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


def loadtest_argv(
    target: str,
    concurrency: int,
    seed: int,
    duration_s: float,
    input_len: str,
    output_len: int,
    out_dir: str,
    num_requests: int | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> list[str]:
    argv = [
        "--target",
        target,
        "--concurrency",
        str(concurrency),
        "--warmup-s",
        "0",
        "--input-len",
        input_len,
        "--output-len",
        str(output_len),
        "--seed",
        str(seed),
        "--request-timeout-s",
        f"{timeout_s:g}",
        "--drain-timeout-s",
        f"{timeout_s:g}",
        "--out-dir",
        out_dir,
        "--no-plots",
        "--no-progress",
    ]
    argv += ["--num-requests", str(num_requests)] if num_requests else ["--duration-s", f"{duration_s:g}"]
    return argv


def run_load(argv: list[str]):
    """One loadtest point: (PointResult, server info)."""
    from loadtest.cli import execute, parse_args

    config = parse_args(argv)
    results, infos = asyncio.run(execute(config, uuid.uuid4().hex[:8]))
    return results[0], infos


def point_numbers(summary: dict) -> dict:
    """The figures the comparison shows, from a loadtest point summary (seconds -> ms)."""

    def p50_ms(key):
        value = summary.get(key)
        return value["p50"] * 1e3 if value else None

    completed = summary.get("completed", 0)
    return {
        "output_tok_s": summary.get("output_token_throughput"),
        "tpot_p50_ms": p50_ms("tpot_s"),
        "ttft_p50_ms": p50_ms("ttft_s"),
        "e2e_p50_ms": p50_ms("e2e_s"),
        "completed": completed,
        "failed": summary.get("failed", 0),
        "errors": summary.get("errors", {}),
        "output_tokens": summary.get("output_tokens", 0),
        "client_output_tokens": summary.get("client_output_tokens", 0),
        "mean_output_tokens": summary.get("output_tokens", 0) / completed if completed else 0.0,
        "duration_s": summary.get("duration_s"),
    }


def side_problem(numbers: dict, want_output: int) -> str | None:
    """Why a side's point is not a valid measurement, or None."""
    if numbers["failed"]:
        return f"{numbers['failed']} request(s) failed: {numbers['errors']}"
    if not numbers["completed"]:
        return "no request completed"
    if not numbers["client_output_tokens"] or not numbers["output_tokens"]:
        return "no tokens streamed"
    if numbers["mean_output_tokens"] < want_output:
        return (
            f"outputs shorter than asked ({numbers['mean_output_tokens']:.1f} < {want_output} tokens "
            "on average: ignore_eos not honoured?)"
        )
    return None


@dataclass
class Point:
    concurrency: int
    seed: int
    order: list[str]
    sides: dict = field(default_factory=dict)  # side name -> numbers
    problems: dict = field(default_factory=dict)  # side name -> reason
    commands: dict = field(default_factory=dict)  # side name -> loadtest command

    def ratios(self) -> dict:
        ours, theirs = self.sides.get("ours", {}), self.sides.get("llama.cpp", {})
        return {
            "output_tok_s": ratio(ours.get("output_tok_s"), theirs.get("output_tok_s")),
            "tpot_p50": ratio(ours.get("tpot_p50_ms"), theirs.get("tpot_p50_ms")),
        }


def run_side_point(
    side, concurrency: int, seed: int, a, out_root: pathlib.Path, log
) -> tuple[dict, dict, str]:
    """Start one side, warm it up, measure one point, stop it: (numbers, peaks, command). The side
    is stopped whatever happens (SideError, Ctrl-C)."""
    started = time.monotonic()
    tag = "ours" if side.name == "ours" else "llamacpp"
    try:
        try:
            address = side.start()
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise SideError(side.name, f"did not start: {exc}") from None
        log(f"  {side.name}: ready at {address} in {time.monotonic() - started:.1f} s; warming up")
        target = side.target(address)
        try:
            warm, _ = run_load(
                loadtest_argv(
                    target,
                    min(concurrency, WARMUP_REQUESTS),
                    seed + 1000,
                    0,
                    a.input_len,
                    WARMUP_OUTPUT_LEN,
                    str(out_root / f"warmup-{tag}-c{concurrency}"),
                    num_requests=WARMUP_REQUESTS,
                    timeout_s=a.request_timeout_s,
                )
            )
            if not warm.summary.get("completed"):
                raise SideError(side.name, f"warm-up failed: {warm.summary.get('errors')}\n{side.log_tail()}")
            argv = loadtest_argv(
                target,
                concurrency,
                seed,
                a.duration_s,
                a.input_len,
                a.output_len,
                str(out_root / f"{tag}-c{concurrency}"),
                timeout_s=a.request_timeout_s,
            )
            log(f"  {side.name}: measuring concurrency {concurrency} for {a.duration_s:g} s (+ drain)")
            meter = CpuMeter(side.pids())
            result, _ = run_load(argv)
            cpu = meter.stop()
        except SideError:
            raise
        except Exception as exc:  # noqa: BLE001 - a load tester failure is this side's failure: report it
            raise SideError(
                side.name, f"load test failed: {type(exc).__name__}: {exc}\n{side.log_tail()}"
            ) from None
        peaks = side.stop()
    finally:
        side.stop()  # idempotent: a no-op after the stop above
    command = (
        shlex.join(["python", "-m", "loadtest", *argv])
        .replace(address, "<address>")
        .replace(str(out_root), "<dir>")
    )
    return {**point_numbers(result.summary), "cpu": cpu}, peaks, command


class SideError(RuntimeError):
    def __init__(self, side: str, reason: str):
        super().__init__(f"{side}: {reason}")
        self.side, self.reason = side, reason
