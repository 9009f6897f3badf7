"""Ray launch site: worker actors that Ray places, restarts and lets routers find.

Contract
- input: a `LaunchConfig` (how many workers, what each reserves, placement, restart policy, the
  engine each serves); Ray already connected (`ray.init`, local or `address=...`).
- output: `launch_workers` starts the missing named actors `<prefix><i>` in `namespace` and
  returns their handles and `"host:port"` addresses once every one serves (non-detached actors
  die with their last handle, so the caller keeps the result). Each actor is `WorkerActor`: the plain
  worker gRPC server (`worker.server.serve`) on a thread of the actor's process; `address()`
  answers where it serves. `stop_workers` kills them and frees their placement groups.
- resources: one GPU per worker when the cluster has GPUs (`num_gpus=1`; the engine then runs on
  the GPU Ray assigned), otherwise `cpus_per_worker` CPUs; one placement-group bundle per worker,
  strategy SPREAD by default so workers spread across nodes. A worker on several GPUs (tensor
  parallel) is out of scope: the engine runs one device.
- state: in Ray only (named actors, one placement group per launch call); none here.
- failure modes: a worker process that dies is restarted by Ray (`max_restarts`, default
  unlimited) in the same bundle; it reloads the model and serves on a new port, which routers
  learn from `address()`. A failing constructor (bad model path, cannot bind) is final: Ray does
  not restart failed constructors. Bundles that cannot be placed within `ready_timeout_s` ->
  TimeoutError naming the bundle, the strategy and the cluster's resources.
- proven by: tests/test_ray_cluster.py (placement 2 per node on fake GPUs, restart, discovery).

Only the actor process imports torch; the launching driver (and a router in the same process, as
in `make serve`) does not.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pathlib
import sys
import threading
import uuid
from dataclasses import dataclass

from common.net import bind_address, is_loopback_host
from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE, list_worker_names, worker_name
from worker.config import EngineConfig

log = logging.getLogger(__name__)
REPO = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
NODE_IP = "node-ip"       # `host` value: bind and advertise the IP of the node the actor runs on


@dataclass(frozen=True)
class LaunchConfig:
    num_workers: int
    engine: EngineConfig = EngineConfig(device="auto")
    host: str = "127.0.0.1"                # or NODE_IP (cluster mode)
    drain_grace_s: float = 10.0
    namespace: str = DEFAULT_NAMESPACE
    name_prefix: str = DEFAULT_NAME_PREFIX
    use_gpus: bool | None = None           # None: one GPU per worker iff the cluster has GPUs
    cpus_per_worker: float = 1.0           # CPUs reserved per worker; fractions allowed
    placement_strategy: str = "SPREAD"
    max_restarts: int = -1                 # -1: restart a dead worker process without limit
    detached: bool = False                 # outlive the launching driver (cluster mode)
    ready_timeout_s: float = 600.0         # placement + model load
    tls: tuple[str, str, str] | None = None  # (cert, key, client CA) PEM paths valid on every node:
                                             # workers serve mutual TLS (routers: --worker-tls-*)

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, "
                             f"got {self.placement_strategy!r}")
        if self.cpus_per_worker < 0:
            raise ValueError("cpus_per_worker must be >= 0")
        if self.use_gpus is False and self.cpus_per_worker == 0:
            raise ValueError("a CPU worker must reserve some CPU (cpus_per_worker > 0)")


def ray_process_env() -> None:
    """Environment for the Ray processes this process starts (a local instance or a simulated
    cluster): the repo importable, since actors unpickle `WorkerActor` by module name, and no
    usage-stats reporting."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def resolve_device(engine: EngineConfig) -> EngineConfig:
    """`device="auto"`: the GPU Ray assigned to this process when there is one, else the CPU."""
    if engine.device != "auto":
        return engine
    import torch

    return dataclasses.replace(engine, device="cuda" if torch.cuda.is_available() else "cpu")


