"""Observability parts in process, in milliseconds: trace-context propagation, telemetry config,
the /metrics + /targets HTTP server, the JSON log line, and the router's and worker's per-request
observations (span trees from an in-memory exporter, metric values from the registry)."""

import argparse
import json
import logging
import socket
import urllib.request
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from common import telemetry
from common.logs import _JsonFormatter, log_request
from common.metrics_http import start_metrics_server
from common.request_metrics import RequestMetrics

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans(monkeypatch):
    """A private SDK tracer for router.observe and worker.observe (the global provider stays unset)."""
    import router.observe
    import worker.observe

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(router.observe, "tracer", tracer)
    monkeypatch.setattr(worker.observe, "tracer", tracer)
    return exporter


def samples(registry):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def test_traceparent_round_trip_through_metadata():
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("route")
    metadata = telemetry.inject(trace.set_span_in_context(span))
    assert [k for k, _ in metadata] == ["traceparent"]
    remote = trace.get_current_span(telemetry.extract([("authorization", "Bearer x"), *metadata]))
    assert remote.get_span_context().trace_id == span.get_span_context().trace_id
    assert remote.get_span_context().span_id == span.get_span_context().span_id
    assert remote.get_span_context().is_remote
    assert telemetry.inject(Context()) == ()
    assert not trace.get_current_span(telemetry.extract(None)).get_span_context().is_valid


def test_no_exporter_means_no_sdk_but_the_client_trace_id_survives():
    assert not telemetry.setup_tracing(telemetry.TelemetryConfig(), "test").enabled
    noop = trace.NoOpTracer()
    span = noop.start_span("x", context=telemetry.extract([("traceparent", TRACEPARENT)]))
    assert telemetry.trace_id_of(span) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert telemetry.trace_id_of(noop.start_span("y")) == ""


def test_config_from_flags_and_environment():
    p = argparse.ArgumentParser()
    telemetry.add_args(p, default_metrics_port=9464)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert telemetry.from_args(p.parse_args([]), environ={}) == telemetry.TelemetryConfig()
    assert telemetry.from_args(p.parse_args([]), environ=env).otlp_endpoint == "http://collector:4317"
    flags = [
        "--otlp-endpoint",
        "http://x:1",
        "--trace-sample-ratio",
        "0.1",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
    ]
    flagged = telemetry.from_args(p.parse_args(flags), environ=env)
    assert (flagged.otlp_endpoint, flagged.sample_ratio, flagged.metrics_port, flagged.log_format) == (
        "http://x:1",
        0.1,
        0,
        "json",
    )
    assert flagged.tracing
    with pytest.raises(ValueError, match="sample ratio"):
        telemetry.TelemetryConfig(sample_ratio=1.5)


def test_metrics_server_serves_metrics_and_targets():
    registry = CollectorRegistry()
    RequestMetrics(registry, "test").requests.labels("stop").inc(3)
    server = start_metrics_server("127.0.0.1", 0, 0, registry, {"/targets": lambda: [{"targets": ["a:1"]}]})
    try:
        text = urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["llm_requests"].samples[0].value == 3
        assert "llm_requests_created" not in text
        body = urllib.request.urlopen(f"http://{server.address}/targets", timeout=5)
        assert body.headers["Content-Type"] == "application/json"
        assert json.loads(body.read()) == [{"targets": ["a:1"]}]
    finally:
        server.close()


def test_metrics_port_taken_falls_back_only_from_the_default():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_metrics_server("127.0.0.1", None, port, CollectorRegistry())
        assert server.port not in (0, port)
        server.close()
        with pytest.raises(OSError):
            start_metrics_server("127.0.0.1", port, 9464, CollectorRegistry())
    assert start_metrics_server("127.0.0.1", -1, 9464, CollectorRegistry()) is None


