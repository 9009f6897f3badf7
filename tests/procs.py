"""Real worker and router processes on 127.0.0.1 for end-to-end tests.

Each process binds port 0 and prints its address ("... listening on HOST:PORT"); `ready` reads it
from the process's log (kept under pytest's tmp dir), then waits for grpc.health.v1 SERVING.
`stop` terminates, then kills; `stop_all` stops several side by side. Helpers that call a server
take `credentials` (common.tls) for one that serves TLS; None = plaintext.

Sharing: modules that need only "a normal worker" take tests/conftest.py's `plain_worker` (one
worker process for the whole session, `start_shared_worker`) and start their own router (each
module's router has its own tenants and limits); the fixture checks after each module that the
worker is alive, idle, and has every KV block back. Modules whose tests kill, hang, drain or
restart workers, or need other engine flags (TLS, sequence limits, KV sizes), start their own.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.net import free_port  # noqa: F401 - re-exported for the tests
from common.process import terminate
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+)")
# KV budget for tests: 68 blocks of 16 tokens with SmolLM2-135M float32 (1,088-token context).
TEST_KV_CACHE_MB = 48
START_TIMEOUT_S = 180.0


def metrics_url(proc: "Proc") -> str:
    """The /metrics URL a router or worker announced in its log ("metrics at http(s)://...")."""
    found = re.search(r"metrics at (https?://\S+/metrics)", proc.log_path.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{proc.name} announced no metrics endpoint:\n{proc.log_tail()}")
    return found.group(1)


def metrics_address(proc: "Proc") -> str:
    """host:port of the /metrics endpoint a process announced."""
    return metrics_url(proc).split("://", 1)[1].removesuffix("/metrics")


def worker_metrics_address(address: str) -> str:
    """host:port of a worker's /metrics, as it reports it in WorkerInfo (which must name one)."""
    with grpc.insecure_channel(address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.metrics_address, f"worker {address} reports no /metrics address"
    return info.metrics_address


def wait_all_blocks_free(
    address: str, timeout_s: float = 30.0, metadata=()
) -> tuple[worker_pb2.LoadReport, float]:
    """Polls until the worker reports nothing running or waiting and every KV block free; returns
    that load report and the seconds it took. `metadata`: as `worker_load`."""
    start = time.monotonic()
    while True:
        load = worker_load(address, metadata)
        if load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks:
            return load, time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"worker {address} still holds work: {load}"
        time.sleep(0.05)


def scrape(proc: "Proc | str", context=None) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page as {(name, sorted labels): value}: the one a process announced,
    or the one at a "host:port" (plain HTTP); `context`: an `ssl.SSLContext` for an HTTPS endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{proc}/metrics" if isinstance(proc, str) else metrics_url(proc)
    text = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path, env: dict[str, str] | None = None):
        """Starts `python <args>` in the repo; `env`: variables added to this process's environment."""
        self.name = name
        self.log_path = pathlib.Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir)[1])
        self._log = open(self.log_path, "wb")
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.address = ""

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_listening(self, timeout_s: float) -> str:
        self.address = self.wait_for_line(LISTENING, timeout_s).group(1)
        return self.address

    def wait_for_line(self, pattern: str | re.Pattern, timeout_s: float) -> re.Match:
        """The first match of `pattern` in the whole log, once it appears; RuntimeError if the process
        exits first, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log_path.read_text(errors="replace"))
            if found:
                return found
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)  # polling a log file; no event to wait on across processes
        raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout_s} s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (drain), then SIGKILL after `timeout_s`; the exit status."""
        terminate(self.popen, timeout_s)
        self._log.close()
        return self.popen.returncode


