"""`make serve`: Ray in this process, N worker actors, and the router on 127.0.0.1:50051.

Contract
- input: command line and `LLM_*` variables (common.config_cli): `--num-workers N` (`--workers`;
  default one per GPU, otherwise one per two CPU cores, at least one), every router flag but
  --workers/--ray-address/--model (`python -m router`'s, e.g. --port, --tenants), every engine
  flag (`python -m worker`'s, e.g. --model, --dtype, --kv-cache-mb, --max-model-len,
  --attention-backend, --enforce-eager, --no-prefix-caching), and the workers' own server
  settings as --worker-drain-grace-s, --worker-drain-announce-s, --worker-max-message-mb,
  --worker-stream-interval. The
  observability flags (and OTEL_* variables) apply to the router and the workers alike, except
  --metrics-*: workers serve /metrics on ephemeral loopback ports, which the router's /targets lists.
  `--model` is the workers' model and the router's tokenizer. Workers bind 127.0.0.1 (no TLS)
  and refuse calls without this deployment's worker token (common.auth; made at start, or
  LLM_WORKER_TOKEN's), which only the router holds.
- output: starts a local Ray instance in-process (no dashboard, no other services), launches the
  workers with deploy/ray_launch.py, then serves the router in this process with Ray discovery
  (the same code path as `python -m router --ray-address ...` on a cluster). Prints how to try it
  and the Ray address another router can join with. Ctrl-C / SIGTERM: the router drains, the
  workers drain and stop, Ray shuts down; exit status 0. A second one while the workers drain
  (`stop_stack`) stops them at once, and Ray still shuts down.
- state: the Ray instance and the worker actors, for the life of the process.
- failure modes: a bad flag or variable -> usage error (exit 2) before Ray starts; a worker that
  cannot start -> the error is printed, everything is torn down, exit status 1. A signal during
  start-up tears down what was started.
- proven by: tests/test_ray_serve.py (a streamed answer, spans from router and worker actor,
  LLM_* variables reaching the engine, the worker token, the clean stop), tests/test_config_launchers.py
  (flags and defaults), tests/test_local_interrupts.py (the second Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from common.auth import new_token
from common.config_cli import Flags, new_parser, option, parse_or_exit
from common.logs import setup_logging
from deploy.ray_launch import LaunchConfig, launch_workers, ray_process_env, stop_workers
from router.config import DEFAULT_HTTP_PORT, RouterConfig
from router.models import entries_for
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

log = logging.getLogger(__name__)
# Telemetry settings the workers share with the router (not its /metrics address or certificate).
SHARED_TELEMETRY = ("otlp_endpoint", "console", "sample_ratio", "log_format")
WORKER_SERVER_FLAGS = (
    "drain_grace_s",
    "drain_announce_s",
    "max_message_bytes",
    "stream_interval",
)  # --worker-*


@dataclass(frozen=True)
class Stack:
    num_workers: int | None = field(
        default=None,
        metadata=option(
            "worker actors (default: one per GPU, else one per two CPU cores)", aliases=("workers",)
        ),
    )


@dataclass(frozen=True)
class Plan:
    """Everything `make serve` starts, from the command line and the environment."""

    num_workers: int | None
    router: RouterConfig  # ray_address is set once Ray runs
    engine: EngineConfig
    worker_options: dict  # further WorkerServerConfig fields (LaunchConfig.server_options)


def default_num_workers(num_gpus: int, num_cpus: int) -> int:
    """One worker per GPU; on CPU one per two cores (a worker wants two torch threads for its
    matmuls, and the router needs some CPU too)."""
    return num_gpus if num_gpus else max(1, num_cpus // 2)


def parse_args(argv: list[str] | None = None) -> Plan:
    p = new_parser("python -m deploy.local", "local Ray + worker actors + router, one command")
    stack = Flags(p, Stack, title="stack")
    router = Flags(
        p,
        RouterConfig,
        exclude=("workers", "ray_address", "model", "allow_download"),
        aliases={"ray_namespace": ("--namespace",)},
        title="router",
    )
    engine = Flags(p, EngineConfig, title="engine (every worker)")
    server = Flags(
        p,
        WorkerServerConfig,
        prefix="worker-",
        exclude=[f.name for f in dataclasses.fields(WorkerServerConfig) if f.name not in WORKER_SERVER_FLAGS],
        title="worker server (every worker)",
    )

    def build(ns: argparse.Namespace) -> Plan:
        engine_config = engine.build(ns)
        models = entries_for(engine_config.model, engine_config.served_model_name)
        router_config = router.build(ns, model=models, allow_download=engine_config.allow_download)
        options = server.values(ns)
        telemetry = {name: getattr(router_config.telemetry, name) for name in SHARED_TELEMETRY}
        options["telemetry"] = {
            k: v for k, v in telemetry.items() if v != getattr(type(router_config.telemetry)(), k)
        }
        LaunchConfig(
            engine=engine_config,
            drain_grace_s=options.get("drain_grace_s", LaunchConfig.drain_grace_s),
            server_options={k: v for k, v in options.items() if k != "drain_grace_s"},
        ).check()
        return Plan(stack.build(ns).num_workers, router_config, engine_config, options)

    return parse_or_exit(p, argv, build)


def main(argv: list[str] | None = None) -> int:
    import ray

    from router.server import serve

    plan = parse_args(argv)
    setup_logging("serve", plan.router.telemetry.log_format)
    namespace = plan.router.ray_namespace
    # Until the router's drain handler is installed, SIGTERM unwinds like Ctrl-C (see finally).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    num_cpus = os.cpu_count() or 1
    ray_process_env()
    stop_timeout_s = LaunchConfig().stop_timeout_s  # the launch's own, once it is built
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            namespace=namespace,
            logging_level=logging.WARNING,
        )
        num_gpus = int(ray.cluster_resources().get("GPU", 0))
        tp = plan.engine.tensor_parallel_size  # a tensor-parallel worker spans tp GPUs / core shares
        num_workers = plan.num_workers or max(1, default_num_workers(num_gpus, num_cpus) // tp)
        options = dict(plan.worker_options)
        # One token per deployment (or LLM_WORKER_TOKEN's): the workers refuse calls without it.
        token = plan.router.worker_token or new_token()
        options["worker_token"] = token
        drain_grace_s = options.pop("drain_grace_s", LaunchConfig.drain_grace_s)
        print(f"starting {num_workers} worker(s) on {'GPU' if num_gpus else 'CPU'} ...", flush=True)
        # Each worker's torch threads = the CPUs it reserves (Ray sets OMP_NUM_THREADS from them).
        launch = LaunchConfig(
            num_workers=num_workers,
            engine=plan.engine,
            namespace=namespace,
            drain_grace_s=drain_grace_s,
            cpus_per_worker=1.0 if num_gpus else num_cpus / num_workers,
            server_options=options,
        )
        stop_timeout_s = launch.stop_timeout_s
        workers = launch_workers(launch)
        ray_address = ray.get_runtime_context().gcs_address
        port = plan.router.port
        target = f"{plan.router.host}:{port}" if port else "<the router address printed below>"
        client = f".venv/bin/python -m devtools.client --target {target}"
        http_port = plan.router.http_port  # None: 8000 (else announced below), 0: ephemeral, -1: off
        base = (
            f"http://{plan.router.http_host}:{http_port or DEFAULT_HTTP_PORT}"
            if http_port is None or http_port > 0
            else "<the 'HTTP API at' address printed below>"
        )
        curl = ""
        if http_port != -1:
            curl = f"  curl -s {base}/v1/models  (OpenAI-compatible API: docs/openai.md)\n"
        print(
            f"\nReady: workers on {', '.join(workers.addresses.values())}. Try:\n"
            f"  {client} --chat 'What is the capital of Germany?'\n"
            f"  {client} 'Once upon a time' --max-tokens 64\n{curl}"
            f"A second router over the same workers needs their token (set LLM_WORKER_TOKEN for both):\n"
            f"  LLM_WORKER_TOKEN=... .venv/bin/python -m router --port 50052 --ray-address {ray_address} "
            f"--ray-namespace {namespace}\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        router = dataclasses.replace(plan.router, ray_address=ray_address, worker_token=token)
        status = asyncio.run(serve(router))
    except KeyboardInterrupt:
        status = 0
    except Exception as exc:  # noqa: BLE001 - e.g. a worker that failed to start: say so, tear down
        log.error("%s: %s", type(exc).__name__, exc)
        status = 1
    finally:
        if ray.is_initialized():
            stopped = stop_stack(namespace, stop_timeout_s, ray.shutdown)
            print(f"stopped: router, workers {', '.join(stopped) or 'none'}, Ray", flush=True)
    return status


def stop_stack(namespace: str, stop_timeout_s: float, shutdown_ray: Callable[[], None]) -> list[str]:
    """The workers' drain (their grace, at most `stop_timeout_s`), then `shutdown_ray()`; the
    names of the workers stopped. A SIGINT or SIGTERM during the drain stops them at once instead."""
    # The router's event loop, closing, left SIGTERM at its default (death, without ray.shutdown).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        stopped = stop_workers(namespace, timeout_s=stop_timeout_s)
    except KeyboardInterrupt:  # a second Ctrl-C: the user will not wait; Ray must still go down
        stopped = stop_workers(namespace, drain=False)
    shutdown_ray()
    return stopped


if __name__ == "__main__":
    status = main()
    # Everything is stopped: skip the interpreter's final collection over every object torch, Ray and
    # the router allocated (0.6 s of a 2.5 s stop), as python -m worker / router do.
    gc.freeze()
    sys.exit(status)
