"""Ray launch site: worker actors that Ray places, restarts and lets routers find.

Contract
- input: a `LaunchConfig` (how many workers, what each reserves, placement, restart policy, the
  engine each serves and the rest of its worker-server settings); Ray already connected
  (`ray.init`, local or `address=...`). From the command line (`python -m deploy.ray_launch`)
  every `python -m worker` flag is accepted (EngineConfig and WorkerServerConfig metadata through
  common.config_cli, `LLM_*` variables too) except --port: actors serve on ephemeral ports.
- output: `launch_workers` starts the missing named actors `<prefix><i>` in `namespace` and
  returns their handles and `"host:port"` addresses once every one serves (non-detached actors
  die with their last handle, so the caller keeps the result). Each actor is `WorkerActor`: the plain
  worker gRPC server (`worker.server.serve`) on a thread of the actor's process, its
  `WorkerServerConfig` built there (TLS paths need only exist on the nodes); `address()` answers
  where it serves. `stop_workers` kills them and frees their placement groups.
- authentication: every launch has a worker token (`--worker-token` / `LLM_WORKER_TOKEN`, or one
  `launch_workers` makes, returned as `Workers.token`); the workers refuse llm.v1.Worker calls
  without it (common.auth). The command-line launch (detached workers for separate routers)
  refuses to start without one: on Kubernetes it comes from the llm-worker-token Secret.
- telemetry: the launching process's OTEL_* variables reach every actor (Ray `runtime_env`), and
  the endpoint they name is also set explicitly in the actors' TelemetryConfig (as are
  --otlp-endpoint, --trace-* and --log-format when given).
- resources: one GPU per worker when the cluster has GPUs (`num_gpus=1`; the engine then runs on
  the GPU Ray assigned), otherwise `cpus_per_worker` CPUs; one placement-group bundle per worker,
  strategy SPREAD by default so workers spread across nodes. Tensor parallel (engine
  `tensor_parallel_size` N): the worker's bundle and actor take N GPUs, so Ray places the whole
  group on one node (a bundle never spans nodes), and the actor's process starts ranks 1..N-1 as
  its own processes on the GPUs Ray made visible to it (worker/tp/, docs/tensor-parallel.md);
  `cpus_per_worker` is the whole group's.
- state: in Ray only (named actors, one placement group per launch call); none here.
- failure modes: a non-loopback host (node-ip) without mutual TLS, a worker token or
  --allow-insecure-public ->
  ValueError (common.public_bind), before anything starts. A worker process that dies is restarted
  by Ray (`max_restarts`, default unlimited) in the same bundle; it reloads the model and serves on
  a new port, which routers learn from `address()`. A failing constructor (bad model path, cannot
  bind) is final: Ray does not restart failed constructors. Bundles that cannot be placed within
  `ready_timeout_s` -> TimeoutError naming the bundle, the strategy and the cluster's resources.
- proven by: tests/test_ray_cluster.py (placement 2 per node on fake GPUs, restart, discovery),
  tests/test_tp_ray.py (TP=2 groups on fake GPUs: each group on one node, two groups on two nodes),
  tests/test_config_cli.py (every worker flag and variable reaches the actors' config),
  tests/test_ray_serve.py (actors export spans from the launcher's OTEL_* environment).

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.auth import new_token
from common.config_cli import Flags, construct, new_parser, option, parse_or_exit
from common.logs import setup_logging
from common.net import bind_address
from common.public_bind import refusal, worker_missing
from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE, list_worker_names, worker_name
from common.telemetry import standard_env
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

log = logging.getLogger(__name__)
REPO = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
NODE_IP = "node-ip"  # `host` value: bind and advertise the IP of the node the actor runs on


_GPUS = {"auto": None, "yes": True, "no": False}
_FILE_FIELDS = ("tls_cert", "tls_key", "tls_client_ca")


@dataclass(frozen=True)
class LaunchConfig:
    """What to launch. `engine`, `host`, `drain_grace_s` and `tls` are the worker settings code
    sets most; `server_options` holds any other `WorkerServerConfig` field by name (nested
    `telemetry` as a dict or a TelemetryConfig). The field metadata makes the placement flags."""

    num_workers: int = field(default=1, metadata=option("worker actors to run"))
    engine: EngineConfig = EngineConfig()
    host: str = "127.0.0.1"  # or NODE_IP (cluster mode)
    drain_grace_s: float = WorkerServerConfig.drain_grace_s
    namespace: str = field(
        default=DEFAULT_NAMESPACE,
        metadata=option(
            "Ray namespace the worker actors are named in", flag="ray-namespace", aliases=("namespace",)
        ),
    )
    name_prefix: str = field(
        default=DEFAULT_NAME_PREFIX,
        metadata=option("worker actor names: <prefix><index> (routers list <prefix>*)"),
    )
    use_gpus: bool | None = field(
        default=None,
        metadata=option(
            "one GPU per worker: auto = when the cluster has GPUs",
            flag="gpus",
            choices=tuple(_GPUS),
            parse=_GPUS.__getitem__,
            format=lambda v: next(k for k, g in _GPUS.items() if g is v),
        ),
    )
    cpus_per_worker: float = field(
        default=1.0, metadata=option("CPUs each worker reserves (fractions allowed)")
    )
    placement_strategy: str = field(
        default="SPREAD",
        metadata=option("placement group strategy of the workers' bundles", choices=STRATEGIES),
    )
    max_restarts: int = field(
        default=-1, metadata=option("restarts of a dead worker process; -1 = unlimited")
    )
    detached: bool = False  # outlive the launching driver (cluster mode)
    ready_timeout_s: float = field(
        default=600.0, metadata=option("placement + model load deadline of each launch")
    )
    tls: tuple[str, str, str | None] | None = None  # (cert, key, client CA) PEM paths valid on every
    # node: workers serve (mutual) TLS
    server_options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # extra variables for the actor processes

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {STRATEGIES}, got {self.placement_strategy!r}"
            )
        if self.cpus_per_worker < 0:
            raise ValueError("cpus_per_worker must be >= 0")
        if self.use_gpus is False and self.cpus_per_worker == 0:
            raise ValueError("a CPU worker must reserve some CPU (cpus_per_worker > 0)")
        reserved = {"engine", "host", "port", "drain_grace_s", *_FILE_FIELDS} & set(self.server_options)
        if reserved:
            raise ValueError(f"server_options cannot set {sorted(reserved)} (LaunchConfig fields; port is 0)")
        cert, key, client_ca = self.tls or (None, None, None)
        if (cert is None) != (key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        problem = refusal(
            self.host,
            worker_missing(
                self.host,
                bool(self.server_options.get("allow_insecure_public")),
                cert,
                key,
                client_ca,
                self.server_options.get("worker_token"),
            ),
            "worker",
        )
        if problem:
            raise ValueError(problem)

    def worker_values(self, host: str) -> dict:
        """The `WorkerServerConfig` fields of each worker (`construct` builds it, on the node)."""
        cert, key, client_ca = self.tls or (None, None, None)
        values = {
            **self.server_options,
            "engine": self.engine,
            "host": host,
            "port": 0,
            "drain_grace_s": self.drain_grace_s,
            "tls_cert": cert,
            "tls_key": key,
            "tls_client_ca": client_ca,
        }
        telemetry = values.get("telemetry", {})
        if cert and isinstance(telemetry, Mapping) and "metrics_tls_cert" not in telemetry:
            # With TLS, /metrics is HTTPS with the same certificate (scrapers trust the CA; no client
            # certificate needed there, so Prometheus needs only `scheme: https` and the CA).
            values["telemetry"] = {**telemetry, "metrics_tls_cert": cert, "metrics_tls_key": key}
        return values

    def check(self) -> None:
        """Builds one worker's config here with the file paths left out (they need to exist only
        on the nodes), so that a bad value fails before anything is placed."""
        values = {k: v for k, v in self.worker_values("127.0.0.1").items() if k not in _FILE_FIELDS}
        telemetry = values.get("telemetry", {})
        if isinstance(telemetry, Mapping):
            values["telemetry"] = {k: v for k, v in telemetry.items() if not k.startswith("metrics_tls_")}
        construct(WorkerServerConfig, values)


def ray_process_env() -> None:
    """Environment for the Ray processes this process starts (a local instance or a simulated
    cluster): the repo importable, since actors unpickle `WorkerActor` by module name, and no
    usage-stats reporting."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class WorkerActor:
    """One worker: the gRPC server on its own thread and event loop (Ray owns the main thread).
    `server_options`: further `WorkerServerConfig` fields (see `LaunchConfig`)."""

    def __init__(
        self,
        engine: EngineConfig,
        host: str = "127.0.0.1",
        drain_grace_s: float = WorkerServerConfig.drain_grace_s,
        ready_timeout_s: float = 600.0,
        tls: tuple[str, str, str | None] | None = None,
        server_options: Mapping[str, Any] | None = None,
    ):
        launch = LaunchConfig(
            engine=engine,
            host=host,
            drain_grace_s=drain_grace_s,
            tls=tls,
            server_options=dict(server_options or {}),
        )
        if host == NODE_IP:
            import ray

            host = ray.util.get_node_ip_address()
        self._config: WorkerServerConfig = construct(WorkerServerConfig, launch.worker_values(host))
        setup_logging("worker", self._config.telemetry.log_format)
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
        except BaseException as exc:  # noqa: BLE001 - SystemExit too (cannot bind): report it
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

    handles: dict  # name -> ActorHandle
    addresses: dict[str, str]
    token: str | None = None  # the worker token their routers must send (common.auth)


