"""Reliability soaks against real worker and router processes on 127.0.0.1.

    python -m benchmarks.soak overload       # 3x capacity for 60 s (make soak runs both)
    python -m benchmarks.soak cancel-storm   # 1,000 streams cancelled at random points
    python -m benchmarks.soak trust          # stalled readers, prompt flood, priority abuse
    python -m benchmarks.soak hostile        # one tenant's hostile requests vs everyone else (--quick)

Contract
- overload: measures unloaded TTFT (one request at a time), then capacity (completed requests/s
  with as many closed-loop clients as the stack admits at once: the worker's batch size plus the
  router's queue cap, so refusals do not load the CPU while it is measured), then offers `--factor` x
  capacity as a Poisson stream for `--duration-s`. Every call has a deadline; reported: refusal
  latency (client send -> RESOURCE_EXHAUSTED) p50/p99, accepted TTFT p50/p99 against the unloaded
  p99, router and worker RSS growth from the end of the warm-up (the first quarter of the overload
  phase, at most 10 s) to the end, the count of calls that outlived their deadline (hung), and
  whether the router's bookkeeping and the workers' KV pools return to idle afterwards.
- cancel-storm: `--streams` calls, at most `--max-open` at a time, each cancelled at a random
  point: at once (often before admission), after a random delay before any token (queued or
  prefilling), or after k tokens (decoding); some finish first. The router's queue length and
  open worker streams are sampled every 0.25 s (peaks reported: the storm did catch requests
  queued in the router and streaming from workers). Afterwards every worker must report
  nothing running or waiting and every KV block free, and every router gauge of open work
  (`llm_router_*`, `llm_num_requests_*`) must be 0; reported: the time that took.
- trust: benchmarks/soak_trust.py (issue 17: unauthenticated worker calls, stalled readers, a
  huge-prompt flood, priority abuse).
- hostile: benchmarks/soak_hostile.py (issue 45: single requests from one tenant that must not
  stall the others; a table per row on stdout; `--quick` is the small size).
- output: a table on stdout and JSON in `--out` (default docs/data/reliability/<scenario>.json).
  Seeded (`--seed`); the seed, arguments, git revision and date are in the JSON.
- targets (issue #9) are checked and printed as PASS/MISS; the exit status is 0 either way
  unless a correctness check failed (a hung call, a leak), which exits 1.
- proven by: tests/test_soak.py (short runs in `make test`; full ones with --runslow / `make soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass

import grpc

from benchmarks.report import git_short
from benchmarks.soak_hostile import HostileArgs, run_hostile, table
from benchmarks.soak_stack import Outcome, Stack, generate_request, one_call, quantiles_ms, rss_mib
from benchmarks.soak_trust import TrustArgs, run_trust
from loadtest.stats import percentile
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- overload


@dataclass
class OverloadArgs:
    duration_s: float = 60.0
    factor: float = 3.0
    capacity_s: float = 20.0
    clients: int = 16
    unloaded_requests: int = 100  # the unloaded p99 is the target's yardstick: 20 made it the maximum
    max_tokens: int = 32
    words: tuple[int, int] = (8, 24)
    deadline_s: float = 60.0
    seed: int = 0


async def run_overload(stack: Stack, a: OverloadArgs) -> dict:
    rng = random.Random(a.seed)
    await stack.wait_ready()
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(3):  # warm-up
            await one_call(stub, generate_request(rng, a.words, a.max_tokens), a.deadline_s)
        unloaded = [
            await one_call(stub, generate_request(rng, a.words, a.max_tokens), a.deadline_s)
            for _ in range(a.unloaded_requests)
        ]
        unloaded_ttft = [o.ttft_s for o in unloaded if o.ttft_s is not None]

        # capacity: closed loop, clients back off briefly when refused
        done: list[Outcome] = []
        stop_at = time.monotonic() + a.capacity_s

        async def closed_client() -> None:
            while time.monotonic() < stop_at:
                o = await one_call(stub, generate_request(rng, a.words, a.max_tokens), a.deadline_s)
                done.append(o)
                if o.status != "OK":
                    await asyncio.sleep(0.05)

        t0 = time.monotonic()
        await asyncio.gather(*(closed_client() for _ in range(a.clients)))
        completed = [o for o in done if o.status == "OK"]
        capacity = len(completed) / (time.monotonic() - t0)
        capacity_tok = sum(o.tokens for o in completed) / (time.monotonic() - t0)

        # overload: open-loop Poisson at factor x capacity
        rate = a.factor * capacity
        warmup_s = min(10.0, a.duration_s / 4)
        rss: dict[str, list[float]] = {name: [] for name in stack.pids()}
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        next_s = start
        baseline: dict[str, float] = {}
        last_sample = 0.0
        while (now := time.monotonic()) < start + a.duration_s:
            if now >= next_s:
                tasks.append(
                    asyncio.create_task(
                        one_call(stub, generate_request(rng, a.words, a.max_tokens), a.deadline_s)
                    )
                )
                next_s += rng.expovariate(rate)
            if now - last_sample >= 1.0:
                last_sample = now
                for name, pid in stack.pids().items():
                    rss[name].append(rss_mib(pid))
                if not baseline and now - start >= warmup_s:
                    baseline = {name: values[-1] for name, values in rss.items()}
            await asyncio.sleep(max(0.0, min(next_s, last_sample + 1.0) - time.monotonic()))
        finished, unfinished = await asyncio.wait(tasks, timeout=a.deadline_s + 10)
        for t in unfinished:
            t.cancel()
        end_rss = {name: rss_mib(pid) for name, pid in stack.pids().items()}
    outcomes = [t.result() for t in finished]
    refused = [o for o in outcomes if o.status == "RESOURCE_EXHAUSTED"]
    accepted = [o for o in outcomes if o.status == "OK"]
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    idle = await stack.wait_idle()
    unloaded_p99 = percentile(unloaded_ttft, 99)
    accepted_ttft = [o.ttft_s for o in accepted if o.ttft_s is not None]
    growth = {name: round(100 * (end_rss[name] / baseline[name] - 1), 2) for name in end_rss}
    result = {
        "capacity_req_s": round(capacity, 3),
        "capacity_output_tok_s": round(capacity_tok, 1),
        "offered_req_s": round(rate, 3),
        "sent": len(tasks),
        "statuses": statuses,
        "hung": len(unfinished),
        "unloaded_ttft": quantiles_ms(unloaded_ttft),
        "accepted_ttft": quantiles_ms(accepted_ttft),
        "ttft_p99_ratio": round(percentile(accepted_ttft, 99) / unloaded_p99, 2) if accepted_ttft else None,
        "refusal_latency": quantiles_ms([o.end_s - o.sent_s for o in refused]),
        "rss_mib_after_warmup": {k: round(v, 1) for k, v in baseline.items()},
        "rss_mib_end": {k: round(v, 1) for k, v in end_rss.items()},
        "rss_growth_pct": growth,
        **idle,
    }
    result["targets"] = {
        "refusal_p99_under_50ms": bool(refused) and result["refusal_latency"]["p99_ms"] < 50,
        "accepted_ttft_p99_within_2x_unloaded": result["ttft_p99_ratio"] is not None
        and result["ttft_p99_ratio"] <= 2,
        "rss_growth_under_10pct": all(g < 10 for g in growth.values()),
        "none_hung": not unfinished and set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"},
        "idle_afterwards": idle["idle"],
    }
    return result


# ---------------------------------------------------------------- cancellation storm


@dataclass
class StormArgs:
    streams: int = 1000
    max_open: int = 128
    max_tokens: tuple[int, int] = (16, 64)
    words: tuple[int, int] = (4, 120)
    deadline_s: float = 120.0
    seed: int = 0


async def storm_call(
    stub, req: pb.GenerateRequest, mode: str, rng: random.Random, timeout_s: float
) -> Outcome:
    out = Outcome(sent_s=time.monotonic())
    call = stub.Generate(req, timeout=timeout_s)
    delay = rng.uniform(0.0, 0.4)
    after_k = rng.randint(1, 12)
    try:
        if mode == "at_once":
            call.cancel()
            out.phase = "cancelled before any response"
        else:

            async def consume() -> None:
                async for msg in call:
                    if msg.HasField("chunk") and msg.chunk.token_ids:
                        out.tokens += len(msg.chunk.token_ids)
                        if mode == "after_tokens" and out.tokens >= after_k:
                            call.cancel()
                            out.phase = "cancelled mid-stream"
                            return
                out.phase = "finished before its cancel point"

            if mode == "after_delay":
                try:
                    async with asyncio.timeout(delay):
                        await consume()
                except TimeoutError:
                    call.cancel()
                    out.phase = "cancelled mid-stream" if out.tokens else "cancelled before any token"
            else:
                await consume()
    except asyncio.CancelledError:
        raise
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            out.status, out.phase = exc.code().name, f"ended {exc.code().name}"
    out.end_s = time.monotonic()
    return out


async def run_storm(stack: Stack, a: StormArgs) -> dict:
    rng = random.Random(a.seed)
    await stack.wait_ready()
    gate = asyncio.Semaphore(a.max_open)
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def gated(i: int) -> Outcome:
            async with gate:
                r = random.Random(a.seed * 1_000_003 + i)
                req = generate_request(r, a.words, r.randint(*a.max_tokens))
                return await storm_call(
                    stub, req, r.choice(("at_once", "after_delay", "after_tokens")), r, a.deadline_s
                )

        peak = {
            "llm_router_queue_length": 0.0,
            "llm_router_worker_streams": 0.0,
            "llm_router_open_calls": 0.0,
        }

        async def sample() -> None:  # shows the storm caught requests queued and streaming
            while True:
                gauges = await asyncio.to_thread(stack.router_gauges)
                for k in peak:
                    peak[k] = max(peak[k], gauges[k])
                await asyncio.sleep(0.25)

        start = time.monotonic()
        sampler = asyncio.create_task(sample())
        tasks = [asyncio.create_task(gated(i)) for i in range(a.streams)]
        finished, unfinished = await asyncio.wait(tasks, timeout=a.deadline_s + 30)
        sampler.cancel()
        for t in unfinished:
            t.cancel()
        storm_s = time.monotonic() - start
        idle = await stack.wait_idle()
        after = await one_call(stub, generate_request(rng, (8, 16), 8), 60)  # still serving?
    phases: dict[str, int] = {}
    for t in finished:
        phases[t.result().phase] = phases.get(t.result().phase, 0) + 1
    result = {
        "streams": a.streams,
        "storm_s": round(storm_s, 1),
        "phases": phases,
        "peak_router": {k.removeprefix("llm_router_"): int(v) for k, v in peak.items()},
        "hung": len(unfinished),
        **idle,
        "served_afterwards": after.status,
    }
    result["targets"] = {
        "none_hung": not unfinished,
        "idle_afterwards": idle["idle"],
        "serves_afterwards": after.status == "OK",
    }
    return result


# ---------------------------------------------------------------- command line

WORKER_ARGS = ("--num-threads", "1")


def write(result: dict, name: str, args, out_dir: pathlib.Path) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    meta = {
        "scenario": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_short(),
        "args": asdict(args),
    }
    path.write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    return path


def print_result(name: str, result: dict) -> None:
    print(f"\n== {name}")
    for k, v in result.items():
        if k != "targets":
            print(f"  {k}: {v}")
    for k, ok in result["targets"].items():
        print(f"  [{'PASS' if ok else 'MISS'}] {k}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=("overload", "cancel-storm", "trust", "hostile", "all"))
    p.add_argument("--duration-s", type=float, default=60.0, help="overload phase length")
    p.add_argument("--factor", type=float, default=3.0, help="offered load / measured capacity")
    p.add_argument("--capacity-s", type=float, default=20.0)
    p.add_argument(
        "--router-queue",
        type=int,
        default=0,
        help="overload run: router queue cap (--max-queued); 0 = no queue (--no-queue)",
    )
    p.add_argument("--max-num-seqs", type=int, default=2, help="overload run: the worker's batch size")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2, help="workers in the cancellation storm")
    p.add_argument("--flood-s", type=float, default=10.0, help="trust run: huge-prompt flood length")
    p.add_argument("--quick", action="store_true", help="hostile run: small bodies, few requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "docs" / "data" / "reliability"))
    a = p.parse_args(argv)
    failed = False
    if a.scenario in ("overload", "all"):
        args = OverloadArgs(
            duration_s=a.duration_s,
            factor=a.factor,
            capacity_s=a.capacity_s,
            seed=a.seed,
            clients=a.max_num_seqs + a.router_queue,
        )
        queueing = ("--max-queued", str(a.router_queue)) if a.router_queue else ("--no-queue",)
        stack = Stack(
            1, ("--kv-cache-mb", "64", "--max-num-seqs", str(a.max_num_seqs), *WORKER_ARGS), queueing
        )
        try:
            result = asyncio.run(run_overload(stack, args))
        finally:
            stack.stop()
        result["router"] = " ".join(queueing)
        result["worker_max_num_seqs"] = a.max_num_seqs
        print_result("overload", result)
        print(f"  -> {write(result, 'overload', args, pathlib.Path(a.out))}")
        failed |= not (result["targets"]["none_hung"] and result["targets"]["idle_afterwards"])
    if a.scenario in ("cancel-storm", "all"):
        args = StormArgs(streams=a.streams, seed=a.seed)
        stack = Stack(a.workers, ("--kv-cache-mb", "48", *WORKER_ARGS))
        try:
            result = asyncio.run(run_storm(stack, args))
        finally:
            stack.stop()
        print_result("cancel-storm", result)
        print(f"  -> {write(result, 'cancel_storm', args, pathlib.Path(a.out))}")
        failed |= not all(result["targets"].values())
    if a.scenario in ("trust", "all"):
        args = TrustArgs(flood_s=a.flood_s, seed=a.seed)
        result = run_trust(args, WORKER_ARGS)
        print_result("trust", result)
        print(f"  -> {write(result, 'trust', args, pathlib.Path(a.out))}")
        correctness = ("stalled_readers.every_kv_block_free", "prompt_flood.no_internal_or_unknown")
        failed |= not all(result["targets"][t] for t in correctness)
    if a.scenario in ("hostile", "all"):
        args = HostileArgs.small(a.seed) if a.quick else HostileArgs(seed=a.seed)
        result = run_hostile(args, WORKER_ARGS)
        print("\n== hostile\n" + table(result))
        print(f"  machine: {result['machine']}")
        print(f"  -> {write(result, 'hostile_quick' if a.quick else 'hostile', args, pathlib.Path(a.out))}")
        failed |= not all(result["correct"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