class WorkerActor:
    """One worker: the gRPC server on its own thread and event loop (Ray owns the main thread)."""

    def __init__(self, engine: EngineConfig, host: str = "127.0.0.1", drain_grace_s: float = 10.0,
                 ready_timeout_s: float = 600.0, tls: tuple[str, str, str] | None = None):
        from worker.server import WorkerServerConfig

        logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
        if host == NODE_IP:
            import ray

            host = ray.util.get_node_ip_address()
        from common.telemetry import TelemetryConfig

        cert, key, client_ca = tls or (None, None, None)
        # With TLS, /metrics is HTTPS with the same certificate (scrapers trust the CA; no client
        # certificate needed there, so Prometheus needs only `scheme: https` and the CA).
        self._config = WorkerServerConfig(engine=resolve_device(engine), host=host, port=0,
                                          drain_grace_s=drain_grace_s, tls_cert=cert, tls_key=key,
                                          tls_client_ca=client_ca,
                                          telemetry=TelemetryConfig(metrics_tls_cert=cert, metrics_tls_key=key))
        self._port: int | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(ready_timeout_s):
            raise TimeoutError(f"worker did not start serving within {ready_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"worker failed to start: {self._error!r}") from self._error

    def _run(self) -> None:
        from worker.server import serve

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve(self._config, stop=self._stop, on_listening=self._on_listening)

        try:
            asyncio.run(main())
        except BaseException as exc:   # noqa: BLE001 - SystemExit too (cannot bind): report it
            self._error = exc
            log.exception("worker server failed")
        finally:
            started = self._ready.is_set()
            self._ready.set()
        if started and not self._stopping:
            # The server died under a live actor: end the process so that Ray restarts it.
            os._exit(1)

    def _on_listening(self, port: int) -> None:
        self._port = port
        self._ready.set()

    def address(self) -> str:
        return bind_address(self._config.host, self._port)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        """Drains in-flight streams (`drain_grace_s`), then stops the server and the engine."""
        self._stopping = True
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self._config.drain_grace_s + 15)


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def _existing(name: str, namespace: str):
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


@dataclass
class Workers:
    """The launched workers. Non-detached actors live only while their handles do: keep this."""
    handles: dict          # name -> ActorHandle
    addresses: dict[str, str]


