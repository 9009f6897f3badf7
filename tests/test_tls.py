"""Transport security with real processes on 127.0.0.1: TLS on the router's client port, mutual TLS
between router and worker, /metrics over HTTPS, with a throwaway CA (tests/tls_pki.py). The
non-loopback rules and the TLS settings' checks: tests/test_tls_config.py."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from devtools import client
from loadtest.grpc_client import GrpcClient, SendOptions
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests import procs
from tests.tls_pki import Pki, make_pki
from worker.config import EngineConfig

GRPC_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def worker(pki, logs):
    """A worker that accepts only clients (and /metrics scrapers) with a certificate signed by the
    test CA."""
    proc = procs.start_worker(
        logs,
        "--tls-cert",
        pki.server_cert,
        "--tls-key",
        pki.server_key,
        "--tls-client-ca",
        pki.ca,
        "--metrics-tls-cert",
        pki.server_cert,
        "--metrics-tls-key",
        pki.server_key,
        "--metrics-tls-client-ca",
        pki.ca,
    )
    try:
        procs.ready(proc, credentials=pki.client())
        yield proc
    finally:
        proc.stop()


def _router_tls_args(pki: Pki) -> list[str]:
    return [
        "--tls-cert",
        pki.server_cert,
        "--tls-key",
        pki.server_key,
        "--worker-tls-ca",
        pki.ca,
        "--worker-tls-cert",
        pki.client_cert,
        "--worker-tls-key",
        pki.client_key,
    ]


@pytest.fixture(scope="module")
def router(pki, worker, logs):
    """TLS on the client port and /metrics (no client certificates), mutual TLS to the worker."""
    with procs.running_router(
        logs,
        [worker.address],
        *_router_tls_args(pki),
        "--metrics-tls-cert",
        pki.server_cert,
        "--metrics-tls-key",
        pki.server_key,
        credentials=pki.client(with_cert=False),
    ) as proc:
        yield proc


def _list_models(address: str, credentials: grpc.ChannelCredentials | None) -> pb.ListModelsResponse:
    with procs.open_channel(address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.ListModels(pb.ListModelsRequest(), timeout=GRPC_TIMEOUT_S)


def test_tls_client_generates_through_router_and_mtls_worker(router, pki, capsys):
    args = [
        "The capital of France is",
        "--target",
        router.address,
        "--tls-ca",
        pki.ca,
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--temperature",
        "0",
    ]
    status = client.main(args)
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out.strip()
    assert "[length]" in out.err and "completion 4 tokens" in out.err
    # The certificate names 127.0.0.1 and localhost, nothing else.
    assert client.main([*args, "--tls-server-name", "localhost", "--timeout-s", "10"]) == 0
    assert client.main([*args, "--tls-server-name", "elsewhere.example", "--timeout-s", "10"]) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err


def test_loadtest_client_over_tls(router, pki):
    async def models() -> dict:
        grpc_client = GrpcClient(router.address, SendOptions(tls_ca=pki.ca), clock_ns=lambda: 0)
        try:
            return await grpc_client.server_info()
        finally:
            await grpc_client.close()

    assert asyncio.run(models())["models"][0]["num_workers"] == 1


def test_plaintext_client_is_refused_by_tls_router(router):
    with pytest.raises(grpc.RpcError) as failure:
        _list_models(router.address, None)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(router, pki):
    with pytest.raises(grpc.RpcError) as failure:
        _list_models(router.address, pki.client(with_cert=False, ca=pki.other_ca))
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_worker_refuses_client_without_certificate(worker, pki):
    request = worker_pb2.GetLoadRequest()
    with procs.open_channel(worker.address, pki.client()) as channel:
        assert (
            worker_pb2_grpc.WorkerStub(channel).GetLoad(request, timeout=GRPC_TIMEOUT_S).num_total_blocks > 0
        )
    with procs.open_channel(worker.address, pki.client(with_cert=False)) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            worker_pb2_grpc.WorkerStub(channel).GetLoad(request, timeout=GRPC_TIMEOUT_S)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE


def test_metrics_over_https(router, worker, pki):
    """/metrics speaks only HTTPS when given a certificate; the worker's also wants a client one."""
    assert procs.metrics_url(router).startswith("https://")
    assert procs.scrape(router, pki.https(with_cert=False))[("llm_router_open_calls", ())] == 0
    worker_samples = procs.scrape(worker, pki.https())
    assert (
        worker_samples[("llm_kv_cache_free_blocks", ())] == worker_samples[("llm_kv_cache_total_blocks", ())]
    )
    plain = procs.metrics_url(router).replace("https://", "http://")
    refusals = [
        lambda: urllib.request.urlopen(plain, timeout=5),  # clear text
        lambda: procs.scrape(router, pki.https(with_cert=False, ca=pki.other_ca)),  # untrusted server
        lambda: procs.scrape(worker, pki.https(with_cert=False)),  # no client cert
    ]
    for attempt in refusals:
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            attempt()
    # Refused scrapers do not stop the endpoints.
    assert procs.scrape(worker, pki.https())


def test_ray_launched_worker_serves_metrics_over_https_with_its_certificate(pki):
    """deploy.worker_actor's actor class (what deploy.ray_launch starts), run in process without Ray:
    given TLS files, its gRPC port wants mutual TLS and its /metrics speaks HTTPS with the same
    certificate."""
    from deploy.worker_actor import WorkerActor

    actor = WorkerActor(
        EngineConfig(kv_cache_bytes=procs.TEST_KV_CACHE_MB * 2**20, num_threads=1),
        tls=(pki.server_cert, pki.server_key, pki.ca),
    )
    try:
        with procs.open_channel(actor.address(), pki.client()) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(
                worker_pb2.GetInfoRequest(), timeout=GRPC_TIMEOUT_S
            )
        url = f"https://{info.metrics_address}/metrics"
        body = urllib.request.urlopen(url, timeout=5, context=pki.https(with_cert=False)).read()
        assert b"llm_kv_cache_total_blocks" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https://", "http://"), timeout=5)
    finally:
        actor.stop()


def test_router_with_client_ca_requires_client_certificate(pki, worker, logs):
    # The worker certificate names 127.0.0.1 and localhost: the override is checked against it.
    with procs.running_router(
        logs,
        [worker.address],
        *_router_tls_args(pki),
        "--tls-client-ca",
        pki.ca,
        "--worker-tls-server-name",
        "localhost",
        credentials=pki.client(),
    ) as proc:
        assert _list_models(proc.address, pki.client()).models[0].num_workers == 1
        with pytest.raises(grpc.RpcError) as failure:
            _list_models(proc.address, pki.client(with_cert=False))
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
