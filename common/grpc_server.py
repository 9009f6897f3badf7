"""The gRPC server skeleton the router and the worker share: bind (TLS or plaintext), message-size
limits, grpc.health.v1, server reflection, the Prometheus /metrics endpoint, tracing, signals and
the drain steps. What each server serves and how it drains its own streams stays in its module.

Contract
- `GrpcServer(component, service_names, host, port, telemetry, metrics_registry, ...)` starts the
  /metrics endpoint (`telemetry.metrics_port`, None = `default_metrics_port`, -1 = off) and builds
  the grpc.aio server with health and reflection (the given services + health + reflection);
  the caller adds its servicers to `.server`, then `bind()` -> the bound port (`.address` is
  `host:port`), `await start()` (tracing, with the bound address as the service instance, unless
  `start_tracing()` ran already; then the server), `await set_serving(bool)` (health of "" and
  every service; `.serving` mirrors it, False for good once draining), `stop_event(stop,
  extra_signals)` (SIGTERM/SIGINT set it, unless the caller passes its own event, as a server on
  a non-main thread must), `announce()` (the machine-read
  "<component> listening on HOST:PORT" line and the log lines), and for the drain
  `await not_serving()` (health NOT_SERVING for good: a graceful-shutdown health servicer),
  `await stop(grace_s)`, then `close()` (flushes tracing, closes /metrics).
- failure modes: a /metrics port that cannot be bound or a gRPC address that cannot be bound ->
  SystemExit with the reason (the caller releases what it holds first: `close()` is safe then).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.metrics_http import start_metrics_server
from common.net import bind_address
from common.telemetry import TelemetryConfig, Tracing, setup_tracing
from common.tls import server_credentials

log = logging.getLogger(__name__)


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class GrpcServer:
    def __init__(
        self,
        *,
        component: str,
        service_names: Iterable[str],
        host: str,
        port: int,
        telemetry: TelemetryConfig,
        metrics_registry,
        default_metrics_port: int = 0,
        metrics_routes: dict[str, Callable[[], object]] | None = None,
        tls: tuple[str | None, str | None, str | None] = (None, None, None),
        options: list[tuple[str, int]] | None = None,
        interceptors: Iterable = (),
    ):
        self.component = component
        self.service_names = tuple(service_names)
        self.host, self._port, self.telemetry, self._tls = host, port, telemetry, tls
        self.tracing = Tracing()
        self.port = 0
        self._routes = tuple(metrics_routes or ())
        try:
            self.metrics = start_metrics_server(
                telemetry.metrics_host or host,
                telemetry.metrics_port,
                default_metrics_port,
                metrics_registry,
                metrics_routes,
                telemetry.metrics_ssl_context(),
                telemetry.metrics_bearer_token,
            )
        except OSError as exc:
            raise SystemExit(f"cannot serve metrics on port {telemetry.metrics_port}: {exc}") from None
        self.server = grpc.aio.server(interceptors=list(interceptors), options=options or [])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self._pending: set[asyncio.Task] = set()
        self.serving = False  # what health says for "" (the HTTP front's GET /health reads it)
        self._draining = False

    @property
    def address(self) -> str:
        return bind_address(self.host, self.port)

    def bind(self) -> int:
        address = bind_address(self.host, self._port)
        cert, key, client_ca = self._tls
        if cert:
            port = self.server.add_secure_port(address, server_credentials(cert, key, client_ca))
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            self.close()
            raise SystemExit(f"cannot bind {address}")
        self.port = port
        return port

    def start_tracing(self) -> None:
        """Tracing (service instance = the bound address); `start` does it when not done yet."""
        if not self.tracing.enabled:
            self.tracing = setup_tracing(self.telemetry, f"llm-{self.component}", instance=self.address)

    async def start(self) -> None:
        self.start_tracing()
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving and not self._draining
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def set_serving_soon(self, serving: bool) -> None:
        """`set_serving` from synchronous code on the event loop (e.g. a registry callback)."""
        task = asyncio.create_task(self.set_serving(serving))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @staticmethod
    def stop_event(
        stop: asyncio.Event | None = None, extra_signals: dict[int, Callable[[], None]] | None = None
    ) -> asyncio.Event:
        """`stop`, or a new event that SIGTERM and SIGINT set; `extra_signals` get handlers too.
        Signal handlers need the main thread: a server elsewhere passes its own `stop`."""
        loop = asyncio.get_running_loop()
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        for sig, handler in (extra_signals or {}).items():
            loop.add_signal_handler(sig, handler)
        return stop

    def announce(self) -> None:
        # The "listening" line is machine-read by launchers that pass --port 0.
        print(f"{self.component} listening on {self.address}", flush=True)
        if self.metrics:
            base = self.metrics.url.removesuffix("/metrics")
            log.info(
                "metrics at %s%s",
                self.metrics.url,
                "".join(f", {path} at {base}{path}" for path in self._routes),
            )
        if self.tracing.enabled:
            log.info(
                "tracing to %s (sample ratio %g)",
                self.telemetry.otlp_endpoint or "console",
                self.telemetry.sample_ratio,
            )

    async def not_serving(self) -> None:
        """Health NOT_SERVING from now on (drain); calls are still accepted until `stop`."""
        self.serving, self._draining = False, True
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace=grace_s)

    def close(self) -> None:
        self.tracing.shutdown()
        self.tracing = Tracing()
        if self.metrics:
            self.metrics.close()
            self.metrics = None
