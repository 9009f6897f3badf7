"""Router CPU per 1k tokens/s, measured on a simulated Ray cluster
(`python -m benchmarks.router_cpu`).

Two simulated nodes with fake GPUs, workers serving a tiny random Llama on CPU (fast steps, so
the router relays many tokens per second), and one real router process with Ray discovery. The
router's own CPU time (user + system, from /proc) is read over an idle window (health and load
probes plus Ray discovery: the per-worker cost) and over a window of saturating streams (the
per-token cost: receive from the worker, detokenize, stop-string check, send to the client).
Prints router cores per 1k output tokens/s and the idle cost per worker; docs/ray.md turns them
into how many workers one router can drive.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import grpc

from deploy.ray_launch import LaunchConfig, launch_workers
from deploy.sim_cluster import SimulatedCluster, write_tiny_llama
from devtools.local import LocalProcess
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from worker.config import EngineConfig

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def wait_workers(target: str, num_workers: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            try:
                models = stub.ListModels(pb.ListModelsRequest(), timeout=2.0).models
                if models and models[0].num_workers == num_workers:
                    return
            except grpc.RpcError:
                pass  # not serving yet: poll again until the deadline
            time.sleep(0.2)
    raise TimeoutError(f"router did not see {num_workers} workers")


def drive(target: str, concurrency: int, duration_s: float, max_tokens: int) -> tuple[int, int, float]:
    """`concurrency` closed-loop streams for `duration_s`; (output tokens, requests, wall s)."""
    stop = threading.Event()
    counts = [0] * concurrency
    requests = [0] * concurrency
    errors: list[str] = []

    def loop(i: int) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            n = 0
            while not stop.is_set():
                req = pb.GenerateRequest(
                    prompt=f"Stream {i}, request {n}: once upon a time",
                    stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
                )
                try:
                    for msg in stub.Generate(req, timeout=120):
                        counts[i] += len(msg.chunk.token_ids)
                    requests[i] += 1
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")
                n += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(duration_s)
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    return sum(counts), sum(requests), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4, help="worker actors (spread over 2 nodes)")
    p.add_argument("--concurrency", type=int, default=32, help="client streams")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    a = p.parse_args(argv)

    gpus_per_node = -(-a.workers // 2)
    with tempfile.TemporaryDirectory() as tmp, SimulatedCluster(2, gpus_per_node, cpus_per_node=1) as sim:
        model = write_tiny_llama(Path(tmp) / "tiny-llama")
        engine = EngineConfig(
            model=str(model), device="cpu", kv_cache_bytes=16 * 2**20, num_threads=1, max_num_seqs=64
        )
        launched = launch_workers(
            LaunchConfig(num_workers=a.workers, engine=engine, cpus_per_worker=2 / a.workers)
        )
        os.environ["LLM_WORKER_TOKEN"] = launched.token  # the launch's worker token; the child inherits it
        try:  # --model: the workers' model, so ids and tokenizer fingerprints match
            router = LocalProcess(
                "router",
                ["-m", "router", "--port", "0", "--ray-address", sim.address, "--model", str(model)],
                quiet=True,
            )
        finally:
            del os.environ["LLM_WORKER_TOKEN"]
        try:
            target = router.wait_listening(120)
            wait_workers(target, a.workers)
            pid = router.popen.pid
            drive(target, a.concurrency, 3.0, a.max_tokens)  # warm-up

            idle_start = cpu_s(pid)
            time.sleep(a.idle_s)
            idle_cores = (cpu_s(pid) - idle_start) / a.idle_s

            busy_start = cpu_s(pid)
            tokens, requests, wall_s = drive(target, a.concurrency, a.duration_s, a.max_tokens)
            busy_cores = (cpu_s(pid) - busy_start) / wall_s
        finally:
            router.stop()
        del launched
    tokens_per_s = tokens / wall_s
    per_token_cores = busy_cores - idle_cores
    result = {
        "workers": a.workers,
        "concurrency": a.concurrency,
        "max_tokens": a.max_tokens,
        "output_tokens_per_s": tokens_per_s,
        "requests_per_s": requests / wall_s,
        "router_cores_busy": busy_cores,
        "router_cores_idle": idle_cores,
        "router_cores_per_1k_tokens_per_s": 1000 * per_token_cores / tokens_per_s,
        "router_idle_cores_per_worker": idle_cores / a.workers,
        "cpu_count": os.cpu_count(),
    }
    print(
        f"| workers | streams | output tok/s | router cores (busy) | router cores (idle) "
        f"| router cores per 1k tok/s | idle cores per worker |\n|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {a.workers} | {a.concurrency} | {tokens_per_s:.0f} | {busy_cores:.3f} | {idle_cores:.4f} "
        f"| {result['router_cores_per_1k_tokens_per_s']:.3f} "
        f"| {result['router_idle_cores_per_worker']:.5f} |"
    )
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
