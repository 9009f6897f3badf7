"""Worker server settings: one frozen dataclass around the engine's, checked at construction.

Contract
- `WorkerServerConfig` holds what `worker.server.serve` needs besides the engine: bind address,
  TLS files, drain timings, message size, telemetry. Its field metadata (common.config_cli) makes
  the flags of `python -m worker` and of the launchers (deploy/local.py, deploy/ray_launch.py),
  each also settable as an `LLM_*` variable; the defaults live only here and in EngineConfig.
- authentication: `worker_token` (common.auth) turns the router token check on; the launchers
  set it per deployment. Stalled readers: `stream_idle_timeout_s`, `stream_buffer_messages`.
- failure modes (ValueError): unreadable or unpaired TLS files (common.tls); a non-loopback host
  without mutual TLS or a worker token, unless `allow_insecure_public` (common.public_bind, the
  one copy of the rule).
- Imports neither torch nor grpc, so that launchers can build the flags without loading the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.config_cli import MIB, option, section
from common.public_bind import refusal, worker_missing
from common.telemetry import TelemetryConfig
from common.tls import check_server_files
from worker.config import EngineConfig


@dataclass(frozen=True)
class WorkerServerConfig:
    engine: EngineConfig = field(metadata=section("engine"))
    host: str = field(
        default="127.0.0.1",
        metadata=option(
            "bind address; a non-loopback one needs mutual TLS (--tls-*) or --allow-insecure-public"
        ),
    )
    port: int = field(default=0, metadata=option("gRPC port; 0 = ephemeral (printed at start-up)"))
    drain_grace_s: float = field(default=10.0, metadata=option("SIGTERM: how long open streams may finish"))
    drain_announce_s: float = field(
        default=2.0,
        metadata=option(
            "SIGTERM: report NOT_SERVING but keep accepting calls this long first, so that routers stop "
            "routing here (set above the routers' --health-poll-s)"
        ),
    )
    max_message_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=option("largest gRPC message received or sent", flag="max-message-mb", unit=MIB),
    )
    telemetry: TelemetryConfig = field(default=TelemetryConfig(), metadata=section("observability"))
    tls_cert: str | None = field(
        default=None, metadata=option("PEM: TLS certificate chain of this worker", metavar="FILE")
    )
    tls_key: str | None = field(
        default=None, metadata=option("PEM: private key of --tls-cert", metavar="FILE")
    )
    tls_client_ca: str | None = field(
        default=None,
        metadata=option(
            "PEM: require client (router) certificates signed by this CA: mutual TLS", metavar="FILE"
        ),
    )
    allow_insecure_public: bool = field(
        default=False,
        metadata=option(
            "bind a non-loopback address without mutual TLS (a private network only)", negative=()
        ),
    )
    worker_token: str | None = field(
        default=None,
        repr=False,
        metadata=option(
            "shared secret routers must send (metadata x-llm-worker-token) on every llm.v1.Worker call; "
            "others get UNAUTHENTICATED (common.auth). Prefer the variable: a flag shows in ps",
            metavar="TOKEN",
        ),
    )
    stream_idle_timeout_s: float = field(
        default=30.0,
        metadata=option(
            "end a Generate stream whose reader has taken nothing for this long (its sequence is "
            "aborted and its KV blocks freed); 0 = never"
        ),
    )
    stream_buffer_messages: int = field(
        default=64,
        metadata=option(
            "outputs buffered per stream for a slow reader; when full, the engine stops generating for "
            "that sequence until the reader catches up (backpressure)"
        ),
    )
    stream_interval: int = field(
        default=1,
        metadata=option(
            "tokens per streamed message after a stream's first (1: each token as it is sampled; N: "
            "N at a time, fewer messages and less CPU per token at high concurrency, burstier gaps)"
        ),
    )

    def __post_init__(self) -> None:
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        times = (self.drain_grace_s, self.drain_announce_s, self.stream_idle_timeout_s)
        if not all(math.isfinite(t) for t in times):  # a NaN idle timeout ended every stream at once
            raise ValueError(f"drain and stream timeouts must be finite numbers of seconds, got {times}")
        if self.drain_grace_s < 0 or self.drain_announce_s < 0:
            raise ValueError("drain_grace_s and drain_announce_s must be >= 0")
        if self.worker_token is not None and not self.worker_token.strip():
            raise ValueError("worker_token must not be empty (unset it to turn worker authentication off)")
        if self.stream_idle_timeout_s < 0 or self.stream_buffer_messages < 1:
            raise ValueError("stream_idle_timeout_s must be >= 0 and stream_buffer_messages >= 1")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        problem = refusal(
            self.host,
            worker_missing(
                self.host,
                self.allow_insecure_public,
                self.tls_cert,
                self.tls_key,
                self.tls_client_ca,
                self.worker_token,
            ),
            "worker",
        )
        if problem:
            raise ValueError(problem)
