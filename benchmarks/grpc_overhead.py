"""What the gRPC layers cost: router + worker processes vs the in-process engine, same requests,
same run (`make bench-grpc`).

Both sides get the same greedy requests (fixed output length, `ignore_eos`) all at once
(saturation), in alternating rounds; each side reports output tokens/s and TTFT percentiles. The
gRPC side sends text and lets the router tokenize, detokenize and relay, so every layer a client
goes through is on the clock. A throughput figure counts only if greedy outputs match between the
two sides (docs/metrics.md, correctness guard). Prints the throughput ratio and the added TTFT p50, both
at saturation (where arrival order also shapes the first batch) and one request at a time (the
layers' own latency).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
from dataclasses import dataclass

import grpc

from benchmarks.report import git_short
from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from devtools.local import LocalProcess
from loadtest.stats import percentile
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.types import SamplingParams

WORDS = (
    "the river mountain quiet engine paper light music garden winter signal number story "
    "market window travel silver history planet forest letter ocean simple bright"
).split()


@dataclass
class Round:
    side: str
    wall_s: float
    ttft_s: list[float]
    outputs: list[list[int]]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.wall_s


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 80))) for i in range(n)
    ]


async def run_in_process(
    engine: AsyncEngine, prompt_ids: list[list[int]], output_len: int, tag: str
) -> Round:
    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int) -> tuple[float, list[int]]:
        start, ttft, ids = time.perf_counter(), 0.0, []
        async for out in engine.generate(f"{tag}-{i}", prompt_ids[i], sampling):
            if out.new_token_ids and not ids:
                ttft = time.perf_counter() - start
            ids.extend(out.new_token_ids)
        return ttft, ids

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(prompt_ids))))
    return Round("in-process", time.perf_counter() - start, [r[0] for r in results], [r[1] for r in results])


async def run_grpc(stub: generation_pb2_grpc.GenerationStub, prompts: list[str], output_len: int) -> Round:
    async def one(prompt: str) -> tuple[float, list[int]]:
        request = pb.GenerateRequest(
            prompt=prompt,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True),
        )
        start, ttft, ids = time.perf_counter(), 0.0, []
        async for msg in stub.Generate(request):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                if not ids:
                    ttft = time.perf_counter() - start
                ids.extend(msg.chunk.token_ids)
        return ttft, ids

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return Round("grpc", time.perf_counter() - start, [r[0] for r in results], [r[1] for r in results])


def summarize(rounds: list[Round]) -> dict:
    ttft = [t for r in rounds for t in r.ttft_s]
    tokens = sum(len(o) for r in rounds for o in r.outputs)
    return {
        "tok_s": tokens / sum(r.wall_s for r in rounds),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "wall_s": sum(r.wall_s for r in rounds),
    }


async def main_async(a: argparse.Namespace) -> None:
    config = EngineConfig(
        dtype=a.dtype, kv_cache_bytes=int(a.kv_cache_mb * 2**20), max_num_seqs=a.max_num_seqs
    )
    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = make_prompts(a.num_requests, a.seed)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    print(
        f"git {git_short()} | {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
        f"SmolLM2-135M {a.dtype} | {a.num_requests} concurrent requests, prompts "
        f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens, {a.output_len} output tokens, "
        f"max_num_seqs {a.max_num_seqs}, {a.rounds} rounds per side, seed {a.seed}",
        flush=True,
    )

    engine = AsyncEngine.from_config(config)
    worker = LocalProcess(
        "worker",
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
        ],
        quiet=True,
    )
    router = None
    try:
        worker_address = worker.wait_listening()
        router = LocalProcess(
            "router",
            ["-m", "router", "--port", "0", "--workers", worker_address, "--health-poll-s", "0.2"],
            quiet=True,
        )
        target = router.wait_listening(60)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await wait_for_worker(stub)
            rounds, single = await measure(a, engine, stub, prompts, prompt_ids)
    finally:
        if router:
            router.stop()
        worker.stop()
        engine.shutdown()

    report(a, rounds, single)


async def measure(
    a: argparse.Namespace, engine: AsyncEngine, stub, prompts: list[str], prompt_ids: list[list[int]]
) -> tuple[dict[str, list[Round]], dict[str, list[float]]]:
    # warm-up on both sides, excluded from the figures
    await run_in_process(engine, prompt_ids[:2], 4, "warmup")
    await run_grpc(stub, prompts[:2], 4)
    rounds: dict[str, list[Round]] = {"in-process": [], "grpc": []}
    for r in range(a.rounds):  # alternate sides so drift in machine speed hits both
        rounds["in-process"].append(await run_in_process(engine, prompt_ids, a.output_len, f"round{r}"))
        rounds["grpc"].append(await run_grpc(stub, prompts, a.output_len))
        print(
            f"round {r}: in-process {rounds['in-process'][-1].output_tokens_per_s:.1f} tok/s, "
            f"grpc {rounds['grpc'][-1].output_tokens_per_s:.1f} tok/s",
            flush=True,
        )
    single: dict[str, list[float]] = {"in-process": [], "grpc": []}
    for i in range(a.num_single):  # unloaded: one request at a time, alternating sides
        k = i % len(prompts)
        single["in-process"] += (await run_in_process(engine, [prompt_ids[k]], 2, f"single{i}")).ttft_s
        single["grpc"] += (await run_grpc(stub, [prompts[k]], 2)).ttft_s
    return rounds, single


def report(a: argparse.Namespace, rounds: dict[str, list[Round]], single: dict[str, list[float]]) -> None:
    reference = rounds["in-process"][0].outputs
    matches = sum(
        o == ref for side in rounds.values() for rnd in side for o, ref in zip(rnd.outputs, reference)
    )
    total = a.num_requests * 2 * a.rounds
    inproc, via_grpc = summarize(rounds["in-process"]), summarize(rounds["grpc"])
    print(f"\n{'side':<12}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'wall s':>9}")
    for name, s in (("in-process", inproc), ("grpc", via_grpc)):
        print(
            f"{name:<12}{s['tok_s']:>11.1f}{s['ttft_p50'] * 1e3:>13.0f}{s['ttft_p90'] * 1e3:>13.0f}"
            f"{s['wall_s']:>9.1f}"
        )
    ratio = via_grpc["tok_s"] / inproc["tok_s"]
    print(
        f"\nthroughput ratio grpc / in-process: {ratio:.3f} (gRPC layers cost {100 * (1 - ratio):.1f}%; "
        f"target < 10%)"
    )
    single_p50 = {side: percentile(values, 50) for side, values in single.items()}
    print(
        f"added TTFT p50 at saturation: {(via_grpc['ttft_p50'] - inproc['ttft_p50']) * 1e3:+.0f} ms; "
        f"one request at a time: {(single_p50['grpc'] - single_p50['in-process']) * 1e3:+.1f} ms "
        f"({single_p50['in-process'] * 1e3:.0f} -> {single_p50['grpc'] * 1e3:.0f} ms)"
    )
    print(
        f"greedy outputs identical to the first in-process round: {matches}/{total}"
        + ("" if matches == total else "  <- figures do not count (correctness guard)")
    )


async def wait_for_worker(stub: generation_pb2_grpc.GenerationStub, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        models = (await stub.ListModels(pb.ListModelsRequest())).models
        if models and models[0].num_workers:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("the router saw no healthy worker")


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_overhead", description=__doc__.splitlines()[0]
    )
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-single", type=int, default=8, help="unloaded TTFT samples per side")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=float, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
