"""What tracing costs: the gRPC overhead benchmark's workload through two router + worker stacks,
one with tracing off (the default: no exporter, no SDK) and one exporting every span (sample ratio
1) over OTLP/gRPC to a receiver in this process, in alternating rounds (`make bench-tracing`).

Each round sends the same greedy requests (fixed output length, `ignore_eos`) all at once to one
stack; the stacks take turns (off, on, on, off, ...) so drift in machine speed hits both. Prints
output tokens/s per side, the throughput ratio (pooled, and the median over round pairs, which a
burst of load from other jobs on a shared machine moves less), the CPU time the router and worker
processes spent per output token (Linux /proc; less sensitive to other jobs than wall time), the
spans received, and the greedy-output correctness guard. A second, in-process part times one
request's whole observation (router + worker spans and metrics) with the no-op tracer vs the SDK.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import statistics
import time

import grpc

from benchmarks.grpc_overhead import Round, git_revision, make_prompts, run_grpc, summarize, wait_for_worker
from common.otlp_sink import OtlpSink
from protos.llm.v1 import generation_pb2_grpc
from router.local import LocalProcess


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
        threads = ["--num-threads", str(a.num_threads)] if a.num_threads else []
        self.worker = LocalProcess(f"worker-{name}", [
            "-m", "worker", "--port", "0", "--dtype", a.dtype, "--kv-cache-mb", str(a.kv_cache_mb),
            "--max-num-seqs", str(a.max_num_seqs), *threads, *extra], quiet=True)
        self.router: LocalProcess | None = None
        self._name, self._extra = name, extra

    def start_router(self) -> str:
        self.router = LocalProcess(f"router-{self._name}", [
            "-m", "router", "--port", "0", "--workers", self.worker.wait_listening(),
            "--health-poll-s", "0.2", "--metrics-port", "0", *self._extra], quiet=True)
        return self.router.wait_listening(60)

    def cpu_s(self) -> float:
        return cpu_s(self.worker.popen.pid) + cpu_s(self.router.popen.pid)

    def stop(self) -> None:
        if self.router:
            self.router.stop()
        self.worker.stop()


async def measure(a: argparse.Namespace, stacks: dict[str, Stack], stubs: dict, prompts: list[str]
                  ) -> tuple[dict[str, list[Round]], dict[str, list[float]]]:
    """Rounds per side and the CPU seconds the side's processes spent in each."""
    for stub in stubs.values():   # warm-up, excluded
        await run_grpc(stub, prompts[:2], 4)
    rounds: dict[str, list[Round]] = {side: [] for side in stubs}
    cpu: dict[str, list[float]] = {side: [] for side in stubs}
    for r in range(a.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for side in order:
            before = stacks[side].cpu_s()
            rounds[side].append(await run_grpc(stubs[side], prompts, a.output_len))
            cpu[side].append(stacks[side].cpu_s() - before)
        print(f"round {r}: " + ", ".join(f"tracing {side} {rounds[side][-1].output_tokens_per_s:.1f} tok/s"
                                         for side in ("off", "on")), flush=True)
    return rounds, cpu


def observation_cost_us(n: int) -> dict[str, float]:
    """Microseconds per request for router + worker observation, no-op tracer vs SDK (batch exporter)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    import router.observe
    import worker.observe
    from router.metrics import RouterMetrics
    from router.relay import Chunk, Done
    from worker.types import FinishReason, RequestOutput

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    class WorkerSide:
        def __init__(self):
            from common.request_metrics import RequestMetrics
            from prometheus_client import CollectorRegistry
            self.requests = RequestMetrics(CollectorRegistry(), "worker")

    logging.getLogger("llm.requests").setLevel(logging.WARNING)   # the log line is not what is timed here
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    # off: the API's proxy tracer with no provider installed, exactly what an untraced server runs
    tracers = {"off": trace.get_tracer("bench"), "on": provider.get_tracer("bench")}
    router_metrics, worker_metrics = RouterMetrics(), WorkerSide()
    outputs = [RequestOutput("r", [i], None, i == 63, FinishReason.LENGTH if i == 63 else None, 100, i + 1, 0,
                             0.001, 0.01) for i in range(64)]
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
                worker_metrics, worker_id="127.0.0.1:1", model="m", request_id="r", tenant="default",
                num_prompt_tokens=100, max_tokens=64, temperature=0.0, metadata=r.metadata)
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
    prompts = make_prompts(a.num_requests, a.seed)
    print(f"git {git_revision()} | {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
          f"SmolLM2-135M {a.dtype} | {a.num_requests} concurrent requests, {a.output_len} output tokens, "
          f"max_num_seqs {a.max_num_seqs}, {a.rounds} rounds per side, seed {a.seed}", flush=True)
    sink = OtlpSink(keep=False)
    stacks = {"off": Stack("off", a, []),
              "on": Stack("on", a, ["--otlp-endpoint", sink.endpoint, "--trace-sample-ratio", "1"])}
    try:
        targets = {side: stack.start_router() for side, stack in stacks.items()}
        channels = {side: grpc.aio.insecure_channel(target) for side, target in targets.items()}
        try:
            stubs = {side: generation_pb2_grpc.GenerationStub(ch) for side, ch in channels.items()}
            for stub in stubs.values():
                await wait_for_worker(stub)
            rounds, cpu = await measure(a, stacks, stubs, prompts)
        finally:
            for ch in channels.values():
                await ch.close()
    finally:
        for stack in stacks.values():
            stack.stop()        # flushes the "on" stack's pending spans to the sink
        sink.stop()
    report(a, rounds, cpu, sink.num_spans)
    costs = observation_cost_us(a.num_observations)
    print(f"\none request's observation (router + worker spans, metrics; 64 output tokens), "
          f"{a.num_observations} requests: tracing off {costs['off']:.0f} us, on {costs['on']:.0f} us")


def report(a: argparse.Namespace, rounds: dict[str, list[Round]], cpu: dict[str, list[float]],
           num_spans: int) -> None:
    reference = rounds["off"][0].outputs
    matches = sum(o == ref for side in rounds.values() for rnd in side
                  for o, ref in zip(rnd.outputs, reference))
    total = a.num_requests * 2 * a.rounds
    off, on = summarize(rounds["off"]), summarize(rounds["on"])
    print(f"\n{'tracing':<9}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'wall s':>9}")
    for name, s in (("off", off), ("on", on)):
        print(f"{name:<9}{s['tok_s']:>11.1f}{s['ttft_p50'] * 1e3:>13.0f}{s['ttft_p90'] * 1e3:>13.0f}"
              f"{s['wall_s']:>9.1f}")
    ratio = on["tok_s"] / off["tok_s"]
    per_round = [b.output_tokens_per_s / a_.output_tokens_per_s for a_, b in zip(rounds["off"], rounds["on"])]
    print(f"\nthroughput ratio tracing on / off: {ratio:.3f} ({100 * (ratio - 1):+.1f}%; target within 3%); "
          f"per round pair: median {statistics.median(per_round):.3f}, "
          f"range {min(per_round):.3f}-{max(per_round):.3f}")
    tokens = {side: sum(len(o) for rnd in rnds for o in rnd.outputs) for side, rnds in rounds.items()}
    cpu_ms = {side: 1e3 * sum(cpu[side]) / tokens[side] for side in cpu}
    if cpu_ms["off"]:
        print(f"CPU time of router + worker per output token: off {cpu_ms['off']:.2f} ms, "
              f"on {cpu_ms['on']:.2f} ms (on / off {cpu_ms['on'] / cpu_ms['off']:.3f})")
    requests = a.num_requests * a.rounds + 2
    print(f"spans received from the traced stack: {num_spans} ({num_spans / requests:.1f} per request)")
    print(f"greedy outputs identical to the first untraced round: {matches}/{total}"
          + ("" if matches == total else "  <- figures do not count (correctness guard)"))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracing_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="per side")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=float, default=256)
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads per worker (1: no OpenMP spin-wait, steadier on a shared machine)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-observations", type=int, default=2000, help="in-process observation timing")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
