"""A `make serve` stack (python -m deploy.local: Ray in-process, a worker actor, the router) honours
the standard OTEL_* environment and the LLM_* variables: with OTEL_EXPORTER_OTLP_ENDPOINT pointing
at an OTLP/gRPC sink in this process, one request yields a trace with spans from both the router
and the worker actor; LLM_MAX_MODEL_LEN reaches the worker's engine. (Before, such a stack
exported no spans: only python -m router/worker read the variable.) Its worker refuses direct
calls (no token: issue 17 item 1, as tests/test_trust_auth.py for `python -m worker`) while its
router serves, and SIGTERM stops the whole stack with status 0. One stack for the module: starting
Ray and a worker actor is the cost here.
"""

from __future__ import annotations

import re
import signal

import grpc
import pytest

from devtools.otlp_sink import OtlpSink
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2_grpc
from tests import procs
from tests.test_trust_auth import worker_calls

pytest.importorskip("ray")

MAX_MODEL_LEN = 384


def wait_router(proc: procs.Proc, timeout_s: float) -> str:
    """The router's address from its "router listening on" line (a worker's comes first)."""
    return proc.wait_for_line(r"router listening on (\S+)", timeout_s).group(1)


@pytest.fixture(scope="module")
def sink():
    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def stack(sink, tmp_path_factory):
    """(process, router address) of one `make serve` stack. Teardown checks that SIGTERM stops it
    all (router, worker actor, Ray) with status 0: a failure there is reported as an error."""
    with pytest.MonkeyPatch.context() as m:  # the stack inherits these; this process does not keep them
        m.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        m.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not the default 5 s
        m.setenv("LLM_MAX_MODEL_LEN", str(MAX_MODEL_LEN))
        m.setenv("LLM_ENFORCE_EAGER", "true")  # no compiled-decode warm-up: a quick start
        m.delenv("LLM_OTLP_ENDPOINT", raising=False)
        m.delenv("LLM_WORKER_TOKEN", raising=False)  # the stack makes its own token
        proc = procs.Proc(
            "serve",
            [
                "-m",
                "deploy.local",
                "--port",
                "0",
                "--num-workers",
                "1",
                "--kv-cache-mb",
                "16",
                "--max-num-seqs",
                "4",
                "--worker-drain-announce-s",
                "0.2",
            ],
            tmp_path_factory.mktemp("serve"),
        )
    try:
        address = wait_router(proc, procs.START_TIMEOUT_S)
        procs.wait_for_workers(address, 1, timeout_s=60)
        yield proc, address
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(90) == 0, proc.log_tail()
        assert "stopped: router, workers worker-0, Ray" in proc.log_tail()
    finally:
        proc.stop()


def test_make_serve_exports_spans_from_router_and_workers(stack, sink):
    _, address = stack
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        [model] = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert model.max_model_len == MAX_MODEL_LEN  # LLM_MAX_MODEL_LEN reached the engine
        msgs = list(
            stub.Generate(
                pb.GenerateRequest(
                    request_id="serve-traced",
                    token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5]),
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_tokens=3, ignore_eos=True),
                ),
                timeout=120,
            )
        )
    assert msgs[-1].HasField("finished")

    def one_trace_from_both(spans) -> bool:
        traces: dict[str, set[str]] = {}
        for span in spans:
            traces.setdefault(span.trace_id, set()).add(span.service)
        return any({"llm-router", "llm-worker"} <= services for services in traces.values())

    spans = sink.wait_for(one_trace_from_both, timeout_s=60)
    worker_spans = [s for s in spans if s.service == "llm-worker"]
    # the router's worker call carries "<request id>/<attempt suffix>"
    assert any(
        str(s.attributes.get("llm.request_id", "")).startswith("serve-traced/") for s in worker_spans
    ), [(s.name, s.attributes) for s in worker_spans]


def test_make_serve_workers_refuse_direct_calls(stack):
    proc, address = stack
    found = re.search(r"Ready: workers on (\S+?)\.\s", proc.log_tail(100_000))
    assert found, proc.log_tail()
    with grpc.insecure_channel(found.group(1)) as channel:
        codes = worker_calls(worker_pb2_grpc.WorkerStub(channel), ())
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    with grpc.insecure_channel(address) as channel:  # while its own router is served
        msgs = list(
            generation_pb2_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=2)), timeout=60
            )
        )
    assert msgs[-1].finished.usage.completion_tokens == 2
