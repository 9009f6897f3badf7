"""Transport security: TLS on the router's client port, mutual TLS between router and worker, and
the non-loopback rules, with a throwaway CA made here (real processes on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import pathlib
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.telemetry import TelemetryConfig
from common.tls import channel_credentials
from devtools import client
from loadtest.grpc_client import GrpcClient, SendOptions
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.config import RouterConfig
from router.tenants import hash_key
from tests import procs
from worker.__main__ import parse_args as parse_worker_args
from worker.config import EngineConfig
from worker.server import WorkerServerConfig

GRPC_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Pki:
    ca: str
    other_ca: str  # a CA that signed nothing here
    server_cert: str  # 127.0.0.1 and localhost, for the router and the worker
    server_key: str
    client_cert: str  # for the router (to workers) and for clients (to a router)
    client_key: str

    def https(self, with_cert: bool = True, ca: str | None = None) -> ssl.SSLContext:
        """A client context for HTTPS scrapes of /metrics."""
        context = ssl.create_default_context(cafile=ca or self.ca)
        if with_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def client(self, with_cert: bool = True, ca: str | None = None) -> grpc.ChannelCredentials:
        if not with_cert:
            return channel_credentials(ca or self.ca)
        return channel_credentials(ca or self.ca, self.client_cert, self.client_key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, issuer: x509.Name, issuer_key, extensions: list) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: pathlib.Path, stem: str, cert: x509.Certificate, key=None) -> tuple[str, str]:
    cert_path = directory / f"{stem}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return str(cert_path), ""
    key_path = directory / f"{stem}-key.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def _make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = _issue(
        name, key, _name(name), key, [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)]
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, ca_key = _make_ca("test CA")
    other_ca, _ = _make_ca("another CA")
    leaf = (x509.BasicConstraints(ca=False, path_length=None), True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        [
            leaf,
            (
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                False,
            ),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue(
        "llm-router",
        client_key,
        ca.subject,
        ca_key,
        [leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    server_paths = _write(directory, "server", server, server_key)
    client_paths = _write(directory, "client", client_cert, client_key)
    return Pki(
        ca=_write(directory, "ca", ca)[0],
        other_ca=_write(directory, "other-ca", other_ca)[0],
        server_cert=server_paths[0],
        server_key=server_paths[1],
        client_cert=client_paths[0],
        client_key=client_paths[1],
    )


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


@pytest.mark.parametrize(
    "extra, missing, present",
    [
        ([], ["API keys (--tenants FILE)", "TLS (--tls-cert"], []),
        (["--tenants", "TENANTS"], ["TLS (--tls-cert"], ["--tenants FILE"]),
    ],
)
def test_public_router_without_keys_and_tls_exits(tmp_path, extra, missing, present):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: a\n    key_sha256: {hash_key('a key')}\n")
    args = [str(tenants) if a == "TENANTS" else a for a in extra]
    out = subprocess.run(
        [sys.executable, "-m", "router", "--host", "0.0.0.0", "--port", "0", *args],
        cwd=procs.REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "refusing to serve 0.0.0.0" in out.stderr and "--allow-insecure-public" in out.stderr
    for text in missing:
        assert text in out.stderr
    for text in present:
        assert text not in out.stderr


def test_public_worker_without_mutual_tls_is_refused(pki, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_worker_args(["--host", "0.0.0.0", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "refusing to bind 0.0.0.0 without mutual TLS (missing --tls-client-ca)" in err
    config = parse_worker_args(
        [
            "--host",
            "0.0.0.0",
            "--tls-cert",
            pki.server_cert,
            "--tls-key",
            pki.server_key,
            "--tls-client-ca",
            pki.ca,
        ]
    )
    assert config.tls_client_ca == pki.ca
    assert parse_worker_args(["--host", "0.0.0.0", "--allow-insecure-public"]).tls_cert is None


@pytest.mark.parametrize(
    "host, tenants, tls, allow, missing",
    [
        ("127.0.0.1", None, False, False, 0),
        ("0.0.0.0", None, False, False, 2),
        ("0.0.0.0", "t.yaml", False, False, 1),
        ("0.0.0.0", None, True, False, 1),
        ("0.0.0.0", "t.yaml", True, False, 0),
        ("0.0.0.0", None, False, True, 0),
    ],
)
def test_missing_for_public_bind(pki, host, tenants, tls, allow, missing):
    files = dict(tls_cert=pki.server_cert, tls_key=pki.server_key) if tls else {}
    config = RouterConfig(host=host, tenants_file=tenants, allow_insecure_public=allow, **files)
    assert len(config.missing_for_public_bind()) == missing


def test_bad_tls_files_are_rejected_naming_flag_and_path(pki, tmp_path):
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82")
    cases = [
        (dict(tls_cert=pki.server_cert), "--tls-cert needs --tls-key"),
        (dict(tls_key=pki.server_key), "--tls-key needs --tls-cert"),
        (
            dict(tls_cert=str(tmp_path / "nope.pem"), tls_key=pki.server_key),
            f"--tls-cert {tmp_path / 'nope.pem'}: cannot read",
        ),
        (dict(tls_cert=str(not_pem), tls_key=pki.server_key), f"--tls-cert {not_pem}: not a PEM file"),
        (dict(tls_client_ca=pki.ca), "--tls-client-ca needs --tls-cert"),
        (
            dict(worker_tls_cert=pki.client_cert, worker_tls_key=pki.client_key),
            "--worker-tls-cert needs --worker-tls-ca",
        ),
        (
            dict(worker_tls_ca=pki.ca, worker_tls_key=pki.client_key),
            "--worker-tls-key needs --worker-tls-cert",
        ),
        (dict(worker_tls_server_name="localhost"), "--worker-tls-server-name needs --worker-tls-ca"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as failure:
            RouterConfig(**kwargs)
        assert message in str(failure.value), (kwargs, str(failure.value))
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        WorkerServerConfig(engine=EngineConfig(), tls_client_ca=pki.ca)
    metrics_cases = [
        (dict(metrics_tls_cert=pki.server_cert), "--metrics-tls-cert needs --metrics-tls-key"),
        (dict(metrics_tls_client_ca=pki.ca), "--metrics-tls-client-ca needs --metrics-tls-cert"),
        (
            dict(metrics_tls_cert=pki.server_cert, metrics_tls_key=str(not_pem)),
            f"--metrics-tls-key {not_pem}: not a PEM file",
        ),
    ]
    for kwargs, message in metrics_cases:
        with pytest.raises(ValueError) as failure:
            TelemetryConfig(**kwargs)
        assert message in str(failure.value), (kwargs, str(failure.value))
    mismatched = TelemetryConfig(metrics_tls_cert=pki.server_cert, metrics_tls_key=pki.client_key)
    with pytest.raises(ValueError, match="not a matching certificate and private key"):
        mismatched.metrics_ssl_context()
