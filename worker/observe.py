"""One worker request, observed: its span (continuing the router's trace), metrics and log line.

Contract
- input: the request's plain values and its gRPC metadata (`traceparent`), then every
  `RequestOutput` as it reaches the gRPC side (`output`), then `finish(status)` exactly once.
- output: span `llm.v1.Worker/Generate` (SERVER, child of the router's route span) with children
  `queue`, `prefill`, `decode`, an event `first_token` and one `preempted` event per preemption;
  the `common.request_metrics` families; one "request finished" log line with the trace id.
  Child spans are derived at the end rather than opened live: the engine thread reports
  queue_s (arrival -> first schedule) and ttft_s (arrival -> first token) on each output, and the
  first token's arrival here anchors them, so this side never runs on the engine thread.
- state: per request only. Status vocabulary: stop | length | cancelled | invalid_argument | internal.
- proven by: tests/test_observability_e2e.py.
"""

from __future__ import annotations

import logging
import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.logs import log_request
from common.request_metrics import TokenClock
from common.telemetry import extract, genai_request_attributes, trace_id_of
from worker.metrics import WorkerMetrics
from worker.types import FinishReason, RequestOutput

tracer = trace.get_tracer("llm.worker")
requests_log = logging.getLogger("llm.requests")
STATUS_OF = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled"}
OK_STATUSES = ("stop", "length", "cancelled")


class RequestObservation:
    def __init__(
        self,
        metrics: WorkerMetrics | None,
        *,
        worker_id: str,
        model: str,
        request_id: str,
        tenant: str,
        num_prompt_tokens: int,
        max_tokens: int,
        temperature: float,
        metadata,
    ):
        self.start_s = time.monotonic()
        self._start_ns = time.time_ns()
        self.request_id = request_id
        self.tenant = tenant
        self.num_prompt_tokens = num_prompt_tokens
        self._clock = TokenClock(metrics.requests, self.start_s) if metrics else None
        self._metrics = metrics
        self._last: RequestOutput | None = None
        self._first_token_s: float | None = None
        self._num_preemptions = 0
        self.status = "cancelled"  # until the engine says otherwise: the call ended early
        self.span = tracer.start_span(
            "llm.v1.Worker/Generate",
            context=extract(metadata),
            kind=SpanKind.SERVER,
            start_time=self._start_ns,
        )
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    **genai_request_attributes(
                        request_id, tenant, model, max_tokens, temperature, num_prompt_tokens
                    ),
                    "llm.worker.id": worker_id,
                }
            )

    def _ns(self, t_s: float) -> int:
        return self._start_ns + round((t_s - self.start_s) * 1e9)

    def output(self, out: RequestOutput) -> None:
        now_s = time.monotonic()
        n = len(out.new_token_ids)
        if n and self._first_token_s is None:
            self._first_token_s = now_s
            self.span.add_event("first_token", timestamp=self._ns(now_s))
        if out.num_preemptions > self._num_preemptions:
            self._num_preemptions = out.num_preemptions
            self.span.add_event(
                "preempted", {"llm.num_preemptions": out.num_preemptions}, timestamp=self._ns(now_s)
            )
        if self._clock is not None:
            self._clock.tokens(n, now_s)
        self._last = out
        if out.finished:
            self.status = STATUS_OF[out.finish_reason]

    def fail(self, status: str, message: str) -> None:
        self.status = status
        self.span.set_status(Status(StatusCode.ERROR, message))

    def finish(self) -> None:
        end_s = time.monotonic()
        out = self._last
        queue_end_s = self._queue_end_s(out, end_s)
        if self._metrics is not None:
            if queue_end_s is not None:
                self._metrics.requests.queue.observe(queue_end_s - self.start_s)
            served = self.status in OK_STATUSES
            self._clock.finish(self.status, self.num_prompt_tokens if served else None, end_s)
        num_out = out.num_output_tokens if out else 0
        cached = out.num_cached_tokens if out else 0
        ttft_s = None if self._first_token_s is None else self._first_token_s - self.start_s
        if self.span.is_recording():
            self._child_spans(queue_end_s, end_s, cached, num_out)
            self.span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": num_out,
                    "gen_ai.usage.cache_read.input_tokens": cached,
                    "gen_ai.response.finish_reasons": [self.status],
                    "llm.num_preemptions": self._num_preemptions,
                }
            )
            if ttft_s is not None:
                self.span.set_attribute("llm.time_to_first_token_s", ttft_s)
        trace_id = trace_id_of(self.span)
        self.span.end(end_time=self._ns(end_s))
        log_request(
            requests_log,
            request_id=self.request_id,
            tenant=self.tenant,
            status=self.status,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_out,
            cached_prompt_tokens=cached,
            queue_ms=None if queue_end_s is None else round((queue_end_s - self.start_s) * 1e3, 1),
            ttft_ms=None if ttft_s is None else round(ttft_s * 1e3, 1),
            total_ms=round((end_s - self.start_s) * 1e3, 1),
            preemptions=self._num_preemptions,
            trace_id=trace_id or None,
        )

    def _queue_end_s(self, out: RequestOutput | None, end_s: float) -> float | None:
        """When the engine first scheduled the request, on this side's clock (None: never)."""
        if self._first_token_s is not None and out is not None:
            prefill_s = max(0.0, out.ttft_s - out.queue_s)  # engine clock: first schedule -> first token
            return max(self.start_s, self._first_token_s - prefill_s)
        if out is not None and out.queue_s > 0:  # scheduled, ended before its first token
            return min(end_s, self.start_s + out.queue_s)
        return None

    def _child_spans(self, queue_end_s: float | None, end_s: float, cached: int, num_out: int) -> None:
        parent = trace.set_span_in_context(self.span)

        def child(name: str, start_s: float, stop_s: float, **attributes) -> None:
            span = tracer.start_span(
                name, context=parent, start_time=self._ns(start_s), attributes=attributes
            )
            span.end(end_time=self._ns(max(start_s, stop_s)))

        child("queue", self.start_s, end_s if queue_end_s is None else queue_end_s)
        if queue_end_s is None:
            return
        prefill_end_s = end_s if self._first_token_s is None else self._first_token_s
        child(
            "prefill",
            queue_end_s,
            prefill_end_s,
            **{
                "llm.prefill.num_tokens": self.num_prompt_tokens - cached,
                "gen_ai.usage.cache_read.input_tokens": cached,
            },
        )
        if self._first_token_s is not None:
            child("decode", self._first_token_s, end_s, **{"gen_ai.usage.output_tokens": num_out})
