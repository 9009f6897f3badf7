"""`make bench-serve`: our serving stack and llama.cpp's `llama-server` side by side on this
machine, the same GGUF, the same thread count, the same seeded workload, through our load tester.

Contract
- Builds (once, cached) llama.cpp's llama-server with `benchmarks.llamacpp.ensure_built`.
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
  docs/benchmarks.md (other sections untouched) only for a run where both sides served every
  request of every point.
- failure modes: a side that fails to start, errors or streams no tokens is named with the reason
  (and the log tail) and the exit status is 1; a failed llama.cpp build exits 1 with the reason.
  No traceback for these. Exit 2 for a bad command line.
- Helpers shared with benchmarks/eval_ppl.py: `machine_info`, `format_ratio` (the git revision and
  the docs section: benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from benchmarks.report import git_short, write_section

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "results" / "bench_serve"
SECTION = "CPU serving vs llama.cpp"
CONCURRENCIES = (1, 8, 32)
INPUT_LEN = "uniform:64:256"
OUTPUT_LEN = 128
# Seconds of sending per measured point and side. 3 points x 2 sides, plus start-up (~15 s ours,
# ~3 s llama-server), warm-up and the drain of the last wave, keep the default run near 12 minutes
# on the 2-core machine here when it is otherwise idle (a busy machine makes it longer).
DURATION_S = 90.0
QUICK_DURATION_S = 10.0
QUICK_CONCURRENCIES = (1, 8, 32)
WARMUP_REQUESTS = 2  # per start: this many short requests, min(concurrency, 2) at a time
WARMUP_OUTPUT_LEN = 8
REQUEST_TIMEOUT_S = 900.0  # loadtest's per-request limit and drain time (its defaults: 300 / 120 s)
START_TIMEOUT_S = 300.0
LISTENING = re.compile(r"listening on (\S+)")
KV_POOL = re.compile(r"(\d+) KV blocks \((\d+) tokens, (\d+) MiB\)")


# ---------------------------------------------------------------- shared helpers (eval_ppl too)


def _run(args: list[str], timeout_s: float = 10.0) -> str:
    try:
        return subprocess.run(
            args, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    """CPU model name and core count as `lscpu` reports them (with /proc and os fallbacks)."""
    fields = {}
    for line in _run(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = fields.get("Model name", "")
    if not model:
        try:
            model = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in open("/proc/cpuinfo")
                    if line.startswith("model name")
                ),
                "",
            )
        except OSError:
            model = ""
    cores = int(fields["CPU(s)"]) if fields.get("CPU(s)", "").isdigit() else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    return {
        "cpu": model or "unknown",
        "cores": cores,
        "memory_gib": round(mem_gib, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def format_ratio(ours: float | None, theirs: float | None) -> str:
    """`ratio 1.23x` = ours / theirs; "ratio n/a" when either is missing or theirs is 0."""
    value = ratio(ours, theirs)
    return "ratio n/a" if value is None else f"ratio {value:.2f}x"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not theirs or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


# ---------------------------------------------------------------- processes and memory


def read_status_kib(pid: int, key: str) -> int | None:
    """A "kB" field of /proc/PID/status (VmRSS, VmHWM), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass  # unreadable /proc entry (process gone, not Linux): no figure
    return None


