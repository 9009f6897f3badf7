"""Helpers of the OpenAI front's end-to-end tests (tests/test_openai_e2e.py,
tests/test_openai_errors_e2e.py, tests/test_openai_serving_e2e.py): the announced HTTP URL, raw
POSTs, a client that leaves, gRPC generation with the same request, a throwaway certificate; and
the stack the e2e modules share (import the fixtures into the test module: each module gets its
own router process on the session's shared worker): `worker`, `router` (HTTP port 0, spans to the
session's OTLP sink, tenants `tests`, a rate-limited `limited` and `pair`, at most 2 open
requests), `client` (the official SDK), `stub` (gRPC)."""

from __future__ import annotations

import http.client
import json
import re
import select
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import openai
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.tenants import hash_key
from tests import procs

HTTP_API = re.compile(r"HTTP API at (https?://\S+/v1)")


def http_url(proc: procs.Proc, timeout_s: float = procs.START_TIMEOUT_S) -> str:
    """The base URL the router announced ("... HTTP API at http://HOST:PORT/v1")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = HTTP_API.search(proc.log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        time.sleep(0.05)  # polling a log file; no event to wait on across processes
    raise TimeoutError(f"{proc.name} announced no HTTP API within {timeout_s} s")


def post(url: str, body: bytes, key: str, timeout_s: float = 60.0) -> tuple[int, dict]:
    """A raw POST with an API key (urllib: no client-side checks in the way)."""
    request = urllib.request.Request(
        url, data=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_and_leave(url: str, body: bytes, key: str, ready, what: str, timeout_s: float = 30.0) -> bool:
    """A client that leaves: POSTs `body`, waits until `ready()` (state in another process, polled:
    procs.wait_until) and closes the connection without reading. Returns whether any response byte
    had arrived by then (a status line, for one)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request(
            "POST", parts.path, body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        )
        procs.wait_until(ready, timeout_s, what)
        return bool(select.select([conn.sock], [], [], 0)[0])
    finally:
        conn.close()


def tcp_sockets(url: str) -> str:
    """A diagnostic for a failed wait: `ss`'s view of every TCP socket to or from `url`'s port (state,
    queued bytes, owning process), to tell a client that never closed from a server that never
    noticed."""
    port = urllib.parse.urlsplit(url).port
    try:
        out = subprocess.run(
            ["ss", "-tanpi", f"( sport = :{port} or dport = :{port} )"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(ss failed: {exc})"


def grpc_generate(stub, metadata, **fields) -> tuple[str, pb.Finished]:
    text, _, finished = grpc_tokens(stub, metadata, **fields)
    return text, finished


def grpc_tokens(stub, metadata, **fields) -> tuple[str, list[int], pb.Finished]:
    text, ids, finished = "", [], None
    for msg in stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=120):
        if msg.HasField("chunk"):
            text += msg.chunk.text
            ids += msg.chunk.token_ids
        else:
            finished = msg.finished
    return text, ids, finished


def self_signed(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key (it is its own CA): (cert, key) paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "http-cert.pem", directory / "http-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


KEY, LIMITED_KEY, PAIR_KEY = "openai-tests-key", "limited-key", "pair-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TENANTS = (
    "tenants:\n"
    f"  - name: tests\n    key_sha256: {hash_key(KEY)}\n"
    f"  - name: limited\n    key_sha256: {hash_key(LIMITED_KEY)}\n"
    "    rate_requests_per_s: 0.001\n    burst_requests: 1\n"
    f"  - name: pair\n    key_sha256: {hash_key(PAIR_KEY)}\n"
    "    max_concurrency: 2\n"
)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village at the edge of a great forest, there lived"


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker (tests/conftest.py): default engine flags, float32."""
    return plain_worker


@pytest.fixture(scope="module")
def router(worker, logs, sink):
    with procs.running_router(
        logs,
        [worker.address],
        "--http-port",
        "0",
        "--otlp-endpoint",
        sink.endpoint,
        tenants=TENANTS,
        metadata=AUTH,
        env=procs.FAST_SPAN_EXPORT,  # spans reach the sink within 50 ms, not the default 5 s
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=http_url(router), api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)
