"""Ray launch site: worker actors that Ray places, restarts and lets routers find.

Contract
- input: a `LaunchConfig` (deploy/launch_config.py: how many workers, what each reserves,
  placement, restart policy, the engine each serves and the rest of its worker-server settings);
  Ray already connected
  (`ray.init`, local or `address=...`). From the command line (`python -m deploy.ray_launch`)
  every `python -m worker` flag is accepted (EngineConfig and WorkerServerConfig metadata through
  common.config_cli, `LLM_*` variables too) except --port: actors serve on ephemeral ports.
- output: `launch_workers` starts the missing named actors `<prefix><i>` in `namespace` and
  returns their handles and `"host:port"` addresses once every one serves (non-detached actors
  die with their last handle, so the caller keeps the result). Each actor is `WorkerActor`
  (deploy/worker_actor.py): the plain
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
  tests/test_config_launchers.py (every worker flag and variable reaches the actors' config),
  tests/test_ray_serve.py (actors export spans from the launcher's OTEL_* environment).

Only the actor process imports torch; the launching driver (and a router in the same process, as
in `make serve`) does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.auth import new_token
from common.config_cli import Flags, new_parser, option, parse_or_exit
from common.logs import setup_logging
from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE, list_worker_names, worker_name
from common.telemetry import standard_env
from deploy.launch_config import FILE_FIELDS, NODE_IP, LaunchConfig
from deploy.worker_actor import WorkerActor
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

log = logging.getLogger(__name__)
REPO = pathlib.Path(__file__).resolve().parents[1]


def ray_process_env() -> None:
    """Environment for the Ray processes this process starts (a local instance or a simulated
    cluster): the repo importable, since actors unpickle `WorkerActor` by module name, and no
    usage-stats reporting."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


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
    """Stops every worker `<name_prefix>*` in `namespace` (draining first, for at most `timeout_s`:
    pass the launch's `LaunchConfig.stop_timeout_s`, or open streams are cut at 30 s) and frees
    their placement groups; returns the names stopped."""
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
    tls = tuple(values.pop(name, None) for name in FILE_FIELDS)
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
        stopped = stop_workers(config.namespace, config.name_prefix, timeout_s=config.stop_timeout_s)
        print(f"stopped: {', '.join(stopped) or 'none'}")
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
