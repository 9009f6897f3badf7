"""`make serve` (python -m deploy.local: Ray in-process, a worker actor with the embedded model and
the router, from one command), one stack for the module (starting Ray and a worker actor is the
cost here):
- the README's question on the default weights (int4) streams the greedy answer, then finishes;
- it honours the standard OTEL_* environment and the LLM_* variables: with
  OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP/gRPC sink in this process, one request yields a
  trace with spans from both the router and the worker actor; LLM_MAX_MODEL_LEN reaches the
  worker's engine (before, such a stack exported no spans: only python -m router/worker read it);
- its worker refuses direct calls (no token: issue 17 item 1, as tests/test_trust_auth.py for
  `python -m worker`) while its router serves;
- SIGTERM stops it all (router, worker actor, Ray) with status 0 and Ray reaps the worker
  processes (checked in the fixture's teardown: a failure there is reported as an error).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2_grpc
from tests import procs
from tests.test_trust_auth import worker_calls

pytest.importorskip("ray")

MAX_MODEL_LEN = 384


def test_make_serve_runs_the_ray_launcher():
    dry = subprocess.run(
        ["make", "-n", "serve", "WORKERS=3"], cwd=procs.REPO, capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"python -m deploy\.local .*--workers 3", dry), dry


def wait_router(proc: procs.Proc, timeout_s: float) -> str:
    """The router's address from its "router listening on" line (a worker's comes first)."""
    return proc.wait_for_line(r"router listening on (\S+)", timeout_s).group(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(sink, tmp_path_factory):
    """(process, router address) of one `make serve` stack; its teardown checks the clean stop."""
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
                "--workers",
                "1",
                # the default weights (int4 from the GGUF, bfloat16 activations or int8 ones on VNNI / AVX2):
                # the README's question is answered as users of `make serve` get it
                "--kv-cache-mb",  # 32 MiB hold more than MAX_MODEL_LEN tokens
                "32",
                "--max-num-seqs",
                "4",
                # as procs.start_worker's 0.5 s: the only router is the stack's own, stopped first
                "--worker-drain-announce-s",
                "0.2",
            ],
            tmp_path_factory.mktemp("serve"),
        )
    try:
        address = wait_router(proc, procs.START_TIMEOUT_S)
        procs.wait_for_workers(address, 1, timeout_s=60)
        yield proc, address
        worker_pids = {int(p) for p in re.findall(r"WorkerActor pid=(\d+)", proc.log_tail(100_000))}
        assert worker_pids, proc.log_tail()
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(90) == 0, proc.log_tail()
        assert "stopped: router, workers worker-0, Ray" in proc.log_tail()
        # Ray reaps its workers as it shuts down
        procs.wait_until(lambda: not any(alive(p) for p in worker_pids), 15, "worker processes gone")
    finally:
        proc.stop()


def test_make_serve_streams_the_readme_answer(stack):
    """The README's first try on the default weights, sampling left to the model's defaults (greedy)."""
    _, address = stack
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        question = pb.ChatMessage(role="user", content="What is the capital of Germany?")
        msgs = list(
            stub.Generate(
                pb.GenerateRequest(
                    chat=pb.Chat(messages=[question]), stopping=pb.StoppingCriteria(max_tokens=16)
                ),
                timeout=120,
            )
        )
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    assert len(chunks) > 1 and msgs[-1].HasField("finished")  # streamed, then finished
    assert "".join(c.text for c in chunks) == "The capital of Germany is Berlin."


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

    def traced_by_both(spans) -> bool:
        """This request's trace holds a router span and a worker span; the router's worker call
        carries "<request id>/<attempt suffix>" (other requests of the module have traces too)."""
        ours = {
            s.trace_id
            for s in spans
            if s.service == "llm-worker"
            and str(s.attributes.get("llm.request_id", "")).startswith("serve-traced/")
        }
        return any(s.service == "llm-router" and s.trace_id in ours for s in spans)

    sink.wait_for(traced_by_both, timeout_s=60)


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
