"""The two sides `make bench-serve` compares, each started and stopped as whole processes: our
stack (`python -m worker` + `python -m router`) and llama.cpp's llama-server.

Contract
- `ServiceProcess(name, args, log_dir)`: `python <args>` from the repo root (PYTHONPATH = repo),
  stdout+stderr to `log_dir/<name>.log`, own session; `wait_listening(deadline)` -> "HOST:PORT"
  from its "listening on" line; `stop()` SIGTERM, then SIGKILL after 30 s -> exit status.
- `wait_serving(address, proc, deadline)`: grpc.health.v1 Check until SERVING;
  `wait_router_sees_worker(...)`: ListModels until a model has >= 1 worker.
- `OurStack(model, threads, log_dir, worker_extra=(), router_extra=())` / `LlamaSide(binary, model, threads,
  parallel, ctx)`, the
  same duck type: `name`, `commands()` -> the command lines for the report, `start(timeout_s)` ->
  address, `target(address)` -> a loadtest `--target`, `pids()`, `stop()` -> {process: peak RSS
  MiB} (idempotent), `log_tail()`. OurStack also keeps `kv_pool` (`parse_kv_pool`) and
  `start_log` (`worker_log_lines`) from the worker's start-up log.
- `OurHttpSide(model, threads, log_dir, worker_extra=())` / `LlamaHttpSide(model, threads,
  parallel, ctx_size, extra=())`: the same two over HTTP for the OpenAI-API benchmarks (bench-tools,
  bench-spec, bench-embed): `commands`, `start()` -> base URL, `stop()`, `log_tail()`; and
  `run_rounds(makers, rounds, measure, res)`, their rounds with the order reversed every other one.
- `parse_kv_pool(log_text)` -> {"blocks", "tokens", "mib"} from the model runner's
  "N KV blocks (T tokens, M MiB)" line, or None.
- failure modes: a process that exits before it is ready -> RuntimeError with its log tail; one
  not ready by the deadline -> TimeoutError with its log tail (benchmarks/serve_points.py turns
  both into a SideError).
- Tests: tests/test_bench_serve.py (test_kv_pool_is_read_from_the_model_runner_line); the
  processes themselves only run in `make bench-serve`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

from benchmarks.host_stats import RssSampler
from benchmarks.report import REPO
from common.process import terminate

START_TIMEOUT_S = 300.0
LISTENING = re.compile(r"listening on (\S+)")
KV_POOL = re.compile(r"(\d+) KV blocks \((\d+) tokens, (\d+) MiB\)")
WORKER_LOG = re.compile(r"(loaded in|compiled in|KV blocks|dtype|quantiz|C\+\+ op)", re.IGNORECASE)


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
        terminate(self.popen, timeout_s)
        self._log.close()
        return self.popen.returncode


def _poll(address: str, proc: ServiceProcess, deadline: float, probe, what: str) -> None:
    """Call probe(channel) every 0.1 s (another process's endpoint: polled) until it returns None
    (ready); it returns why not yet. Fails at once if `proc` exited, else at `deadline`."""
    import grpc

    last = ""
    with grpc.insecure_channel(address) as channel:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                last = probe(channel)
                if last is None:
                    return
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)
    raise TimeoutError(f"{proc.name} at {address} {what} in time ({last}):\n{proc.log_tail()}")


def wait_serving(address: str, proc: ServiceProcess, deadline: float) -> None:
    """grpc.health.v1 Check until SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def probe(channel):
        status = (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
        )
        return None if status == health_pb2.HealthCheckResponse.SERVING else "not SERVING"

    _poll(address, proc, deadline, probe, "not SERVING")


def wait_router_sees_worker(address: str, proc: ServiceProcess, deadline: float) -> None:
    """ListModels until a model has at least one worker."""
    from protos.llm.v1 import generation_pb2 as pb
    from protos.llm.v1 import generation_pb2_grpc

    def probe(channel):
        models = (
            generation_pb2_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=2.0).models
        )
        return None if models and models[0].num_workers >= 1 else "no worker yet"

    _poll(address, proc, deadline, probe, "saw no worker")


