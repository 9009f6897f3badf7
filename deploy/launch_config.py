"""What a Ray launch starts (deploy/ray_launch.py): `LaunchConfig`, checked before anything is placed.

Contract
- `LaunchConfig`: how many workers, what each reserves (`cpus_per_worker`, `use_gpus`: None = when
  the cluster has GPUs), placement (`placement_strategy` in STRATEGIES, default SPREAD), restart
  policy (`max_restarts`, -1 = unlimited), `detached`, `ready_timeout_s`, the engine each serves
  and the rest of its worker-server settings (`host` (NODE_IP = the node's own IP),
  `drain_grace_s`, `tls` = (cert, key, client CA) paths valid on every node, `server_options`: any
  other `WorkerServerConfig` field by name), `env` for the actor processes. Its field metadata
  makes the launcher's placement flags (common.config_cli).
- `worker_values(host)` -> the `WorkerServerConfig` fields of each worker (port 0; with TLS,
  /metrics served over HTTPS with the same certificate); `check()` builds one worker's config here
  with the file paths left out, so that a bad value fails before anything is placed.
- Frozen: no state.
- failure modes: ValueError from the constructor for num_workers < 1, an unknown strategy, no CPU
  for a CPU worker, server_options that set a LaunchConfig field, half a TLS pair, a non-loopback
  host (node-ip) without mutual TLS, a worker token or --allow-insecure-public (common.public_bind);
  `check()` raises what `construct(WorkerServerConfig, ...)` raises.
- proven by: tests/test_config_launchers.py (every worker flag and variable reaches the actors' config),
  tests/test_deploy_manifests.py (the manifests' launch settings, the public-bind refusals).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config_cli import construct, option
from common.public_bind import refusal, worker_missing
from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
NODE_IP = "node-ip"  # `host` value: bind and advertise the IP of the node the actor runs on


_GPUS = {"auto": None, "yes": True, "no": False}
FILE_FIELDS = ("tls_cert", "tls_key", "tls_client_ca")


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
        reserved = {"engine", "host", "port", "drain_grace_s", *FILE_FIELDS} & set(self.server_options)
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

    @property
    def stop_timeout_s(self) -> float:
        """How long a worker's stop() may take: its drain announcement, its grace for open
        streams, and 15 s for the server and the engine to stop."""
        announce = self.server_options.get("drain_announce_s", WorkerServerConfig.drain_announce_s)
        return float(announce) + self.drain_grace_s + 15.0

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
        values = {k: v for k, v in self.worker_values("127.0.0.1").items() if k not in FILE_FIELDS}
        telemetry = values.get("telemetry", {})
        if isinstance(telemetry, Mapping):
            values["telemetry"] = {k: v for k, v in telemetry.items() if not k.startswith("metrics_tls_")}
        construct(WorkerServerConfig, values)
