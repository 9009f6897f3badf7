"""What tracing costs: the gRPC overhead benchmark's requests through two router + worker stacks
at the same time, one with tracing off (the default: no exporter, no SDK) and one exporting every
span (sample ratio 1) over OTLP/gRPC to a receiver in this process (`make bench-tracing`).

Why at the same time: on a machine shared with other jobs, load comes in bursts that move a
round's throughput by tens of percent, far more than the 3% being measured; stacks that take
turns see different bursts. Run side by side, both see the same ones. Each round is a fixed time
window in which each stack serves a closed loop of `--concurrency` streams of greedy requests
(fixed output length, `ignore_eos`); the streams still open when the window closes are cancelled,
and only tokens received inside the window count. `--aa` traces neither stack, to measure the
method's own bias and noise (an A/A run).

Prints output tokens/s per side and their ratio (pooled, and the median over rounds), the CPU time
the router and worker processes spent per output token (Linux /proc), the spans received, and the
correctness guard (greedy outputs identical across the two stacks). Then an in-process part times
one request's whole observation (router + worker spans and metrics) with the no-op tracer vs the SDK.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import grpc

from benchmarks.grpc_overhead import make_prompts, wait_for_worker
from benchmarks.report import git_short
from devtools.local import LocalProcess
from devtools.otlp_sink import OtlpSink
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc

SIDES = ("off", "on")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stack:
    """One worker + one router on loopback ephemeral ports."""

    def __init__(self, name: str, a: argparse.Namespace, extra: list[str]):
        self.worker = LocalProcess(
            f"worker-{name}",
            [
                "-m",
                "worker",
                "--port",
                "0",
                "--dtype",
                a.dtype,
                "--kv-cache-mb",
                str(a.kv_cache_mb),
                "--max-num-seqs",
                str(a.max_num_seqs),
                "--num-threads",
                str(a.num_threads),
                *extra,
            ],
            quiet=True,
        )
        self.router: LocalProcess | None = None
        self._name, self._extra = name, extra

    def start_router(self) -> str:
        self.router = LocalProcess(
            f"router-{self._name}",
            [
                "-m",
                "router",
                "--port",
                "0",
                "--workers",
                self.worker.wait_listening(),
                "--health-poll-s",
                "0.2",
                "--metrics-port",
                "0",
                *self._extra,
            ],
            quiet=True,
        )
        return self.router.wait_listening(60)

    def cpu_s(self) -> float:
        return cpu_s(self.worker.popen.pid) + cpu_s(self.router.popen.pid)

    def stop(self) -> None:
        if self.router:
            self.router.stop()
        self.worker.stop()


@dataclass
class Window:
    """One side's share of one round."""

    num_tokens: int = 0
    cpu_s: float = 0.0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> completed output


async def closed_loop(stub, prompts: list[str], a: argparse.Namespace, window: Window, first: int) -> None:
    """`a.concurrency` streams, each sending the next prompt when its request completes."""
    stopping = pb.StoppingCriteria(max_tokens=a.output_len, ignore_eos=True)

    async def stream(k: int) -> None:
        i = first + k
        while True:
            index = i % len(prompts)
            request = pb.GenerateRequest(
                prompt=prompts[index], sampling=pb.SamplingParams(temperature=0.0), stopping=stopping
            )
            ids: list[int] = []
            async for msg in stub.Generate(request):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                    window.num_tokens += len(msg.chunk.token_ids)
            window.outputs[index] = ids
            i += a.concurrency

    await asyncio.gather(*(stream(k) for k in range(a.concurrency)))


async def measure(a: argparse.Namespace, stacks: dict[str, Stack], stubs: dict) -> dict[str, list[Window]]:
    prompts = make_prompts(a.num_prompts, a.seed)
    windows: dict[str, list[Window]] = {side: [] for side in SIDES}
    for r in range(-1, a.rounds):  # round -1 warms both stacks up and is not counted
        current = {side: Window() for side in SIDES}
        before = {side: stacks[side].cpu_s() for side in SIDES}
        loops = [
            asyncio.create_task(closed_loop(stubs[side], prompts, a, current[side], r * a.concurrency))
            for side in SIDES
        ]
        await asyncio.sleep(a.window_s if r >= 0 else min(a.window_s, 10.0))
        for task in loops:  # cancels the open streams, as a client would
            task.cancel()
        for task in loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for side in SIDES:
            current[side].cpu_s = stacks[side].cpu_s() - before[side]
        await asyncio.sleep(1.0)  # cancelled sequences leave the engines
        if r < 0:
            continue
        for side in SIDES:
            windows[side].append(current[side])
        print(
            f"round {r}: "
            + ", ".join(
                f"tracing {side} {current[side].num_tokens / a.window_s:.1f} tok/s" for side in SIDES
            ),
            flush=True,
        )
    return windows