def with_worker_token(config: LaunchConfig) -> LaunchConfig:
    """`config` with a worker token: the one given (--worker-token / LLM_WORKER_TOKEN), else a new
    one for this deployment, so that workers Ray launches always authenticate their callers."""
    if config.server_options.get("worker_token"):
        return config
    return dataclasses.replace(config, server_options={**config.server_options, "worker_token": new_token()})


def actor_env(config: LaunchConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables every actor process gets: this process's OTEL_* (the SDK's own settings:
    endpoint, headers, batch delays...), then `config.env`."""
    return {**standard_env(environ), **config.env}


def launch_workers(config: LaunchConfig) -> Workers:
    """Starts the workers of `config` that are not already running and waits until all serve.
    Without a worker token in `config.server_options` one is made (`Workers.token`); workers
    already running keep the token they started with, so a re-launch must pass the same one."""
    config = with_worker_token(config)
    config.check()
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    use_gpus = _cluster_has_gpus() if config.use_gpus is None else config.use_gpus
    names = [worker_name(config.name_prefix, i) for i in range(config.num_workers)]
    handles = {n: _existing(n, config.namespace) for n in names}
    missing = [n for n, h in handles.items() if h is None]
    lifetime = "detached" if config.detached else None
    tp = config.engine.tensor_parallel_size  # a TP worker's N devices: one bundle, one node
    bundle = {"GPU": float(tp)} if use_gpus else {}
    if config.cpus_per_worker > 0:
        bundle["CPU"] = config.cpus_per_worker
    if missing:
        group = placement_group(
            [dict(bundle) for _ in missing],
            strategy=config.placement_strategy,
            name=f"{config.name_prefix}group-{uuid.uuid4().hex[:8]}",
            lifetime=lifetime,
        )
        ready, _ = ray.wait([group.ready()], timeout=config.ready_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise TimeoutError(
                f"cannot place {len(missing)} x {bundle} ({config.placement_strategy}) "
                f"within {config.ready_timeout_s} s; cluster has {ray.cluster_resources()}"
            )
        actor_cls = ray.remote(WorkerActor)
        env = actor_env(config)
        for index, name in enumerate(missing):
            handles[name] = actor_cls.options(
                name=name,
                namespace=config.namespace,
                lifetime=lifetime,
                max_restarts=config.max_restarts,
                num_gpus=tp if use_gpus else 0,
                num_cpus=config.cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index
                ),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(
                config.engine,
                config.host,
                config.drain_grace_s,
                config.ready_timeout_s,
                config.tls,
                dict(config.server_options),
            )
        log.info("launched %d worker(s) (%s each, %s)", len(missing), bundle, config.placement_strategy)
    addresses = ray.get([h.address.remote() for h in handles.values()], timeout=config.ready_timeout_s)
    return Workers(handles, dict(zip(names, addresses)), config.server_options["worker_token"])


def stop_workers(
    namespace: str = DEFAULT_NAMESPACE,
    name_prefix: str = DEFAULT_NAME_PREFIX,
    drain: bool = True,
    timeout_s: float = 30.0,
) -> list[str]:
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
            except ValueError:  # created in another namespace (by another launcher): not ours
                pass
    return names


@dataclass(frozen=True)
class Command:
    """What `python -m deploy.ray_launch` does besides the launch settings."""

    ray_address: str = field(
        default="auto",
        metadata=option(
            "Ray cluster: auto, HOST:PORT (GCS) or ray://HOST:10001 (Ray Client)", metavar="ADDRESS"
        ),
    )
    stop: bool = field(
        default=False,
        metadata=option("stop the workers of --ray-namespace instead of starting them", negative=()),
    )
    allow_no_worker_token: bool = field(
        default=False,
        metadata=option(
            "start detached workers without --worker-token / LLM_WORKER_TOKEN: each launch then makes "
            "its own token, which no separate router knows (tests only)",
            negative=(),
        ),
    )


def parser() -> tuple[argparse.ArgumentParser, Flags, Flags, Flags, Flags]:
    """The launcher's flags: the command, placement, and every worker flag but --port."""
    p = new_parser("python -m deploy.ray_launch", "start (or --stop) Ray worker actors in a cluster")
    command = Flags(p, Command, title="cluster")
    launch = Flags(p, LaunchConfig, title="placement")
    engine = Flags(p, EngineConfig, title="engine")
    server = Flags(
        p,
        WorkerServerConfig,
        exclude=("engine", "port"),
        defaults={"host": NODE_IP},
        title=f"worker server (--host {NODE_IP}: the IP of the node each actor runs on)",
    )
    return p, command, launch, engine, server


