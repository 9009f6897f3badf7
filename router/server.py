"""Router process: wires config, tenants, tokenizer, registry, admission, the fair queue, the
dispatcher and the servicer into the shared server skeleton (common/grpc_server.py: TLS, health,
reflection, message-size limits, /metrics, tracing, signals), with a SIGTERM drain of its own
in-flight calls and a SIGHUP / file-change reload of the tenants file.

Contract
- input: `RouterConfig`.
- output: serves `llm.v1.Generation`, `grpc.health.v1.Health` (SERVING while at least one worker
  is healthy) and server reflection until SIGTERM/SIGINT; `serve` then returns 0. Its handlers
  go in first; a stop that came before (`stop_requested`, python -m router's record) or during
  the model table's load ends start-up there, 0 without binding anything; a later one drains.
- state: the server, the registry and the served models (`router.models.ModelTable`, from
  --model: one tokenizer, chat template and defaults per model id) for the process lifetime;
  /workers on the metrics port lists each worker with why it is refused, if it is.
- also: the OpenAI-compatible HTTP API (router/openai, --http-host/--http-port, -1 = off) in the
  same event loop, over the same servicer; it drains and stops with the gRPC server.
- failure modes: refuses to bind a non-loopback address without both API keys and TLS (unless
  --allow-insecure-public); on SIGTERM health turns NOT_SERVING, new calls get UNAVAILABLE,
  in-flight calls get `drain_grace_s` to finish, then the server stops.
- proven by: tests/test_grpc_e2e.py (SIGTERM drain), tests/test_router_cli.py (never imports torch),
  tests/test_early_signals.py (a stop during start-up).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from common.auth import token_client_interceptors
from common.grpc_server import GrpcServer, message_options
from common.tls import channel_credentials
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
from router.models import ModelTable, worker_states
from router.observe import EventLoopLag
from router.openai.app import create_app
from router.openai.reasoning import reasoning_modes
from router.openai.server import ConnectionLimits, HttpFront
from router.registry import StaticRegistry
from router.service import GenerationService
from router.tenants import TenantsFile

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def channel_options(max_message_bytes: int, health_poll_s: float = 1.0) -> list[tuple[str, int]]:
    """Worker channel options. Reconnect attempts to a worker that went away back off up to twice
    the health-probe period (200 ms to 2 s): a restarted worker is reconnected within about two
    probes, not up to 2 s after the probes could have seen it."""
    max_backoff_ms = int(min(2000.0, max(200.0, 2000.0 * health_poll_s)))
    return [
        *message_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", max_backoff_ms),
    ]


async def serve(config: RouterConfig, stop_requested: Callable[[], bool] = lambda: False) -> int:
    """Serves until SIGTERM/SIGINT, then drains; 0. `stop_requested()`: whether a stop arrived
    before this function's handlers are installed (python -m router records SIGTERM/SIGINT from
    its first line); one that arrives before the model table is loaded ends start-up there."""
    # Handlers first: everything below awaits or is quick, so a stop is seen at the next await.
    stop = GrpcServer.stop_event()
    if stop_requested():
        stop.set()
    replicas = config.router_replicas  # each of R routers enforces 1/R of the shared limits
    tenants = TenantsFile(config.tenants_file, allow_public=config.allow_insecure_public, replicas=replicas)
    problem = config.public_bind_refusal()  # the common.public_bind rule
    if problem:
        raise SystemExit(problem)
    log.info("loading model(s) %s", ", ".join(config.model) or "(the default)")
    models = await asyncio.to_thread(ModelTable.from_entries, config.model, config.allow_download)
    if stop.is_set():  # nothing is bound or started yet: later, a stop takes the drain path below
        log.info("stop requested during start-up: not serving")
        return 0
    options = channel_options(config.max_message_bytes, config.health_poll_s)
    registry_args = dict(
        poll_s=config.health_poll_s,
        channel_options=tuple(options),
        probe_timeout_s=config.health_timeout_s,
        down_after_probes=config.down_after_probes,
        check_info=models.check,  # never route to a worker whose model or tokenizer differs
        breaker_factory=lambda: CircuitBreaker(
            config.breaker_failures, config.breaker_cooldown_s, config.breaker_max_cooldown_s
        ),
    )
    if config.worker_token:  # every worker call carries the deployment's token (common.auth)
        registry_args["interceptors"] = token_client_interceptors(config.worker_token)
    if config.worker_tls_ca:  # TLS to workers; mutual when the router has a client certificate
        registry_args["credentials"] = channel_credentials(
            config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key, WORKER_TLS_FLAGS
        )
        if config.worker_tls_server_name:
            registry_args["channel_options"] += (
                ("grpc.ssl_target_name_override", config.worker_tls_server_name),
            )
    if config.ray_address:  # Ray is imported only here: a static router never loads it
        from router.ray_registry import RayRegistry

        registry = RayRegistry(
            config.ray_address, config.ray_namespace, static=config.workers, **registry_args
        )
    else:
        registry = StaticRegistry(config.workers, **registry_args)
    models.live = registry.models  # LoRA adapters resolve through the workers that serve them
    models.claimed = registry.adapter_bases
    drain = Drain()
    queue = FairQueue(mode=config.fair_queue)
    budget = config.max_tokens_in_flight and -(-config.max_tokens_in_flight // replicas)
    admission = AdmissionController(
        queue, AdmissionConfig(max_queued_total=config.max_queued, max_tokens_in_flight=budget)
    )
    dispatcher = Dispatcher(
        queue,
        registry,
        PrefixAffinity(),
        config.affinity_imbalance,
        recheck_s=config.health_poll_s,
        no_worker_grace_s=config.no_worker_grace_s,
        replicas=replicas,
    )
    metrics = RouterMetrics()
    loop_lag = EventLoopLag(metrics.registry)  # llm_router_event_loop_lag_seconds
    metrics.export_admission(lambda: admission.refusals, lambda: admission.admitted)
    metrics.export_state(registry, drain, admission, queue, dispatcher)
    modes = reasoning_modes(models)  # logged once, here; a LoRA adapter reasons as its base model

    def reasoning(name: str):
        return modes.get(models.base_id(name))

    # the servicer before the server: its interceptor gates each message with it (starts nothing:
    # its decode and grammar-compile processes start on first use)
    service = GenerationService(
        registry,
        models,
        tenants,
        config.limits,
        drain,
        admission,
        dispatcher,
        metrics=metrics,
        queue_requests=config.queue_requests,
        lora_autoload_retry_s=config.lora_autoload_retry_s if config.lora_autoload else None,
        reasoning=reasoning,
    )
    # the key and the tenant's rate before a message is parsed
    interceptor = ErrorInterceptor(config.stream_idle_timeout_s, gate=service.gate_message)
    try:
        base = GrpcServer(
            component="router",
            service_names=(SERVICE_NAME,),
            host=config.host,
            port=config.port,
            telemetry=config.telemetry,
            metrics_registry=metrics.registry,
            default_metrics_port=DEFAULT_METRICS_PORT,
            metrics_routes={
                "/targets": lambda: targets(registry),
                "/workers": lambda: worker_states(registry),
            },
            tls=(config.tls_cert, config.tls_key, config.tls_client_ca),
            options=options,
            interceptors=[interceptor],
        )
    except SystemExit:  # the metrics port: nothing served
        service.close()
        raise
    generation_pb2_grpc.add_GenerationServicer_to_server(service, base.server)
    http = None
    if config.http_port != -1:  # the OpenAI-compatible front, over the same servicer
        app = create_app(
            service,
            registry.models,
            metrics,
            decoder=models.decoder,
            reasoning=reasoning,
            max_body_bytes=config.max_message_bytes,
            stream_idle_timeout_s=config.stream_idle_timeout_s,
            serving=lambda: base.serving,
            limits=config.limits,
            max_streams_per_tenant=config.http_max_streams_per_tenant,
            max_unsent_mb_per_tenant=config.http_max_unsent_mb_per_tenant,
        )
        try:
            http = HttpFront(
                app,
                config.http_host,
                config.http_port,
                (config.tls_cert, config.tls_key, config.tls_client_ca),
                ConnectionLimits(
                    header_timeout_s=config.http_header_timeout_s,
                    body_timeout_s=config.http_body_timeout_s,
                    write_timeout_s=config.http_write_timeout_s,
                    max_connections=config.http_max_connections,
                    max_connections_per_client=config.http_max_connections_per_client,
                ),
                metrics=metrics,
            )
        except SystemExit:
            base.close()
            service.close()
            raise
    base.bind()
    await base.set_serving(False)  # SERVING while at least one worker is healthy
    registry.on_change(base.set_serving_soon)
    base.start_tracing()
    await registry.start()  # first probe round before serving: a restarted router knows its workers at once
    await base.start()
    if http is not None:
        http.start()
    service.decode_pool.warm()  # the first large body should not wait for a decoder process
    dispatcher.start()
    loop_lag.start()
    watcher = (
        asyncio.create_task(tenants.watch(config.tenants_poll_s))
        if (config.tenants_file and config.tenants_poll_s > 0)
        else None
    )

    base.stop_event(stop, extra_signals={signal.SIGHUP: tenants.reload})
    base.announce()
    if http is not None:
        http.announce()
    log.info(
        "workers: %s%s",
        ", ".join(config.workers) or "none",
        f"; Ray actors in namespace {config.ray_namespace!r}" if config.ray_address else "",
    )
    await stop.wait()

    log.info("draining: %d call(s) in flight, grace %.1f s", drain.num_inflight, config.drain_grace_s)
    await base.not_serving()
    if not await drain.drain(config.drain_grace_s):
        log.warning("grace period over: cancelling %d call(s)", drain.num_inflight)
    await base.stop(1.0)
    if http is not None:
        await http.stop(1.0)
    if watcher is not None:
        watcher.cancel()
    await dispatcher.stop()
    loop_lag.stop()
    await registry.stop()
    service.close()  # its decode and grammar-compile processes
    base.close()
    log.info("router stopped")
    return 0
