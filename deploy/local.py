"""`make serve`: Ray in this process, N worker actors, and the router on 127.0.0.1:50051.

Contract
- input: command line (`--workers N`, default: one per GPU, otherwise one per two CPU cores, at
  least one; `--port`, `--model`, `--kv-cache-mb`).
- output: starts a local Ray instance in-process (no dashboard, no other services), launches the
  workers with deploy/ray_launch.py, then serves the router in this process with Ray discovery
  (the same code path as `python -m router --ray-address ...` on a cluster). Prints how to try it
  and the Ray address another router can join with. Ctrl-C / SIGTERM: the router drains, the
  workers drain and stop, Ray shuts down; exit status 0.
- state: the Ray instance and the worker actors, for the life of the process.
- failure modes: a worker that cannot start -> the error is printed, everything is torn down,
  exit status 1. A signal during start-up tears down what was started.
- proven by: tests/test_ray_serve.py.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from common.ray_names import DEFAULT_NAMESPACE
from deploy.ray_launch import LaunchConfig, launch_workers, ray_process_env, stop_workers
from router.config import RouterConfig
from worker.config import EngineConfig

log = logging.getLogger(__name__)


def default_num_workers(num_gpus: int, num_cpus: int) -> int:
    """One worker per GPU; on CPU one per two cores (a worker wants two torch threads for its
    matmuls, and the router needs some CPU too)."""
    return num_gpus if num_gpus else max(1, num_cpus // 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.local",
                                description="local Ray + worker actors + router, one command")
    p.add_argument("--port", type=int, default=50051, help="router port (0 = ephemeral)")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU, else cores // 2")
    p.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-mb", type=float, default=256, help="KV budget per CPU worker, MiB")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import ray

    from router.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    a = parse_args(argv)
    # Until the router's drain handler is installed, SIGTERM unwinds like Ctrl-C (see finally).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    num_cpus = os.cpu_count() or 1
    ray_process_env()
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=a.namespace,
                 logging_level=logging.WARNING)
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        num_workers = a.workers or default_num_workers(num_gpus, num_cpus)
        threads = None if num_gpus else max(1, num_cpus // num_workers)
        engine = EngineConfig(model=a.model, dtype=a.dtype, device="auto",
                              kv_cache_bytes=int(a.kv_cache_mb * 2**20), num_threads=threads)
        print(f"starting {num_workers} worker(s) on {'GPU' if num_gpus else 'CPU'} ...", flush=True)
        workers = launch_workers(LaunchConfig(
            num_workers=num_workers, engine=engine, namespace=a.namespace,
            cpus_per_worker=1.0 if num_gpus else num_cpus / num_workers))
        ray_address = ray.get_runtime_context().gcs_address
        target = f"127.0.0.1:{a.port}" if a.port else "<the router address printed below>"
        client = f".venv/bin/python -m router.client --target {target}"
        print(f"\nReady: workers on {', '.join(workers.addresses.values())}. Try:\n"
              f"  {client} --chat 'What is the capital of France?'\n"
              f"  {client} 'Once upon a time' --max-tokens 64\n"
              f"A second router over the same workers:\n"
              f"  .venv/bin/python -m router --port 50052 --ray-address {ray_address} "
              f"--ray-namespace {a.namespace}\n"
              "Ctrl-C stops everything.\n", flush=True)
        config = RouterConfig(port=a.port, model=a.model, ray_address=ray_address, ray_namespace=a.namespace)
        status = asyncio.run(serve(config))
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    except KeyboardInterrupt:
        status = 0
    except Exception as exc:  # noqa: BLE001 - e.g. a worker that failed to start: say so, tear down
        log.error("%s: %s", type(exc).__name__, exc)
        status = 1
    finally:
        if ray.is_initialized():
            stopped = stop_workers(a.namespace)
            ray.shutdown()
            print(f"stopped: router, workers {', '.join(stopped) or 'none'}, Ray", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