def launch_workers(config: LaunchConfig) -> Workers:
    """Starts the workers of `config` that are not already running and waits until all serve."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    use_gpus = _cluster_has_gpus() if config.use_gpus is None else config.use_gpus
    names = [worker_name(config.name_prefix, i) for i in range(config.num_workers)]
    handles = {n: _existing(n, config.namespace) for n in names}
    missing = [n for n, h in handles.items() if h is None]
    lifetime = "detached" if config.detached else None
    bundle = {"GPU": 1.0} if use_gpus else {}
    if config.cpus_per_worker > 0:
        bundle["CPU"] = config.cpus_per_worker
    if missing:
        group = placement_group([dict(bundle) for _ in missing], strategy=config.placement_strategy,
                                name=f"{config.name_prefix}group-{uuid.uuid4().hex[:8]}", lifetime=lifetime)
        ready, _ = ray.wait([group.ready()], timeout=config.ready_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise TimeoutError(f"cannot place {len(missing)} x {bundle} ({config.placement_strategy}) "
                               f"within {config.ready_timeout_s} s; cluster has {ray.cluster_resources()}")
        actor_cls = ray.remote(WorkerActor)
        for index, name in enumerate(missing):
            handles[name] = actor_cls.options(
                name=name, namespace=config.namespace, lifetime=lifetime,
                max_restarts=config.max_restarts, num_gpus=1 if use_gpus else 0,
                num_cpus=config.cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index),
            ).remote(config.engine, config.host, config.drain_grace_s, config.ready_timeout_s, config.tls)
        log.info("launched %d worker(s) (%s each, %s)", len(missing), bundle, config.placement_strategy)
    addresses = ray.get([h.address.remote() for h in handles.values()], timeout=config.ready_timeout_s)
    return Workers(handles, dict(zip(names, addresses)))


def stop_workers(namespace: str = DEFAULT_NAMESPACE, name_prefix: str = DEFAULT_NAME_PREFIX,
                 drain: bool = True, timeout_s: float = 30.0) -> list[str]:
    """Stops every worker `<name_prefix>*` in `namespace` (draining first) and frees their
    placement groups; returns the names stopped."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    names = list_worker_names(namespace, name_prefix)
    actors = [ray.get_actor(n, namespace=namespace) for n in names]
    if drain and actors:
        ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for group in ray.util.placement_group_table().values():
        if group.get("name", "").startswith(f"{name_prefix}group-") and group.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(group["name"]))
            except ValueError:   # created in another namespace (by another launcher): not ours
                pass
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, LaunchConfig]:
    p = argparse.ArgumentParser(prog="python -m deploy.ray_launch",
                                description="start (or --stop) Ray worker actors in a cluster")
    p.add_argument("--ray-address", default="auto", help="Ray cluster (auto, HOST:PORT or ray://HOST:10001)")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    p.add_argument("--stop", action="store_true", help="stop the workers of --namespace instead")
    p.add_argument("--host", default=NODE_IP, help=f"bind address; {NODE_IP} = the actor's node IP")
    p.add_argument("--allow-insecure-public", action="store_true",
                   help="bind a non-loopback address without mutual TLS (a private network only)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate of the workers (path on every node)")
    p.add_argument("--tls-key", default=None, help="its PEM private key (path on every node)")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA that signs the routers' client certificates (mutual TLS)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--gpus", choices=("auto", "yes", "no"), default="auto",
                   help="one GPU per worker: auto = when the cluster has GPUs")
    p.add_argument("--placement-strategy", choices=STRATEGIES, default="SPREAD")
    p.add_argument("--max-restarts", type=int, default=-1, help="-1 = unlimited")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF dir on every node (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--kv-cache-mb", type=float, default=None, help="KV budget on CPU, MiB")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    a = p.parse_args(argv)
    public = a.host == NODE_IP or not is_loopback_host(a.host)
    tls = (a.tls_cert, a.tls_key, a.tls_client_ca)
    if any(tls) and not all(tls):
        p.error("mutual TLS needs all of --tls-cert, --tls-key and --tls-client-ca")
    if public and not all(tls) and not a.allow_insecure_public:
        p.error("workers on node IPs are reachable from the network: give them mutual TLS "
                "(--tls-cert, --tls-key, --tls-client-ca) or pass --allow-insecure-public on a private "
                "network (or --host 127.0.0.1)")
    overrides = {k: v for k, v in {
        "kv_cache_bytes": None if a.kv_cache_mb is None else int(a.kv_cache_mb * 2**20),
        "max_num_seqs": a.max_num_seqs, "num_threads": a.num_threads}.items() if v is not None}
    engine = EngineConfig(model=a.model, dtype=a.dtype, device=a.device, **overrides)
    config = LaunchConfig(
        num_workers=a.num_workers, engine=engine, host=a.host, namespace=a.namespace,
        use_gpus={"auto": None, "yes": True, "no": False}[a.gpus], cpus_per_worker=a.cpus_per_worker,
        placement_strategy=a.placement_strategy, max_restarts=a.max_restarts, detached=True,
        tls=tls if all(tls) else None)
    return a, config


def main(argv: list[str] | None = None) -> int:
    """Cluster mode: start detached workers (they outlive this command), print where they serve."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(levelname)s %(message)s")
    a, config = parse_args(argv)
    ray.init(address=a.ray_address, namespace=config.namespace, log_to_driver=False)
    if a.stop:
        print(f"stopped: {', '.join(stop_workers(config.namespace, config.name_prefix)) or 'none'}")
        return 0
    for name, address in launch_workers(config).addresses.items():
        print(f"{name} listening on {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
