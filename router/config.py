"""Router configuration: one frozen dataclass, built from the command line in one place."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import telemetry
from common.net import is_loopback_host
from common.tls import check_files, check_server_files
from common.telemetry import TelemetryConfig
from common.ray_names import DEFAULT_NAMESPACE

DEFAULT_METRICS_PORT = 9464   # Prometheus /metrics and /targets; taken -> an ephemeral port
WORKER_TLS_FLAGS = ("--worker-tls-cert", "--worker-tls-key", "--worker-tls-ca")


@dataclass(frozen=True)
class Limits:
    """Request limits the validator enforces (model-independent ones; the context comes from workers)."""
    default_max_tokens: int = 256       # used when stopping.max_tokens is unset
    max_tokens_limit: int = 4096        # largest max_tokens a client may ask for
    max_stop_strings: int = 8
    max_stop_string_len: int = 64       # characters
    max_stop_token_ids: int = 64
    max_chat_messages: int = 256
    max_prompt_chars: int = 1_000_000   # refuse before tokenizing absurd inputs
    max_request_id_len: int = 128

    def __post_init__(self) -> None:
        assert 1 <= self.default_max_tokens <= self.max_tokens_limit
        assert self.max_stop_strings >= 0 and self.max_stop_string_len >= 1


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    workers: tuple[str, ...] = ()             # static registry: host:port of each worker
    ray_address: str | None = None            # also discover worker actors in this Ray cluster
    ray_namespace: str = DEFAULT_NAMESPACE    # the Ray namespace the worker actors are named in
    model: str | None = None                  # tokenizer source (GGUF path); None = embedded model
    tenants_file: str | None = None
    allow_insecure_public: bool = False
    drain_grace_s: float = 30.0               # SIGTERM: how long in-flight streams may finish
    health_poll_s: float = 1.0                # worker health/load probe period
    health_timeout_s: float = 1.0             # each probe call's deadline (a hung worker fails it)
    down_after_probes: int = 2                # failed probes in a row -> worker down, its streams cancelled
    breaker_failures: int = 3                 # failed calls in a row -> circuit open (no traffic) ...
    breaker_cooldown_s: float = 2.0           # ... for this long, doubling on each re-open ...
    breaker_max_cooldown_s: float = 60.0      # ... up to this
    max_message_bytes: int = 16 * 1024 * 1024
    limits: Limits = Limits()
    tenants_poll_s: float = 2.0               # reload the tenants file when it changes; 0 = SIGHUP only
    fair_queue: str = "vtc"                   # vtc | fcfs (the baseline for comparisons)
    max_queued: int | None = 1024             # requests waiting in this router's queue; None = no cap
    queue_requests: bool = True               # False: admit only requests a worker can start now
    max_tokens_in_flight: int | None = None   # prompt + max_tokens of open requests; None = no budget
    affinity_imbalance: float = 0.25          # prefix affinity yields when its worker's load (fraction
                                              # of KV capacity) exceeds the least loaded's by more
    no_worker_grace_s: float = 5.0            # queued requests wait this long for a worker to return
    router_replicas: int = 1                  # routers sharing the workers and tenants: each enforces
                                              # 1/R of the tenant limits, the token budget and each
                                              # worker's KV room and sequence slots
    telemetry: TelemetryConfig = TelemetryConfig()   # tracing, /metrics, log format
    tls_cert: str | None = None               # PEM: TLS on the client port (with tls_key)
    tls_key: str | None = None
    tls_client_ca: str | None = None          # PEM: clients must present a certificate it signed
    worker_tls_ca: str | None = None          # PEM: TLS to workers, verified against this CA
    worker_tls_cert: str | None = None        # PEM: the router's client certificate (mutual TLS)
    worker_tls_key: str | None = None
    worker_tls_server_name: str | None = None  # name expected in worker certificates; None = host

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError("drain_grace_s must be >= 0")
        if self.tenants_poll_s < 0:
            raise ValueError("tenants_poll_s must be >= 0")
        if self.fair_queue not in ("vtc", "fcfs"):
            raise ValueError(f"fair_queue must be vtc or fcfs, got {self.fair_queue!r}")
        if not isinstance(self.router_replicas, int) or self.router_replicas < 1:
            raise ValueError(f"router_replicas must be an integer >= 1, got {self.router_replicas!r}")
        for name in ("max_queued", "max_tokens_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if not self.affinity_imbalance >= 0:
            raise ValueError(f"affinity_imbalance must be >= 0, got {self.affinity_imbalance}")
        if not self.health_timeout_s > 0 or self.down_after_probes < 1 or self.breaker_failures < 1:
            raise ValueError("health_timeout_s must be > 0; down_after_probes and breaker_failures >= 1")
        if not 0 < self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ValueError("breaker cool-downs must satisfy 0 < breaker_cooldown_s <= breaker_max_cooldown_s")
        if not self.no_worker_grace_s >= 0:
            raise ValueError(f"no_worker_grace_s must be >= 0, got {self.no_worker_grace_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        check_files(self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca, WORKER_TLS_FLAGS)
        if self.worker_tls_ca is None:
            for flag, value in (("--worker-tls-cert", self.worker_tls_cert),
                                ("--worker-tls-server-name", self.worker_tls_server_name)):
                if value is not None:
                    raise ValueError(f"{flag} needs --worker-tls-ca (the CA that signed the workers' "
                                     "certificates)")

    @property
    def binds_loopback(self) -> bool:
        return is_loopback_host(self.host)

    def missing_for_public_bind(self) -> list[str]:
        """What a non-loopback client port lacks: API keys and TLS, so that keys never travel in
        clear text. Empty when the bind is loopback or --allow-insecure-public."""
        if self.binds_loopback or self.allow_insecure_public:
            return []
        missing = [] if self.tenants_file else ["API keys (--tenants FILE)"]
        return missing + ([] if self.tls_cert else ["TLS (--tls-cert FILE --tls-key FILE)"])


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router", description="LLM router (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--workers", default="", help="comma-separated host:port list of workers")
    p.add_argument("--ray-address", default=None,
                   help="discover worker actors in this Ray cluster: HOST:PORT (GCS), auto, or "
                        "ray://HOST:10001 (Ray Client, from outside the cluster)")
    p.add_argument("--ray-namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the workers")
    p.add_argument("--model", default=None, help="GGUF file for the tokenizer (default: embedded model)")
    p.add_argument("--tenants", dest="tenants_file", default=None, help="tenants YAML file")
    p.add_argument("--allow-insecure-public", action="store_true",
                   help="serve a non-loopback address without API keys and TLS")
    g = p.add_argument_group("transport security (PEM files)")
    g.add_argument("--tls-cert", default=None, help="TLS certificate chain of the client port")
    g.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None,
                   help="require client certificates signed by this CA (mutual TLS on the client port)")
    g.add_argument("--worker-tls-ca", default=None, help="connect to workers over TLS, trusting this CA")
    g.add_argument("--worker-tls-cert", default=None,
                   help="the router's client certificate for workers that require one (mutual TLS)")
    g.add_argument("--worker-tls-key", default=None, help="private key of --worker-tls-cert")
    g.add_argument("--worker-tls-server-name", default=None,
                   help="name the workers' certificates carry, when it is not their --workers host")
    p.add_argument("--drain-grace-s", type=float, default=30.0)
    p.add_argument("--health-poll-s", type=float, default=1.0, help="worker health/load probe period")
    p.add_argument("--health-timeout-s", type=float, default=1.0, help="deadline of each worker probe call")
    p.add_argument("--down-after-probes", type=int, default=2,
                   help="failed probes in a row after which a worker is down and its open streams "
                        "are cancelled (UNAVAILABLE, retried if no token was sent)")
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="failed calls in a row that open a worker's circuit (no traffic)")
    p.add_argument("--breaker-cooldown-s", type=float, default=2.0,
                   help="how long an open circuit stays open; doubles on each re-open")
    p.add_argument("--breaker-max-cooldown-s", type=float, default=60.0)
    p.add_argument("--default-max-tokens", type=int, default=Limits.default_max_tokens)
    p.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens_limit)
    p.add_argument("--max-message-mb", type=float, default=RouterConfig.max_message_bytes / 2**20,
                   help="largest gRPC message received or sent, MiB (a larger request gets "
                        "RESOURCE_EXHAUSTED before it is parsed)")
    p.add_argument("--tenants-poll-s", type=float, default=2.0,
                   help="check the tenants file for changes this often (0: reload on SIGHUP only)")
    p.add_argument("--fair-queue", choices=("vtc", "fcfs"), default="vtc",
                   help="queue order: weighted virtual token counter, or first come first served")
    p.add_argument("--max-queued", type=int, default=1024,
                   help="requests waiting in this router's queue (0: no cap)")
    p.add_argument("--no-queue", action="store_true",
                   help="admit a request only if a worker can start it now and refuse the rest at once "
                        "(RESOURCE_EXHAUSTED): keeps time to first token near the unloaded value under "
                        "overload, at the cost of fair queueing")
    p.add_argument("--max-tokens-in-flight", type=int, default=0,
                   help="budget of prompt + max_tokens over open requests (0: none)")
    p.add_argument("--affinity-imbalance", type=float, default=0.25,
                   help="prefix affinity yields to the least loaded worker when the preferred one's "
                        "load, as a fraction of its KV capacity, is higher by more than this")
    p.add_argument("--no-worker-grace-s", type=float, default=5.0,
                   help="requests queued for a model with no healthy worker fail (UNAVAILABLE) after this")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="how many routers share these workers and tenants behind one balancer that "
                        "spreads requests evenly: this one enforces 1/N of each tenant's rates and "
                        "caps (caps rounded up), of --max-tokens-in-flight and of each worker's KV "
                        "room and sequence slots")
    telemetry.add_args(p, default_metrics_port=DEFAULT_METRICS_PORT)
    a = p.parse_args(argv)
    workers = tuple(w.strip() for w in a.workers.split(",") if w.strip())
    return RouterConfig(
        host=a.host, port=a.port, workers=workers, model=a.model, tenants_file=a.tenants_file,
        allow_insecure_public=a.allow_insecure_public, drain_grace_s=a.drain_grace_s,
        health_poll_s=a.health_poll_s, health_timeout_s=a.health_timeout_s,
        down_after_probes=a.down_after_probes, breaker_failures=a.breaker_failures,
        breaker_cooldown_s=a.breaker_cooldown_s, breaker_max_cooldown_s=a.breaker_max_cooldown_s,
        ray_address=a.ray_address, ray_namespace=a.ray_namespace,
        limits=Limits(default_max_tokens=a.default_max_tokens, max_tokens_limit=a.max_tokens_limit),
        tenants_poll_s=a.tenants_poll_s, fair_queue=a.fair_queue, max_queued=a.max_queued or None,
        queue_requests=not a.no_queue,
        max_tokens_in_flight=a.max_tokens_in_flight or None, affinity_imbalance=a.affinity_imbalance,
        no_worker_grace_s=a.no_worker_grace_s, max_message_bytes=int(a.max_message_mb * 2**20),
        router_replicas=a.router_replicas,
        telemetry=telemetry.from_args(a),
        tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
        worker_tls_ca=a.worker_tls_ca, worker_tls_cert=a.worker_tls_cert, worker_tls_key=a.worker_tls_key,
        worker_tls_server_name=a.worker_tls_server_name,
    )