def test_request_log_line_is_json_with_fields():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("test.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_request(logger, request_id="r1", status="stop", trace_id="ab" * 16, ttft_ms=None)
    finally:
        logger.removeHandler(handler)
    line = json.loads(_JsonFormatter("router").format(records[0]))
    assert line["msg"] == "request finished" and line["component"] == "router"
    assert (line["request_id"], line["status"], line["trace_id"]) == ("r1", "stop", "ab" * 16)
    assert "ttft_ms" not in line


def _output(tokens, finished=False, preemptions=0, queue_s=0.01, ttft_s=0.05, num_out=1):
    from worker.types import FinishReason, RequestOutput

    return RequestOutput(
        "w1",
        tokens,
        None,
        finished,
        FinishReason.LENGTH if finished else None,
        5,
        num_out,
        2,
        queue_s=queue_s,
        ttft_s=ttft_s,
        num_preemptions=preemptions,
    )


def test_worker_observation_derives_queue_prefill_decode(spans, monkeypatch):
    import worker.observe
    from worker.observe import RequestObservation

    now = [100.0]
    clock = SimpleNamespace(monotonic=lambda: now[0], time_ns=lambda: 10**18)
    monkeypatch.setattr(worker.observe, "time", clock)
    registry = CollectorRegistry()
    metrics = SimpleNamespace(requests=RequestMetrics(registry, "worker"))
    obs = RequestObservation(
        metrics,
        worker_id="127.0.0.1:1",
        model="m",
        request_id="w1",
        tenant="t",
        num_prompt_tokens=5,
        max_tokens=3,
        temperature=0.0,
        metadata=[("traceparent", TRACEPARENT)],
    )
    for t, out in (
        (100.06, _output([7])),
        (100.1, _output([8], preemptions=1, num_out=2)),
        (100.15, _output([9], finished=True, preemptions=1, num_out=3)),
    ):
        now[0] = t
        obs.output(out)
    now[0] = 100.2
    obs.finish()

    by_name = {s.name: s for s in spans.get_finished_spans()}
    root = by_name["llm.v1.Worker/Generate"]
    assert root.parent.span_id == 0x00F067AA0BA902B7 and root.parent.is_remote
    assert [e.name for e in root.events] == ["first_token", "preempted"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert root.attributes["llm.num_preemptions"] == 1
    queue, prefill, decode = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert all(s.parent.span_id == root.context.span_id for s in (queue, prefill, decode))
    assert root.start_time == queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time == root.end_time
    ms = 1_000_000
    # queue ends at first token (60 ms) - engine prefill (ttft_s - queue_s = 40 ms)
    assert (queue.start_time, queue.end_time) == (10**18, 10**18 + 20 * ms)
    assert (prefill.end_time, decode.end_time) == (10**18 + 60 * ms, 10**18 + 200 * ms)
    assert prefill.attributes["llm.prefill.num_tokens"] == 3  # 5 prompt - 2 cached

    got = samples(registry)
    assert got[("llm_requests_total", (("status", "length"),))] == 1
    assert got[("llm_generation_tokens_total", ())] == 3
    assert got[("llm_prompt_tokens_total", ())] == 5
    assert got[("llm_time_to_first_token_seconds_count", ())] == 1
    assert got[("llm_inter_token_latency_seconds_count", ())] == 2
    assert got[("llm_queue_time_seconds_sum", ())] == pytest.approx(0.02)
    assert got[("llm_time_to_first_token_seconds_sum", ())] == pytest.approx(0.06)


def test_router_observation_stages_and_failure(spans):
    from router.errors import Overloaded
    from router.metrics import RouterMetrics
    from router.observe import RequestObservation
    from router.relay import Chunk, Done

    metrics = RouterMetrics()
    obs = RequestObservation(metrics, ())
    for stage in ("auth", "validate", "admission", "queue"):
        obs.stage(stage)
    obs.request("r1", "acme", "m", 5, 2, 0.7, 0.9)
    assert samples(metrics.registry)[("llm_num_requests_waiting", ())] == 1
    obs.stage("route", worker="127.0.0.1:2")
    assert samples(metrics.registry)[("llm_num_requests_running", ())] == 1
    for event in (Chunk([1], "a", []), Chunk([2], "b", []), Done("r1", "length", 5, 2, 0, 1.0, 2.0, 3.0)):
        obs.event(event)
    obs.finish()

    by_name = {s.name: s for s in spans.get_finished_spans()}
    root, route = by_name["llm.v1.Generation/Generate"], by_name["route"]
    assert root.parent is None and root.kind == trace.SpanKind.SERVER
    assert all(
        by_name[n].parent.span_id == root.context.span_id
        for n in ("auth", "validate", "admission", "queue", "route")
    )
    assert route.kind == trace.SpanKind.CLIENT and route.attributes["llm.worker.id"] == "127.0.0.1:2"
    assert dict(obs.metadata)["traceparent"].split("-")[2] == f"{route.context.span_id:016x}"
    assert root.attributes["gen_ai.request.temperature"] == 0.7
    assert root.attributes["gen_ai.usage.output_tokens"] == 2

    refused = RequestObservation(metrics, ())
    refused.stage("admission")
    refused.fail(Overloaded("budget", 100))
    refused.finish()
    failed = [s for s in spans.get_finished_spans() if s.name == "admission"][-1]
    assert failed.status.status_code == trace.StatusCode.ERROR

    got = samples(metrics.registry)
    assert got[("llm_requests_total", (("status", "length"),))] == 1
    assert got[("llm_requests_total", (("status", "resource_exhausted"),))] == 1
    assert got[("llm_prompt_tokens_total", ())] == 5  # the refused request was never served
    assert got[("llm_generation_tokens_total", ())] == 2
    assert got[("llm_num_requests_running", ())] == got[("llm_num_requests_waiting", ())] == 0
    assert got[("llm_queue_time_seconds_count", ())] == 1


def test_dashboard_reads_only_exported_metrics():
    import pathlib
    import re

    from router.metrics import RouterMetrics
    from worker.metrics import WorkerMetrics
    from worker.types import EngineStats

    router = RouterMetrics()
    router.export_admission(lambda: {("t", "rate_limited"): 1}, lambda: {"t": 1})
    engine = SimpleNamespace(stats=lambda: EngineStats(0, 0, 10, 10, 0, 0, 0, 0, 0), step_observers=[])
    worker = WorkerMetrics(engine)
    router.requests.requests.labels("stop").inc()
    worker.requests.requests.labels("stop").inc()
    exported = {s.name for m in (router, worker) for family in m.registry.collect() for s in family.samples}
    exported |= {
        f"{h}_bucket"
        for h in (
            "llm_time_to_first_token_seconds",
            "llm_inter_token_latency_seconds",
            "llm_e2e_request_latency_seconds",
            "llm_queue_time_seconds",
            "llm_request_prompt_tokens",
            "llm_request_generation_tokens",
        )
    }
    dashboard = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "llm-serve.json"
    used = set(re.findall(r"\bllm_[a-z0-9_]+", dashboard.read_text()))
    assert used and used <= exported, used - exported


def test_oversized_trace_headers_are_dropped_without_a_log_line(caplog):
    valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace.get_current_span(telemetry.extract([("traceparent", valid)])).get_span_context().is_valid
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):
            ctx = telemetry.extract([("traceparent", valid + "x" * 600), ("tracestate", "k=v," * 300)])
    assert not trace.get_current_span(ctx).get_span_context().is_valid
    assert not caplog.records, [r.getMessage() for r in caplog.records]
