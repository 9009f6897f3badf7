"""Observability through real processes: client -> router -> worker on 127.0.0.1, both exporting
spans over OTLP/gRPC to a receiver in this process, both serving Prometheus /metrics.

Acceptance 1 (one trace across both processes, worker spans children of the router's route span),
2 (a client traceparent parents the router span), 3 (counters equal a known workload; TTFT count
equals the request count), plus /targets service discovery, admission refusals by tenant and
reason, and the JSON request log line carrying the trace id.
"""

import json
import time
import urllib.request

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests import procs

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
TOKEN_BUDGET = 600  # --max-tokens-in-flight: a request asking for more is refused


@pytest.fixture(scope="module")
def sink(shared_sink):
    """The session's OTLP receiver, which the shared worker exports to (tests/conftest.py)."""
    return shared_sink


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker: spans to `sink` within 50 ms, /metrics on an ephemeral port."""
    return plain_worker


@pytest.fixture(scope="module")
def router(worker, logs, sink):
    with procs.running_router(
        logs,
        [worker.address],
        "--otlp-endpoint",
        sink.endpoint,
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        "--max-tokens-in-flight",
        str(TOKEN_BUDGET),
        env=procs.FAST_SPAN_EXPORT,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def router_metrics(router):
    return procs.metrics_address(router)


@pytest.fixture(scope="module")
def worker_metrics(worker):
    return procs.worker_metrics_address(worker.address)  # asserts that the worker names one


def generate(stub, prompt_ids, max_tokens, request_id, metadata=()):
    request = pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )
    finished = None
    for msg in stub.Generate(request, metadata=metadata, timeout=120):
        if msg.HasField("finished"):
            finished = msg.finished
    assert finished is not None
    return finished


def request_trace(sink, request_id):
    """All spans of the trace whose router span carries `request_id`, once both sides exported."""
    last = {("llm-router", "route"), ("llm-worker", "llm.v1.Worker/Generate"), ("llm-worker", "decode")}

    def root_of(spans):
        return next(
            (
                s
                for s in spans
                if s.service == "llm-router" and s.attributes.get("llm.request_id") == request_id
            ),
            None,
        )

    def complete(spans):
        root = root_of(spans)
        names = {(s.service, s.name) for s in spans if root is not None and s.trace_id == root.trace_id}
        return root is not None and last <= names

    spans = sink.wait_for(complete, timeout_s=30)
    root = root_of(spans)
    return root, [s for s in spans if s.trace_id == root.trace_id]


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_metrics(address, check, timeout_s=10.0):
    """Scrapes until `check(samples)` holds: a process records a request just after its last message."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = procs.scrape(address)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_one_trace_spans_router_and_worker(stub, sink):
    prompt = list(range(1000, 1020))
    finished = generate(stub, prompt, 4, "trace-1")
    root, spans = request_trace(sink, "trace-1")
    by_name = {(s.service, s.name): s for s in spans}

    assert root.name == "llm.v1.Generation/Generate" and root.kind == SERVER and root.parent_span_id == ""
    for stage in ("auth", "validate", "admission", "queue", "route"):
        assert by_name[("llm-router", stage)].parent_span_id == root.span_id, stage
    route = by_name[("llm-router", "route")]
    assert route.kind == CLIENT
    worker_span = by_name[("llm-worker", "llm.v1.Worker/Generate")]
    assert worker_span.kind == SERVER
    assert worker_span.parent_span_id == route.span_id  # the trace crosses the process boundary
    for child in ("queue", "prefill", "decode"):
        span = by_name[("llm-worker", child)]
        assert span.parent_span_id == worker_span.span_id
        assert worker_span.start_ns <= span.start_ns <= span.end_ns <= worker_span.end_ns
    assert by_name[("llm-worker", "queue")].end_ns <= by_name[("llm-worker", "prefill")].start_ns
    assert by_name[("llm-worker", "prefill")].end_ns <= by_name[("llm-worker", "decode")].start_ns
    assert "first_token" in worker_span.events
    assert route.start_ns <= worker_span.start_ns and worker_span.end_ns <= root.end_ns + 50_000_000

    for span in (root, worker_span):
        a = span.attributes
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.usage.input_tokens"] == len(prompt) == finished.usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == 4 == finished.usage.completion_tokens
        assert a["gen_ai.request.model"] and a["llm.tenant"] == "default"
        assert a["llm.time_to_first_token_s"] > 0
        assert a["llm.worker.id"] == route.attributes["llm.worker.id"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == finished.usage.cached_prompt_tokens


def test_client_traceparent_parents_the_router_span(stub, sink, router):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    generate(stub, list(range(2000, 2010)), 2, "trace-2", metadata=(("traceparent", traceparent),))
    root, spans = request_trace(sink, "trace-2")
    assert root.trace_id == trace_id
    assert root.parent_span_id == parent_id
    assert {s.service for s in spans} == {"llm-router", "llm-worker"}

    def logged(proc):
        for line in proc.log_path.read_text().splitlines():
            if line.startswith("{") and '"request finished"' in line:
                entry = json.loads(line)
                if entry.get("request_id") == "trace-2":
                    return entry
        return None

    deadline = time.monotonic() + 10
    while (entry := logged(router)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry is not None, router.log_tail()
    assert entry["trace_id"] == trace_id and entry["status"] == "length"
    assert entry["prompt_tokens"] == 10 and entry["completion_tokens"] == 2 and entry["tenant"] == "default"


def test_metrics_equal_the_workload(stub, router_metrics, worker_metrics):
    prompts = [list(range(3000 + 50 * i, 3000 + 50 * i + 8 + 5 * i)) for i in range(3)]
    max_tokens = 3
    sides = (("router", router_metrics), ("worker", worker_metrics))
    before = {side: procs.scrape(address) for side, address in sides}
    for i, prompt in enumerate(prompts):
        generate(stub, prompt, max_tokens, f"metrics-{i}")
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, prompts[0], TOKEN_BUDGET, "metrics-refused")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    want = {
        "llm_requests_total": len(prompts),
        "llm_prompt_tokens_total": sum(map(len, prompts)),
        "llm_generation_tokens_total": max_tokens * len(prompts),
        "llm_time_to_first_token_seconds_count": len(prompts),
        "llm_e2e_request_latency_seconds_count": len(prompts),
        "llm_queue_time_seconds_count": len(prompts),
        "llm_inter_token_latency_seconds_count": (max_tokens - 1) * len(prompts),
        "llm_request_prompt_tokens_sum": sum(map(len, prompts)),
        "llm_request_generation_tokens_sum": max_tokens * len(prompts),
    }
    for side, address in sides:

        def delta(samples, name, **labels):
            return value(samples, name, **labels) - value(before[side], name, **labels)

        def done(samples):
            return delta(samples, "llm_requests_total", status="length") >= len(prompts)

        after = wait_metrics(address, done)
        got = {
            name: delta(after, name, **({"status": "length"} if name == "llm_requests_total" else {}))
            for name in want
        }
        assert got == want, side
        assert value(after, "llm_num_requests_running") == 0
        assert value(after, "llm_num_requests_waiting") == 0
        if side == "router":
            assert delta(after, "llm_requests_total", status="resource_exhausted") == 1
            refused = {"tenant": "default", "reason": "token_budget"}
            assert delta(after, "llm_admission_rejections_total", **refused) == 1
            assert delta(after, "llm_admitted_requests_total", tenant="default") == len(prompts)
        else:
            assert delta(after, "llm_prefix_cache_queries_total") == sum(map(len, prompts))
            # One observation per committed step (the requests ran one at a time: one sequence
            # each); tokens computed = the prompts less prefix-cache hits, plus one per decode step.
            steps = sum(delta(after, "llm_engine_steps_total", mode=m) for m in ("overlapped", "synchronous"))
            assert delta(after, "llm_engine_step_duration_seconds_count") == steps >= 3 * len(prompts)
            assert delta(after, "llm_engine_step_duration_seconds_sum") > 0
            assert delta(after, "llm_engine_step_sequences_sum") == steps
            hits = delta(after, "llm_prefix_cache_hits_total")
            computed = sum(map(len, prompts)) - hits + (max_tokens - 1) * len(prompts)
            assert delta(after, "llm_engine_step_tokens_sum") == computed
            assert value(after, "llm_kv_cache_free_blocks") == value(after, "llm_kv_cache_total_blocks") > 0
            assert value(after, "llm_kv_cache_usage_ratio") == 0.0
            assert ("llm_preemptions_total", ()) in after


def test_targets_list_worker_metrics(router_metrics, worker_metrics, worker):
    groups = json.loads(urllib.request.urlopen(f"http://{router_metrics}/targets", timeout=5).read())
    assert groups == [
        {
            "targets": [worker_metrics],
            "labels": {"job": "llm-worker", "worker": worker.address, "model": groups[0]["labels"]["model"]},
        }
    ]