def report(a: argparse.Namespace, windows: dict[str, list[Window]], num_spans: int) -> None:
    tokens = {side: sum(w.num_tokens for w in windows[side]) for side in SIDES}
    cpu = {side: sum(w.cpu_s for w in windows[side]) for side in SIDES}
    duration = a.window_s * a.rounds
    print(f"\n{'tracing':<9}{'out tok/s':>11}{'CPU ms/token':>14}")
    for side in SIDES:
        print(f"{side:<9}{tokens[side] / duration:>11.1f}{1e3 * cpu[side] / max(1, tokens[side]):>14.2f}")
    ratio = tokens["on"] / tokens["off"]
    per_round = [on.num_tokens / off.num_tokens for off, on in zip(windows["off"], windows["on"])]
    label = "A/A (neither traced)" if a.aa else "tracing on / off"
    print(
        f"\nthroughput ratio {label}: {ratio:.3f} ({100 * (ratio - 1):+.1f}%; target within 3%); "
        f"per round: median {statistics.median(per_round):.3f}, "
        f"range {min(per_round):.3f}-{max(per_round):.3f}"
    )
    if cpu["off"] and cpu["on"]:
        cpu_ratio = (cpu["on"] / tokens["on"]) / (cpu["off"] / tokens["off"])
        print(f"CPU time per output token, on / off: {cpu_ratio:.3f}")
    print(f"spans received from the traced stack: {num_spans}")
    reference: dict[int, list[int]] = {}
    for w in windows["off"]:
        reference.update(w.outputs)
    compared = [(i, ids) for w in windows["on"] for i, ids in w.outputs.items() if i in reference]
    matches = sum(ids == reference[i] for i, ids in compared)
    print(
        f"greedy outputs identical across the stacks: {matches}/{len(compared)}"
        + ("" if matches == len(compared) else "  <- figures do not count (correctness guard)")
    )


def observation_cost_us(n: int) -> dict[str, float]:
    """Microseconds per request for router + worker observation, no-op tracer vs SDK (batch exporter)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from prometheus_client import CollectorRegistry

    import router.observe
    import worker.observe
    from common.request_metrics import RequestMetrics
    from router.metrics import RouterMetrics
    from router.relay import Chunk, Done
    from worker.types import FinishReason, RequestOutput

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    class WorkerSide:
        requests = RequestMetrics(CollectorRegistry(), "worker")

    logging.getLogger("llm.requests").setLevel(logging.WARNING)  # the log line is not what is timed here
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    # off: the API's proxy tracer with no provider installed, exactly what an untraced server runs
    tracers = {"off": trace.get_tracer("bench"), "on": provider.get_tracer("bench")}
    router_metrics, worker_metrics = RouterMetrics(), WorkerSide()
    outputs = [
        RequestOutput(
            "r", [i], None, i == 63, FinishReason.LENGTH if i == 63 else None, 100, i + 1, 0, 0.001, 0.01
        )
        for i in range(64)
    ]
    costs = {}
    for side, tracer in tracers.items():
        router.observe.tracer = worker.observe.tracer = tracer
        start = time.perf_counter()
        for _ in range(n):
            r = router.observe.RequestObservation(router_metrics, ())
            for stage in ("auth", "validate", "admission", "queue"):
                r.stage(stage)
            r.request("r", "default", "m", 100, 64, 0.0, 1.0)
            r.stage("route", worker="127.0.0.1:1")
            w = worker.observe.RequestObservation(
                worker_metrics,
                worker_id="127.0.0.1:1",
                model="m",
                request_id="r",
                tenant="default",
                num_prompt_tokens=100,
                max_tokens=64,
                temperature=0.0,
                metadata=r.metadata,
            )
            for out in outputs:
                w.output(out)
                r.event(Chunk(out.new_token_ids, "x", []))
            w.finish()
            r.event(Done("r", "length", 100, 64, 0, 1.0, 10.0, 100.0))
            r.finish()
        costs[side] = (time.perf_counter() - start) / n * 1e6
    provider.shutdown()
    return costs


async def main_async(a: argparse.Namespace) -> None:
    print(
        f"git {git_short()} | {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
        f"SmolLM2-135M {a.dtype}, {a.num_threads} torch thread(s) per worker | {a.rounds} rounds of "
        f"{a.window_s:g} s, {a.concurrency} streams per stack, {a.output_len} output tokens, "
        f"max_num_seqs {a.max_num_seqs}, seed {a.seed}" + (" | A/A" if a.aa else ""),
        flush=True,
    )
    sink = OtlpSink(keep=False)
    traced = [] if a.aa else ["--otlp-endpoint", sink.endpoint, "--trace-sample-ratio", "1"]
    stacks = {"off": Stack("off", a, []), "on": Stack("on", a, traced)}
    try:
        channels = {side: grpc.aio.insecure_channel(stack.start_router()) for side, stack in stacks.items()}
        try:
            stubs = {side: generation_pb2_grpc.GenerationStub(ch) for side, ch in channels.items()}
            for stub in stubs.values():
                await wait_for_worker(stub)
            windows = await measure(a, stacks, stubs)
        finally:
            for ch in channels.values():
                await ch.close()
    finally:
        for stack in stacks.values():
            stack.stop()  # flushes the traced stack's pending spans to the sink
        sink.stop()
    report(a, windows, sink.num_spans)
    costs = observation_cost_us(a.num_observations)
    print(
        f"\none request's observation (router + worker spans, metrics; 64 output tokens), "
        f"{a.num_observations} requests: tracing off {costs['off']:.0f} us, on {costs['on']:.0f} us"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tracing_overhead", description=__doc__.splitlines()[0]
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--window-s", type=float, default=30.0, help="length of one round")
    p.add_argument("--concurrency", type=int, default=8, help="streams per stack")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=float, default=256)
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch threads per worker (1: no OpenMP spin-wait, steadier on a shared machine)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aa", action="store_true", help="trace neither stack (the method's own bias and noise)")
    p.add_argument("--num-observations", type=int, default=2000, help="in-process observation timing")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