class RssSampler:
    """Peak resident memory of one process: VmRSS sampled on a thread, and VmHWM (the kernel's own
    high-water mark) read at `stop()`; the peak is the larger."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid, self.interval_s = pid, interval_s
        self.max_kib = 0
        self.hwm_kib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            kib = read_status_kib(self.pid, "VmRSS")
            if kib is not None:
                self.max_kib = max(self.max_kib, kib)
            self._stop.wait(self.interval_s)  # the sampling period, not a synchronization

    def stop(self) -> float | None:
        """Peak RSS in MiB (call while the process is still alive for VmHWM)."""
        self.hwm_kib = read_status_kib(self.pid, "VmHWM")
        self._stop.set()
        self._thread.join(5)
        peak = max(self.max_kib, self.hwm_kib or 0)
        return peak / 1024 if peak else None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies over all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal, sum(values[:8])


class CpuMeter:
    """How busy the machine was while a side was measured, and how much of that was the side:
    `stop()` -> {"busy_cores", "side_cores", "other_cores", "steal_cores"} averaged over the
    interval (other = busy - the side's processes - this process, i.e. the load tester)."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.wall = time.monotonic()
        self.ticks = machine_cpu_ticks()
        self.side = sum(proc_cpu_s(pid) or 0.0 for pid in pids)
        self.own = time.process_time()

    def stop(self) -> dict:
        wall = max(1e-9, time.monotonic() - self.wall)
        side = (sum(proc_cpu_s(pid) or 0.0 for pid in self.pids) - self.side) / wall
        own = (time.process_time() - self.own) / wall
        ticks = machine_cpu_ticks()
        if self.ticks is None or ticks is None or ticks[2] == self.ticks[2]:
            return {"side_cores": round(side, 2), "client_cores": round(own, 2)}
        cores = os.cpu_count() or 1
        span = ticks[2] - self.ticks[2]
        busy = (ticks[0] - self.ticks[0]) / span * cores
        return {
            "busy_cores": round(busy, 2),
            "side_cores": round(side, 2),
            "client_cores": round(own, 2),
            "other_cores": round(max(0.0, busy - side - own), 2),
            "steal_cores": round((ticks[1] - self.ticks[1]) / span * cores, 2),
        }


class ServiceProcess:
    """`python <args>` from the repo root, output to a log file; `wait_listening` reads the
    address from its "listening on HOST:PORT" line (tests/procs.py's way)."""

    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.args = [sys.executable, *args]
        self.popen = subprocess.Popen(
            self.args,
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.address = ""

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_text()[-num_chars:]

    def wait_listening(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log_text())
            if found:
                self.address = found.group(1)
                return self.address
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode} before listening:\n{self.log_tail()}"
                )
            time.sleep(0.1)  # polling another process's log file: no event to wait on
        raise TimeoutError(f"{self.name} did not start listening in time:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def wait_serving(address: str, proc: ServiceProcess, deadline: float) -> None:
    """grpc.health.v1 Check until SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    last = ""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
                last = "not SERVING"
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)  # polling a health endpoint of another process
    raise TimeoutError(f"{proc.name} at {address} not SERVING in time ({last}):\n{proc.log_tail()}")


def wait_router_sees_worker(address: str, proc: ServiceProcess, deadline: float) -> None:
    import grpc

    from protos.llm.v1 import generation_pb2 as pb
    from protos.llm.v1 import generation_pb2_grpc

    last = ""
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                models = stub.ListModels(pb.ListModelsRequest(), timeout=2.0).models
                if models and models[0].num_workers >= 1:
                    return
                last = "no worker yet"
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)  # polling the router's view of its workers
    raise TimeoutError(f"router at {address} saw no worker in time ({last}):\n{proc.log_tail()}")


def parse_kv_pool(log_text: str) -> dict | None:
    """The worker's KV pool from its model runner's start-up line
    "... N KV blocks (T tokens, M MiB) ..."."""
    found = KV_POOL.search(log_text)
    if not found:
        return None
    return {"blocks": int(found.group(1)), "tokens": int(found.group(2)), "mib": int(found.group(3))}


class OurStack:
    """One worker and one router, default settings but threads and ports."""

    name = "ours"

    def __init__(self, model: str | None, threads: int, log_dir: pathlib.Path):
        self.model, self.threads, self.log_dir = model, threads, log_dir
        self.worker: ServiceProcess | None = None
        self.router: ServiceProcess | None = None
        self.rss: dict[str, RssSampler] = {}
        self.kv_pool: dict | None = None
        self.start_log: list[str] = []

    def worker_args(self) -> list[str]:
        return [
            "-m",
            "worker",
            "--port",
            "0",
            "--num-threads",
            str(self.threads),
            *(["--model", self.model] if self.model else []),
        ]

    def router_args(self, worker_address: str) -> list[str]:
        return [
            "-m",
            "router",
            "--port",
            "0",
            "--workers",
            worker_address,
            "--metrics-port",
            "0",
            *(["--model", self.model] if self.model else []),
        ]

    def commands(self) -> list[str]:
        return [
            shlex.join(["python", *self.worker_args()]),
            shlex.join(["python", *self.router_args("WORKER_ADDRESS")]),
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        self.worker = ServiceProcess("worker", self.worker_args(), self.log_dir)
        self.rss["worker"] = RssSampler(self.worker.popen.pid)
        worker_address = self.worker.wait_listening(deadline)
        wait_serving(worker_address, self.worker, deadline)
        self.kv_pool = parse_kv_pool(self.worker.log_text())
        self.start_log = worker_log_lines(self.worker.log_text())
        self.router = ServiceProcess("router", self.router_args(worker_address), self.log_dir)
        self.rss["router"] = RssSampler(self.router.popen.pid)
        address = self.router.wait_listening(deadline)
        wait_serving(address, self.router, deadline)
        wait_router_sees_worker(address, self.router, deadline)
        return address

    def target(self, address: str) -> str:
        return f"ours={address}"

    def pids(self) -> list[int]:
        return [p.popen.pid for p in (self.worker, self.router) if p is not None]

    def stop(self) -> dict:
        peaks = {name: sampler.stop() for name, sampler in self.rss.items()}
        for proc in (self.router, self.worker):  # router first: it drains
            if proc is not None:
                proc.stop()
        return peaks

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name} log ---\n{p.log_tail(2000)}" for p in (self.worker, self.router) if p)


class LlamaSide:
    name = "llama.cpp"

    def __init__(self, binary: pathlib.Path, model: pathlib.Path, threads: int, parallel: int, ctx: int):
        from benchmarks.llamacpp import LlamaServer

        self.server = LlamaServer(binary, model, threads, parallel, ctx)
        self.rss: RssSampler | None = None

    def commands(self) -> list[str]:
        return [shlex.join(self.server.command(port=0)).replace("--port 0", "--port <free port>")]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        self.server.port = 0
        try:
            url = self.server.start(timeout_s)
        finally:
            if self.server.popen is not None:
                self.rss = RssSampler(self.server.popen.pid)
        return url

    def target(self, address: str) -> str:
        return f"llamacpp={address}"

    def pids(self) -> list[int]:
        return [self.server.popen.pid] if self.server.popen is not None else []

    def stop(self) -> dict:
        peak = self.rss.stop() if self.rss else None
        self.server.stop()
        return {"llama-server": peak}

    def log_tail(self) -> str:
        return f"--- llama-server log ---\n{self.server.log_tail(2000)}"


# ---------------------------------------------------------------- load


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


# ---------------------------------------------------------------- report


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
        "worker's memory, log and threads are its own and no Ray daemons share the two cores.",
        f"Raw numbers: `{run['json']}` (not committed).",
        "",
    ]
    return shorten_paths("\n".join(lines))


def shorten_paths(text: str) -> str:
    """Machine-specific prefixes out of the docs: the repo root and the home directory."""
    return text.replace(str(REPO) + "/", "").replace(str(pathlib.Path.home()), "~")


WORKER_LOG = re.compile(r"(loaded in|compiled in|KV blocks|dtype|quantiz)", re.IGNORECASE)


def worker_log_lines(log_text: str, limit: int = 6) -> list[str]:
    """The worker's start-up lines that say what it runs (model load, KV pool, compile, dtype),
    without their timestamps."""
    out = []
    for line in log_text.splitlines():
        if "listening on" in line:
            break
        if WORKER_LOG.search(line):
            out.append(re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ ", "", line.strip()))
    return out[:limit]


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


# ---------------------------------------------------------------- main


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
    write_section(DOCS, SECTION, report_markdown(run, points))
    log(f"wrote section '{SECTION}' of {DOCS} from {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if a.render:
        return render(pathlib.Path(a.render), log)
    from benchmarks.llamacpp import VERSION, BuildError, ensure_built
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
    ours = OurStack(a.model, a.threads, out_root)
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
    if complete and a.docs:
        write_section(DOCS, SECTION, md)
        log(f"wrote section '{SECTION}' of {DOCS}")
    if not complete:
        for line in problems:
            log(f"bench-serve: {line}")
        log("bench-serve: FAILED (docs/benchmarks.md left as it was)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
