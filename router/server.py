"""Router process: wires config, tenants, tokenizer, registry, admission, the fair queue, the
dispatcher and the servicer into a grpc.aio server with health, reflection, message-size limits,
a SIGTERM drain and a SIGHUP / file-change reload of the tenants file.

Contract
- input: `RouterConfig`.
- output: serves `llm.v1.Generation`, `grpc.health.v1.Health` (SERVING while at least one worker
  is healthy) and server reflection until SIGTERM/SIGINT; `serve` then returns 0.
- state: the server and registry for the process lifetime.
- failure modes: refuses to bind a non-loopback address without both API keys and TLS (unless
  --allow-insecure-public); on SIGTERM health turns NOT_SERVING, new calls get UNAVAILABLE,
  in-flight calls get `drain_grace_s` to finish, then the server stops.
- proven by: tests/test_grpc_e2e.py (SIGTERM drain), tests/test_router_cli.py (never imports torch).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.metrics_http import start_metrics_server
from common.model_files import default_model_path
from common.net import bind_address
from common.telemetry import setup_tracing
from common.tls import channel_credentials, server_credentials
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2, generation_pb2_grpc
from router.admission import AdmissionConfig, AdmissionController
from router.affinity import PrefixAffinity
from router.circuit import CircuitBreaker
from router.config import DEFAULT_METRICS_PORT, WORKER_TLS_FLAGS, RouterConfig
from router.dispatcher import Dispatcher
from router.drain import Drain
from router.errors import ErrorInterceptor
from router.fair_queue import FairQueue
from router.metrics import RouterMetrics, targets
from router.registry import StaticRegistry
from router.service import GenerationService
from router.tenants import TenantsFile

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


async def serve(config: RouterConfig) -> int:
    replicas = config.router_replicas   # each of R routers enforces 1/R of the shared limits
    tenants = TenantsFile(config.tenants_file, allow_public=config.allow_insecure_public,
                          replicas=replicas)
    problem = config.public_bind_refusal()   # the common.public_bind rule
    if problem:
        raise SystemExit(problem)
    tokenizer = Tokenizer.from_gguf(config.model or str(default_model_path()))
    options = channel_options(config.max_message_bytes)
    registry_args = dict(
        poll_s=config.health_poll_s, channel_options=tuple(options), probe_timeout_s=config.health_timeout_s,
        down_after_probes=config.down_after_probes,
        breaker_factory=lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s,
                                               config.breaker_max_cooldown_s))
    if config.worker_tls_ca:   # TLS to workers; mutual when the router has a client certificate
        registry_args["credentials"] = channel_credentials(
            config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key, WORKER_TLS_FLAGS)
        if config.worker_tls_server_name:
            registry_args["channel_options"] += (
                ("grpc.ssl_target_name_override", config.worker_tls_server_name),)
    if config.ray_address:     # Ray is imported only here: a static router never loads it
        from router.ray_registry import RayRegistry
        registry = RayRegistry(config.ray_address, config.ray_namespace, static=config.workers, **registry_args)
    else:
        registry = StaticRegistry(config.workers, **registry_args)
    drain = Drain()
    queue = FairQueue(mode=config.fair_queue)
    budget = config.max_tokens_in_flight and -(-config.max_tokens_in_flight // replicas)
    admission = AdmissionController(queue, AdmissionConfig(max_queued_total=config.max_queued,
                                                           max_tokens_in_flight=budget))
    dispatcher = Dispatcher(queue, registry, PrefixAffinity(), config.affinity_imbalance,
                            recheck_s=config.health_poll_s, no_worker_grace_s=config.no_worker_grace_s,
                            replicas=replicas)
    telemetry = config.telemetry
    metrics = RouterMetrics()
    metrics.export_admission(lambda: admission.refusals, lambda: admission.admitted)
    metrics.export_state(registry, drain, admission, queue, dispatcher)
    try:
        metrics_server = start_metrics_server(telemetry.metrics_host or config.host, telemetry.metrics_port,
                                              DEFAULT_METRICS_PORT, metrics.registry,
                                              {"/targets": lambda: targets(registry)},
                                              telemetry.metrics_ssl_context())
    except OSError as exc:
        raise SystemExit(f"cannot serve metrics on port {telemetry.metrics_port}: {exc}") from None

    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=options)
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationService(registry, tokenizer, tenants, config.limits, drain, admission, dispatcher,
                          metrics=metrics, queue_requests=config.queue_requests), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if config.tls_cert:
        port = server.add_secure_port(bind_address(config.host, config.port), server_credentials(
            config.tls_cert, config.tls_key, config.tls_client_ca))
    else:
        port = server.add_insecure_port(bind_address(config.host, config.port))
    if port == 0:
        raise SystemExit(f"cannot bind {bind_address(config.host, config.port)}")

    pending: set[asyncio.Task] = set()

    def on_workers(any_healthy: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if any_healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            task = asyncio.create_task(health_servicer.set(name, status))
            pending.add(task)
            task.add_done_callback(pending.discard)

    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    registry.on_change(on_workers)
    tracing = setup_tracing(telemetry, "llm-router", instance=bind_address(config.host, port))
    await registry.start()  # first probe round before serving: a restarted router knows its workers at once
    await server.start()
    dispatcher.start()
    watcher = asyncio.create_task(tenants.watch(config.tenants_poll_s)) if (
        config.tenants_file and config.tenants_poll_s > 0) else None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, tenants.reload)
    # The "listening" line is machine-read by launchers that pass --port 0.
    print(f"router listening on {bind_address(config.host, port)}", flush=True)
    log.info("workers: %s%s", ", ".join(config.workers) or "none",
             f"; Ray actors in namespace {config.ray_namespace!r}" if config.ray_address else "")
    if metrics_server:
        log.info("metrics at %s, worker targets at %s/targets", metrics_server.url,
                 metrics_server.url.removesuffix("/metrics"))
    if tracing.enabled:
        log.info("tracing to %s (sample ratio %g)", telemetry.otlp_endpoint or "console",
                 telemetry.sample_ratio)
    await stop.wait()

    log.info("draining: %d call(s) in flight, grace %.1f s", drain.num_inflight, config.drain_grace_s)
    await health_servicer.enter_graceful_shutdown()
    if not await drain.drain(config.drain_grace_s):
        log.warning("grace period over: cancelling %d call(s)", drain.num_inflight)
    await server.stop(grace=1.0)
    if watcher is not None:
        watcher.cancel()
    await dispatcher.stop()
    await registry.stop()
    tracing.shutdown()
    if metrics_server:
        metrics_server.close()
    log.info("router stopped")
    return 0
