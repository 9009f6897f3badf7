"""One router request, observed: its spans, its metrics and its log line.

Contract
- input: the call's metadata (a client `traceparent` becomes the parent, but whether the trace
  is sampled is decided by the router's sampler with its own randomness, never by the caller's
  flag: the call is not authenticated yet), then the servicer's
  stage boundaries (`stage("auth")`, `stage("validate")`, `stage("admission")`, `stage("queue")`,
  `stage("route", worker=...)`: each ends the previous stage), `request(...)` once the request is
  known, `event(chunk_or_done)` for each relayed event, `fail(exc)` when it raises, `finish()` once.
- output: span `llm.v1.Generation/Generate` (SERVER) with one child per stage; `metadata` is the
  gRPC metadata that makes the worker's span a child of the `route` span (W3C traceparent);
  the `common.request_metrics` families, the running / waiting gauges; one "request finished" log
  line with the trace id. `protocol` (grpc | http, the front the request came in by) is a span
  attribute, a log field and the label of `llm_router_requests_by_protocol_total{protocol,status}`;
  `model` (set once the request is validated: a served base model or LoRA adapter) labels
  `llm_router_requests_by_model_total{model,status}` and `llm_router_tokens_by_model_total{model,kind}`.
- state: per request only. Spans are started with explicit parents (never attached as the
  "current" context), so nothing leaks across the servicer's async generator boundaries.
- status vocabulary (label and log): stop | length | cancelled, or the gRPC status code in lower
  case when the call fails (invalid_argument, unauthenticated, resource_exhausted, unavailable,
  deadline_exceeded, internal).
- `EventLoopLag` exports `llm_router_event_loop_lag_seconds` (the worst of the last second) and
  `llm_router_event_loop_lag_samples_seconds` (a histogram of every sample) and
  `llm_router_event_loop_lag_max_seconds` (the worst since start).
- proven by: tests/test_observability_e2e.py, tests/test_trust_units.py (sampling, loop lag).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from prometheus_client import Gauge, Histogram

from common.logs import log_request
from common.request_metrics import TokenClock
from common.telemetry import extract, genai_request_attributes, inject, trace_id_of
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.relay import Chunk, Done

tracer = trace.get_tracer("llm.router")
requests_log = logging.getLogger("llm.requests")
SPAN_NAME = "llm.v1.Generation/Generate"


def status_of(exc: BaseException) -> str:
    if isinstance(exc, RouterError):
        return exc.code.name.lower()
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "internal"


def _router_samples(name: str) -> bool:
    """The sampling decision the router's own sampler takes for a new trace, on a trace id of the
    router's randomness (a trace-id-ratio sampler on the client's id would let the client pick)."""
    sampler = getattr(trace.get_tracer_provider(), "sampler", None)
    if sampler is None:  # no SDK: nothing is recorded anyway
        return False
    result = sampler.should_sample(None, random.getrandbits(128) or 1, name)
    return result.decision.is_sampled()


def untrusted_parent(metadata) -> Context:
    """The caller's W3C trace context, continued (same trace id, its span as the parent) but with
    the sampled flag decided here: the call is not yet authenticated when its span starts, and a
    caller's flag must not decide what the router records (a flood of sampled=1 calls would
    otherwise force every one of them into the trace pipeline)."""
    context = extract(metadata)
    parent = trace.get_current_span(context).get_span_context()
    if not parent.is_valid:
        return context
    flags = TraceFlags(TraceFlags.SAMPLED if _router_samples(SPAN_NAME) else TraceFlags.DEFAULT)
    decided = SpanContext(parent.trace_id, parent.span_id, True, flags, parent.trace_state)
    return trace.set_span_in_context(NonRecordingSpan(decided))


class EventLoopLag:
    """`llm_router_event_loop_lag_seconds`: how late the router's event loop ran a timer, the
    worst over the last `window_s` (a loop stalled by CPU work on it, e.g. tokenizing, shows
    here before anywhere else)."""

    def __init__(self, registry, interval_s: float = 0.05, window_s: float = 1.0):
        self.gauge = Gauge(
            "llm_router_event_loop_lag_seconds",
            f"Worst lateness of the router's event loop over the last {window_s:g} s",
            registry=registry,
        )
        # every sample, for "how often was the loop late by more than X" (a test's or an alert's)
        self.histogram = Histogram(
            "llm_router_event_loop_lag_samples_seconds",
            f"Lateness of the router's event loop, one sample every {interval_s:g} s",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        self.max_gauge = Gauge(
            "llm_router_event_loop_lag_max_seconds",
            "Worst lateness of the router's event loop since it started",
            registry=registry,
        )
        self.max_gauge.set_function(lambda: self.max_lag_s)
        self._interval_s, self._window_s = interval_s, window_s
        self.max_lag_s = 0.0  # since start, for tests and benchmarks
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-loop-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        worst, window_start = 0.0, time.monotonic()
        while True:
            before = time.monotonic()
            await asyncio.sleep(self._interval_s)
            now = time.monotonic()
            lag = max(0.0, now - before - self._interval_s)
            worst = max(worst, lag)
            self.histogram.observe(lag)
            self.max_lag_s = max(self.max_lag_s, lag)
            if now - window_start >= self._window_s:
                self.gauge.set(worst)
                worst, window_start = 0.0, now


class RequestObservation:
    def __init__(self, metrics: RouterMetrics | None, metadata, protocol: str = "grpc"):
        self.arrival_s = time.monotonic()
        self.protocol = protocol
        self._metrics = metrics
        self._clock = TokenClock(metrics.requests, self.arrival_s) if metrics else None
        self.span = tracer.start_span(
            "llm.v1.Generation/Generate",
            context=untrusted_parent(metadata),
            kind=SpanKind.SERVER,
            attributes={"llm.protocol": protocol},
        )
        self._ctx = trace.set_span_in_context(self.span)
        self._stage: trace.Span | None = None
        self._stage_name = ""
        self._stage_start_s = 0.0
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.request_id = self.tenant = self.worker = None
        self.num_prompt_tokens: int | None = None
        self.num_output_tokens = 0
        self._done: Done | None = None
        self._status: str | None = None
        self.model = ""  # the served model (base or LoRA adapter) the request named, once validated
        self.response_format: str | None = None  # the request's format kind (structured output)
        self.tools = 0  # tools the chat shows the model

    def stage(self, name: str, worker: str | None = None) -> None:
        """Ends the current stage and begins `name`; `worker` is the worker the request was placed on."""
        self._end_stage()
        if name == "queue" and self._metrics:
            self._metrics.waiting.inc()
        if name == "route":
            self.worker = worker
            if self._metrics:
                self._metrics.running.inc()
        self._stage_name, self._stage_start_s = name, time.monotonic()
        kind = SpanKind.CLIENT if name == "route" else SpanKind.INTERNAL
        self._stage = tracer.start_span(
            name, context=self._ctx, kind=kind, attributes={"llm.worker.id": worker} if worker else None
        )
        if name == "route":
            self.metadata = inject(trace.set_span_in_context(self._stage))

    def _end_stage(self, error: str | None = None) -> None:
        if self._stage is None:
            return
        if error is not None:
            self._stage.set_status(Status(StatusCode.ERROR, error))
        self._stage.end()
        if self._stage_name == "queue" and self._metrics:
            self._metrics.waiting.dec()
            self._metrics.requests.queue.observe(time.monotonic() - self._stage_start_s)
        if self._stage_name == "route" and self._metrics:
            self._metrics.running.dec()
        self._stage = None

    def request(
        self,
        request_id: str,
        tenant: str,
        model: str,
        num_prompt_tokens: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
    ) -> None:
        self.request_id, self.tenant, self.num_prompt_tokens = request_id, tenant, num_prompt_tokens
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    **genai_request_attributes(
                        request_id, tenant, model, max_tokens, temperature, num_prompt_tokens
                    ),
                    "gen_ai.request.top_p": top_p,
                }
            )

    def event(self, event: Chunk | Done) -> None:
        if isinstance(event, Done):
            self._done = event
            return
        self.num_output_tokens += len(event.token_ids)
        if self._clock is not None:
            self._clock.tokens(len(event.token_ids), time.monotonic())

    def fail(self, exc: BaseException) -> None:
        self._status = status_of(exc)
        message = exc.message if isinstance(exc, RouterError) else type(exc).__name__
        if self._status != "cancelled":
            self.span.set_status(Status(StatusCode.ERROR, message))
        self._end_stage(error=None if self._status == "cancelled" else message)

    def finish(self) -> None:
        self._end_stage()
        done = self._done
        status = self._status or (done.reason if done else "cancelled")
        served = self.worker is not None
        if self._clock is not None:
            self._clock.finish(status, self.num_prompt_tokens if served else None, time.monotonic())
            self._metrics.by_protocol.labels(self.protocol, status).inc()
            if self.model:
                self._metrics.by_model.labels(self.model, status).inc()
                if served:
                    tokens = self._metrics.tokens_by_model
                    tokens.labels(self.model, "prompt").inc(self.num_prompt_tokens or 0)
                    tokens.labels(self.model, "generation").inc(self.num_output_tokens)
            if self.response_format:
                self._metrics.structured.labels(self.response_format, status).inc()
        trace_id = trace_id_of(self.span)
        if self.span.is_recording():
            self.span.set_attribute("gen_ai.response.finish_reasons", [status])
            if self.response_format:
                self.span.set_attribute("llm.response_format", self.response_format)
            if self.tools:
                self.span.set_attribute("llm.tools", self.tools)
            if self.worker:
                self.span.set_attribute("llm.worker.id", self.worker)
            if done is not None:
                self.span.set_attributes(
                    {
                        "gen_ai.usage.output_tokens": self.num_output_tokens,
                        "gen_ai.usage.cache_read.input_tokens": done.cached_prompt_tokens,
                        "llm.time_to_first_token_s": done.ttft_ms / 1e3,
                    }
                )
        self.span.end()
        log_request(
            requests_log,
            request_id=self.request_id,
            tenant=self.tenant,
            protocol=self.protocol,
            status=status,
            worker=self.worker,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens if served else None,
            cached_prompt_tokens=done.cached_prompt_tokens if done else None,
            queue_ms=round(done.queue_ms, 1) if done else None,
            ttft_ms=round(done.ttft_ms, 1) if done else None,
            total_ms=round((time.monotonic() - self.arrival_s) * 1e3, 1),
            trace_id=trace_id or None,
        )