def parse_kv_pool(log_text: str) -> dict | None:
    """The worker's KV pool from its model runner's start-up line
    "... N KV blocks (T tokens, M MiB) ..."."""
    found = KV_POOL.search(log_text)
    if not found:
        return None
    return {"blocks": int(found.group(1)), "tokens": int(found.group(2)), "mib": int(found.group(3))}


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


class OurStack:
    """One worker and one router, default settings but threads and ports."""

    name = "ours"

    def __init__(
        self,
        model: str | None,
        threads: int,
        log_dir: pathlib.Path,
        worker_extra: tuple[str, ...] = (),
        router_extra: tuple[str, ...] = (),
    ):
        self.model, self.threads, self.log_dir = model, threads, log_dir
        self.worker_extra = tuple(worker_extra)  # further `python -m worker` flags (bench-serve --worker-arg)
        self.router_extra = tuple(
            router_extra
        )  # further `python -m router` flags (bench-tools: its HTTP port)
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
            *self.worker_extra,
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
            *self.router_extra,
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

    def http_url(self, timeout_s: float = 30.0) -> str:
        """The router's OpenAI HTTP base URL (started with `--http-port 0`), once it listens."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the router prints the address once uvicorn listens
            match = re.search(r"OpenAI-compatible HTTP API at (\S+)", self.router.log_text())
            if match:
                return match.group(1).rstrip("/").removesuffix("/v1")
            time.sleep(0.1)  # a log file of another process: no event to wait on
        raise RuntimeError("the router announced no HTTP address:\n" + self.log_tail())

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


class OurHttpSide:
    """Our worker + router (default flags, `worker_extra` added) reached over the router's
    OpenAI-compatible HTTP API on an ephemeral port: a side of the HTTP benchmarks (bench-tools,
    bench-spec, bench-embed). `start()` -> the base URL."""

    name = "ours"

    def __init__(self, model, threads: int, log_dir: pathlib.Path, worker_extra: tuple[str, ...] = ()):
        http = ("--http-port", "0")
        self.stack = OurStack(
            str(model) if model else None, threads, log_dir, worker_extra=worker_extra, router_extra=http
        )
        self.commands = self.stack.commands()

    def start(self) -> str:
        self.stack.start()
        return self.stack.http_url()

    def stop(self) -> None:
        self.stack.stop()

    def log_tail(self) -> str:
        return self.stack.log_tail()


class LlamaHttpSide:
    """llama.cpp's llama-server (built once: benchmarks/llamacpp.py), the peer side of the HTTP
    benchmarks. `start()` -> the base URL."""

    name = "llama.cpp"

    def __init__(
        self, model: pathlib.Path, threads: int, parallel: int, ctx_size: int, extra: tuple[str, ...] = ()
    ):
        from benchmarks.llamacpp import LlamaServer, ensure_built

        self.server = LlamaServer(
            ensure_built().server, model, threads, parallel=parallel, ctx_size=ctx_size, extra=extra
        )
        self.commands = [" ".join(self.server.command(port=0)).replace("--port 0", "--port <free port>")]

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def log_tail(self) -> str:
        return self.server.log_tail()


def run_rounds(makers: dict, rounds: int, measure, res: dict) -> None:
    """Each side of `makers` (name -> a callable that makes it) once per round, the order reversed
    in odd rounds (drift on a shared machine falls on every side alike); `measure(name, side,
    round)` runs a made side (its start and stop included). A side that fails is recorded in
    `res["errors"]` with its log tail and the others still run; `res["commands"]` gets each side's
    command lines."""
    order = list(makers)
    for rnd in range(rounds):
        for name in order if rnd % 2 == 0 else order[::-1]:
            side = None
            try:
                side = makers[name]()
                res["commands"][name] = side.commands
                measure(name, side, rnd)
            except Exception as exc:  # noqa: BLE001 - one side failing must not cost the others
                tail = side.log_tail() if side is not None else ""
                res["errors"].setdefault(name, []).append(f"{type(exc).__name__}: {exc}\n{tail}"[:3000])
                print(f"{name} failed: {exc}", flush=True)
