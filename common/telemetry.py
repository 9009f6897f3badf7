"""Tracing setup and W3C trace-context propagation over gRPC metadata (router and worker share it).

Contract
- input: `TelemetryConfig`, built from flags and `LLM_*` variables by common.config_cli (its field
  metadata; `add_args` / `from_args` for a parser of its own); `env_endpoint` is the one place that
  reads `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` (the endpoint when no flag or LLM_OTLP_ENDPOINT is
  given); `standard_env` picks the OTEL_* variables launchers pass on to the processes they start.
- output: `setup_tracing(config, service_name)` installs an SDK tracer provider (parent-based ratio
  sampler, batch span processor, OTLP/gRPC and/or console exporter) when an exporter is configured
  and returns a `Tracing` handle whose `shutdown()` flushes it; with no exporter nothing is installed
  and the OpenTelemetry API stays a no-op (no span objects, no exporter thread). Either way a
  client's `traceparent` still flows through: the no-op tracer hands back the remote parent.
  `extract(metadata)` / `inject(ctx)` move `traceparent` / `tracestate` between a Context and gRPC
  metadata; `trace_id_of(span)` gives the hex id for log lines.
- state: the global tracer provider, once per process.
- failure modes: an unreachable collector never fails a request (the exporter drops spans and logs).
- proven by: tests/test_observability_e2e.py (spans from router and worker over real OTLP/gRPC).
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.config_cli import Flags, option
from common.tls import METRICS_FLAGS, check_server_files, server_ssl_context

METADATA_KEYS = ("traceparent", "tracestate")
MAX_HEADER_CHARS = 512
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TelemetryConfig:
    """Tracing, /metrics and log settings of one process (router or worker); the field metadata
    makes the flags and `LLM_*` variables (common.config_cli)."""

    otlp_endpoint: str | None = field(
        default=None,
        metadata=option(
            "export traces over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 (default: "
            "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; unset = no tracing)",
            env_fallback=lambda environ: env_endpoint(environ),
            metavar="URL",
        ),
    )
    console: bool = field(
        default=False, metadata=option("print finished spans to stdout", flag="trace-console")
    )
    sample_ratio: float = field(
        default=1.0,
        metadata=option(
            "fraction of new traces recorded (the router decides for each call; a caller's sampled flag is "
            "not followed)",
            flag="trace-sample-ratio",
        ),
    )
    metrics_host: str | None = field(
        default=None, metadata=option("Prometheus /metrics host (default: the server's --host)")
    )
    metrics_port: int | None = field(
        default=None,
        metadata=option(
            "Prometheus /metrics port (default: 9464 on the router, ephemeral on workers; taken default "
            "-> ephemeral; 0 = ephemeral; -1 = off)"
        ),
    )
    metrics_tls_cert: str | None = field(
        default=None, metadata=option("PEM certificate chain: serve /metrics over HTTPS", metavar="FILE")
    )
    metrics_tls_key: str | None = field(
        default=None, metadata=option("PEM private key for --metrics-tls-cert", metavar="FILE")
    )
    metrics_tls_client_ca: str | None = field(
        default=None,
        metadata=option(
            "PEM CA bundle: scrapers must present a client certificate it signed", metavar="FILE"
        ),
    )
    metrics_bearer_token: str | None = field(
        default=None,
        repr=False,
        metadata=option(
            "scrapers of /metrics and /targets must send 'Authorization: Bearer TOKEN' (401 otherwise). "
            "Prefer the variable: a flag shows in ps",
            metavar="TOKEN",
        ),
    )
    log_format: str = field(
        default="text",
        metadata=option(
            "json: one JSON object per log line (request lines carry the trace id)", choices=("text", "json")
        ),
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be in [0, 1], got {self.sample_ratio}")
        if self.metrics_port is not None and not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in [-1, 65535], got {self.metrics_port}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log format must be text or json, got {self.log_format!r}")
        check_server_files(
            self.metrics_tls_cert, self.metrics_tls_key, self.metrics_tls_client_ca, METRICS_FLAGS
        )

    def metrics_ssl_context(self) -> ssl.SSLContext | None:
        if self.metrics_tls_cert is None:
            return None
        return server_ssl_context(self.metrics_tls_cert, self.metrics_tls_key, self.metrics_tls_client_ca)

    @property
    def tracing(self) -> bool:
        return bool(self.otlp_endpoint) or self.console


def add_args(p: argparse.ArgumentParser, default_metrics_port: int | None = None) -> Flags:
    """The observability flags (`TelemetryConfig`'s options) on `p`; `default_metrics_port` is the
    component's (the router's 9464; None on workers: ephemeral), shown in the help only."""
    del default_metrics_port  # the component default is applied where /metrics starts
    return Flags(p, TelemetryConfig, title="observability")


def from_args(a: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> TelemetryConfig:
    """`TelemetryConfig` from flags added by `add_args`, then `LLM_*` variables, then the OTEL ones."""
    return Flags(argparse.ArgumentParser(add_help=False), TelemetryConfig).build(a, environ)


def standard_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The OpenTelemetry SDK's own variables (OTEL_*: endpoint, headers, batch delays, resource
    attributes...) that a launcher hands on to the processes it starts."""
    return {k: v for k, v in environ.items() if k.startswith("OTEL_")}


def env_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The standard OTLP endpoint variables (for processes configured without a command line)."""
    return (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


class Tracing:
    """The installed provider (None when tracing is off); `shutdown()` flushes pending spans."""

    def __init__(self, provider=None):
        self.provider = provider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(config: TelemetryConfig, service_name: str, instance: str = "") -> Tracing:
    if not config.tracing:
        return Tracing()
    # Imported here: a process without tracing never loads the SDK or the exporter.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes = {"service.name": service_name}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(
        resource=Resource.create(attributes), sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
    )
    if config.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = config.otlp_endpoint
        insecure = not endpoint.startswith("https://")
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if config.console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return Tracing(provider)


def extract(metadata: Iterable[tuple[str, str]] | None) -> Context:
    """The remote parent from incoming gRPC metadata (an empty Context when there is none).
    Values over 512 characters (the W3C limit) are dropped quietly: OpenTelemetry would log a
    warning for each, which a client could use to flood the logs."""
    carrier = {k: v for k, v in metadata or () if k in METADATA_KEYS and len(v) <= MAX_HEADER_CHARS}
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def inject(ctx: Context) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `ctx`'s span as the remote parent (empty when it has no valid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return tuple(carrier.items())


def genai_request_attributes(
    request_id: str, tenant: str, model: str, max_tokens: int, temperature: float, num_prompt_tokens: int
) -> dict:
    """GenAI semantic-convention attributes of one request, shared by router and worker spans."""
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.usage.input_tokens": num_prompt_tokens,
        "llm.request_id": request_id,
        "llm.tenant": tenant,
    }


def trace_id_of(span: trace.Span) -> str:
    """32 hex digits, or "" when the span belongs to no trace (tracing off, no client traceparent)."""
    sc = span.get_span_context()
    return trace.format_trace_id(sc.trace_id) if sc.is_valid else ""