def stop_all(*procs: Proc, timeout_s: float = 15.0) -> list[int]:
    """Stops processes side by side: every one gets SIGTERM first, so their drains overlap (a
    second SIGTERM from `stop` only sets the same stop event again)."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    return [proc.stop(timeout_s) for proc in procs]


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)


def wait_health(
    address: str,
    proc: Proc | None = None,
    timeout_s: float = START_TIMEOUT_S,
    want=health_pb2.HealthCheckResponse.SERVING,
    credentials=None,
) -> None:
    """Polls grpc.health.v1 Check until it reports `want`."""
    deadline = time.monotonic() + timeout_s
    last = ""
    with open_channel(address, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == want:
                    return
                last = "wrong status"
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.05)
    raise TimeoutError(
        f"{address} not {health_pb2.HealthCheckResponse.ServingStatus.Name(want)} "
        f"within {timeout_s} s ({last})"
    )


def start_worker(
    log_dir: pathlib.Path,
    *extra: str,
    kv_cache_mb: float = TEST_KV_CACHE_MB,
    env: dict[str, str] | None = None,
) -> Proc:
    # Test routers probe every 0.2 s, so a 0.5 s drain announcement is enough (and keeps stops quick).
    # float32 pinned (the worker's default is auto = bfloat16): TEST_KV_CACHE_MB's block count and
    # context above, and the tests' exact greedy outputs, are float32's. --enforce-eager: these
    # tests are about the servers, and compiling the CPU step would add seconds to every start
    # (the compiled step is tested in process: tests/test_cpu_compile.py). One torch thread: test
    # workers share two cores with each other, the router and the test (as tests/conftest.py's
    # runner; two workers of two threads made test_faults 2.6x slower, and two threads' OpenMP
    # barriers under CPU steal were 1-5x slower than one).
    return Proc(
        "worker",
        [
            "-m",
            "worker",
            "--port",
            "0",
            "--kv-cache-mb",
            str(kv_cache_mb),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--num-threads",  # `extra` may give another count (the last one counts)
            "1",
            "--drain-announce-s",
            "0.5",
            *extra,
        ],
        log_dir,
        env,
    )


# The session's shared worker (tests/conftest.py `shared_worker`): start_worker's defaults, plus what
# the modules that share it read: JSON logs, /metrics on an ephemeral port, spans to the session's
# OTLP sink within 50 ms (OTEL_BSP_SCHEDULE_DELAY, not the default 5 s).
SHARED_WORKER_ARGS = ("--log-format", "json", "--metrics-port", "0")
FAST_SPAN_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def start_shared_worker(log_dir: pathlib.Path, otlp_endpoint: str) -> Proc:
    proc = start_worker(log_dir, *SHARED_WORKER_ARGS, "--otlp-endpoint", otlp_endpoint, env=FAST_SPAN_EXPORT)
    proc.name = "shared-worker"
    return proc


def start_router(
    log_dir: pathlib.Path, workers: list[str], *extra: str, env: dict[str, str] | None = None
) -> Proc:
    return Proc(
        "router",
        ["-m", "router", "--port", "0", "--workers", ",".join(workers), "--health-poll-s", "0.2", *extra],
        log_dir,
        env,
    )


def ready(*procs: Proc, credentials=None) -> None:
    """Waits for each process to listen and report SERVING (in order)."""
    for proc in procs:
        wait_health(proc.wait_listening(START_TIMEOUT_S), proc, credentials=credentials)


def wait_for_workers(
    router_address: str, num_workers: int, metadata=(), timeout_s: float = 30.0, credentials=None
) -> None:
    """Waits until the router sees `num_workers` healthy workers (ListModels)."""
    deadline = time.monotonic() + timeout_s
    with open_channel(router_address, credentials) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            models = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=2.0).models
            if models and models[0].num_workers == num_workers:
                return
            time.sleep(0.05)
    raise TimeoutError(f"router {router_address} did not see {num_workers} workers")


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Polls `condition()` until it is true (state in another process: there is no event to wait
    on); returns the seconds it took; TimeoutError naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def worker_load(address: str, metadata=()) -> worker_pb2.LoadReport:
    """`metadata`: the worker token (common.auth) for a worker that requires one."""
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), metadata=metadata, timeout=2.0
        )


@contextlib.contextmanager
def running_router(
    log_dir: pathlib.Path,
    workers: list[str],
    *extra: str,
    credentials=None,
    tenants: str | None = None,
    metadata=(),
    env: dict[str, str] | None = None,
):
    """A router that is serving and sees every worker in `workers`; stopped on exit. `tenants`:
    a tenants YAML text (written to a file in `log_dir`); `metadata`: the API key to ask with;
    `env`: variables added to its environment."""
    if tenants is not None:
        path = pathlib.Path(tempfile.mkstemp(prefix="tenants-", suffix=".yaml", dir=log_dir)[1])
        path.write_text(tenants)
        extra = ("--tenants", str(path), *extra)
    proc = start_router(log_dir, workers, *extra, env=env)
    try:
        ready(proc, credentials=credentials)
        wait_for_workers(proc.address, len(workers), metadata=metadata, credentials=credentials)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def running_workers(log_dir: pathlib.Path, count: int, *extra: str):
    """`count` serving workers started with the same arguments; all stopped on exit."""
    started = [start_worker(log_dir, *extra) for _ in range(count)]
    try:
        ready(*started)
        yield started
    finally:
        stop_all(*started)
