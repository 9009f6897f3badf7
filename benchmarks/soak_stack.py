"""The parts the reliability soaks (benchmarks/soak.py) run on: a worker + router stack as child
processes, its idle check, and one measured Generate call.

Contract
- `Stack(num_workers, worker_args, router_args)`: quiet child processes on ephemeral ports (the
  router's /metrics on a free port); `running_workers`: addresses of workers already serving that
  the router uses too (the tests' shared worker; not stopped here, not in `pids()`);
  `wait_ready()`; `wait_idle()` polls until every worker reports
  nothing running or waiting with every KV block free and every router gauge of open work
  (`IDLE_GAUGES`, summed over labels) is 0, and returns what it saw; `stop()` drains and stops.
- `one_call(stub, request, timeout_s)` -> `Outcome` (status name, send/end times, TTFT, tokens).
- `generate_request(rng, words, max_tokens)`: a greedy, ignore_eos request of random words.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.net import free_port
from devtools.local import LocalProcess
from loadtest.stats import percentile
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

WORDS = (
    "river stone lantern harbor meadow signal copper orchard winter falcon canyon ember "
    "violet atlas quartz thunder willow beacon marble cedar"
).split()
IDLE_GAUGES = (
    "llm_router_open_calls",
    "llm_router_queue_length",
    "llm_router_tokens_in_flight",
    "llm_router_tenant_open_requests",
    "llm_router_worker_reserved_tokens",
    "llm_router_worker_outstanding_tokens",
    "llm_router_worker_inflight",
    "llm_router_worker_streams",
    "llm_num_requests_running",
    "llm_num_requests_waiting",
)


def prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Stack:
    """Workers and a router as child processes (quiet); `stop()` drains and stops them."""

    def __init__(
        self,
        num_workers: int = 1,
        worker_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        running_workers: tuple[str, ...] = (),
    ):
        self.workers = [
            LocalProcess(
                f"worker{i}",
                ["-m", "worker", "--port", "0", "--drain-announce-s", "0.5", *worker_args],
                quiet=True,
            )
            for i in range(num_workers)
        ]
        self.worker_addresses = [w.wait_listening() for w in self.workers] + list(running_workers)
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.router = LocalProcess(
            "router",
            [
                "-m",
                "router",
                "--port",
                "0",
                "--workers",
                ",".join(self.worker_addresses),
                "--health-poll-s",
                "0.2",
                "--metrics-port",
                str(metrics_port),
                *router_args,
            ],
            quiet=True,
        )
        self.address = self.router.wait_listening(120)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    models = (await stub.ListModels(pb.ListModelsRequest(), timeout=2)).models
                    if models and models[0].num_workers == len(self.worker_addresses):
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError("router did not see its workers")
                await asyncio.sleep(0.1)

    def pids(self) -> dict[str, int]:
        return {"router": self.router.popen.pid, **{w.name: w.popen.pid for w in self.workers}}

    def router_gauges(self) -> dict[str, float]:
        """Sum over labels of each gauge that must be 0 when idle."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        sums = dict.fromkeys(IDLE_GAUGES, 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in sums:
                    sums[s.name] += s.value
        return sums

    def worker_loads(self) -> list[worker_pb2.LoadReport]:
        loads = []
        for address in self.worker_addresses:
            with grpc.insecure_channel(address) as channel:
                loads.append(
                    worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                )
        return loads

    async def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Polls until every worker is empty with all KV blocks free and every router gauge is 0."""
        start = time.monotonic()
        while True:
            loads = await asyncio.to_thread(self.worker_loads)
            gauges = await asyncio.to_thread(self.router_gauges)
            busy = [
                f"{a}: {load.num_running} running, {load.num_waiting} waiting, {load.num_free_blocks}/"
                f"{load.num_total_blocks} blocks free"
                for a, load in zip(self.worker_addresses, loads)
                if load.num_running or load.num_waiting or load.num_free_blocks != load.num_total_blocks
            ]
            busy += [f"{k} = {v:g}" for k, v in gauges.items() if v]
            waited = time.monotonic() - start
            if not busy or waited > timeout_s:
                return {
                    "idle": not busy,
                    "idle_after_s": round(waited, 3),
                    "not_idle": busy,
                    "kv_blocks": [f"{load.num_free_blocks}/{load.num_total_blocks}" for load in loads],
                }
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.router.stop()
        for w in self.workers:
            w.stop()


def generate_request(rng: random.Random, words: tuple[int, int], max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=prompt(rng, rng.randint(*words)))
    req.sampling.temperature = 0.0
    req.stopping.max_tokens = max_tokens
    req.stopping.ignore_eos = True
    return req


@dataclass
class Outcome:
    status: str = "OK"
    sent_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    phase: str = ""  # cancel storm: where the call was when the client cancelled it


async def one_call(stub, req: pb.GenerateRequest, timeout_s: float) -> Outcome:
    out = Outcome(sent_s=time.monotonic())
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.sent_s
                out.tokens += len(msg.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
    out.end_s = time.monotonic()
    return out


def quantiles_ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": round(percentile(values, 50) * 1e3, 1),
        "p99_ms": round(percentile(values, 99) * 1e3, 1),
        "max_ms": round(max(values) * 1e3, 1),
    }