def launch_config(
    ns: argparse.Namespace, launch: Flags, engine: Flags, server: Flags, **fixed
) -> LaunchConfig:
    """A LaunchConfig from the launcher flags (shared with deploy/local.py)."""
    values = server.values(ns)
    tls = tuple(values.pop(name, None) for name in _FILE_FIELDS)
    host = values.pop("host", LaunchConfig.host)
    drain_grace_s = values.pop("drain_grace_s", LaunchConfig.drain_grace_s)
    config = launch.build(
        ns,
        engine=engine.build(ns),
        host=host,
        drain_grace_s=drain_grace_s,
        tls=tls if any(tls) else None,
        server_options=values,
        **fixed,
    )
    config.check()
    return config


def parse_args(argv: list[str] | None = None) -> tuple[Command, LaunchConfig]:
    p, command, launch, engine, server = parser()
    return parse_or_exit(
        p, argv, lambda ns: (command.build(ns), launch_config(ns, launch, engine, server, detached=True))
    )


def main(argv: list[str] | None = None) -> int:
    """Cluster mode: start detached workers (they outlive this command), print where they serve."""
    import ray

    command, config = parse_args(argv)
    setup_logging("launch", config.server_options.get("telemetry", {}).get("log_format", "text"))
    ray.init(address=command.ray_address, namespace=config.namespace, log_to_driver=False)
    if command.stop:
        print(f"stopped: {', '.join(stop_workers(config.namespace, config.name_prefix)) or 'none'}")
        return 0
    if not config.server_options.get("worker_token") and not command.allow_no_worker_token:
        print(
            "refusing to start workers without a worker token: set LLM_WORKER_TOKEN (on Kubernetes "
            "from the llm-worker-token Secret, deploy/kuberay/) to the value the routers get",
            file=sys.stderr,
        )
        return 2
    for name, address in launch_workers(config).addresses.items():
        print(f"{name} listening on {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
