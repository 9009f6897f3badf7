"""Issue 17 item 1: workers trust only their deployment's routers (common/auth.py).

Real processes over 127.0.0.1: a `python -m worker` with a token (from LLM_WORKER_TOKEN, the way
the launchers hand it over), direct calls with no token or a wrong one (UNAUTHENTICATED, before
anything runs: no sequence, no salt), the router with the token (served), the router without it
(UNAVAILABLE, no worker address in the message). `make serve` (deploy/local.py, which starts its
workers with the Ray launcher): its worker refuses a direct call while its router serves, checked on
tests/test_ray_serve.py's stack (one Ray stack for all its checks; `worker_calls` is shared).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import METADATA_KEY
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests import procs

TOKEN = "test-token-0123456789"


def worker_calls(stub, metadata):
    """Every llm.v1.Worker method, called with `metadata`; returns the status of each."""
    codes = {}
    request = worker_pb2.WorkerRequest(
        request_id="direct",
        prompt_token_ids=[1, 2, 3],
        sampling=worker_pb2.WorkerSampling(max_tokens=2, top_p=1.0),
        cache_salt="another-tenant",
    )
    calls = {
        "GetInfo": lambda: stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=metadata, timeout=10),
        "GetLoad": lambda: stub.GetLoad(worker_pb2.GetLoadRequest(), metadata=metadata, timeout=10),
        "Generate": lambda: list(stub.Generate(request, metadata=metadata, timeout=30)),
    }
    for name, call in calls.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                assert TOKEN not in exc.details() and "wrong" not in exc.details()
    return codes


@pytest.fixture(scope="module")
def worker(logs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_WORKER_TOKEN", TOKEN)  # the launchers' way: a variable, not a flag
        proc = procs.start_worker(logs)
    try:
        procs.ready(proc)
        yield proc
    finally:
        proc.stop()


def test_direct_worker_calls_without_the_token_are_unauthenticated(worker):
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        unauth = {name: grpc.StatusCode.UNAUTHENTICATED for name in ("GetInfo", "GetLoad", "Generate")}
        assert worker_calls(stub, ()) == unauth
        assert worker_calls(stub, ((METADATA_KEY, "not-the-token"),)) == unauth
        assert worker_calls(stub, ((METADATA_KEY, TOKEN), (METADATA_KEY, TOKEN))) == unauth  # exactly one
        # health stays open (Kubernetes' gRPC probes send no metadata), and says only SERVING
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # with the token every call is served: the refusals above were the token's doing
        ok = {name: grpc.StatusCode.OK for name in ("GetInfo", "GetLoad", "Generate")}
        assert worker_calls(stub, ((METADATA_KEY, TOKEN),)) == ok


def test_router_with_the_token_serves_and_without_it_sees_no_worker(worker, logs):
    request = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=3))
    bad = procs.start_router(logs, [worker.address], "--worker-token", "some-other-token")  # starts meanwhile
    try:
        # the launchers' way again: the token in the router's environment
        with procs.running_router(logs, [worker.address], env={"LLM_WORKER_TOKEN": TOKEN}) as router:
            with grpc.insecure_channel(router.address) as channel:
                msgs = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
            assert msgs[-1].finished.usage.completion_tokens == 3
        bad.wait_listening(procs.START_TIMEOUT_S)
        with grpc.insecure_channel(bad.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert worker.address not in err.value.details()
        assert "no healthy worker" in err.value.details()  # its probes were refused too
    finally:
        bad.stop()
