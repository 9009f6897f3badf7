"""Issue 17 item 6: the /metrics and /targets endpoint (common/metrics_http.py) takes an optional
bearer token and never runs more than MAX_THREADS connection threads; and the Kubernetes manifests
keep it off the client Service. Real HTTP over 127.0.0.1 (no model needed)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from common.metrics_http import MAX_THREADS, MetricsServer

TOKEN = "scrape-token-42"


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Counter("trust_test_hits", "a sample counter", registry=registry).inc()
    srv = MetricsServer("127.0.0.1", 0, registry, {"/targets": lambda: [{"targets": ["w:1"]}]}, None, TOKEN)
    yield srv
    srv.close()


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_bearer_token_guards_metrics_and_targets(server):
    base = f"http://{server.address}"
    for path in ("/metrics", "/targets"):
        assert get(base + path)[0] == 401
        assert get(base + path, "wrong")[0] == 401
        status, body = get(base + path, TOKEN)
        assert status == 200, body
    assert "trust_test_hits_total 1.0" in get(base + "/metrics", TOKEN)[1]
    assert TOKEN not in get(base + "/metrics")[1]  # a refusal never echoes the token


def test_connection_threads_are_bounded(server):
    host, port = server.address.rsplit(":", 1)
    before = threading.active_count()
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_THREADS + 10)]
    try:
        # the server takes MAX_THREADS of them; the others it closes at once (recv sees EOF)
        closed = 0
        deadline = time.monotonic() + 10
        for sock in reversed(idle):  # the last ones are those beyond the bound
            sock.settimeout(max(0.05, deadline - time.monotonic()) if closed < 10 else 0.05)
            try:
                if sock.recv(1) == b"":
                    closed += 1
            except TimeoutError:
                continue  # held open by a handler thread, waiting for a request
        grown = threading.active_count() - before
        assert closed >= 10, closed
        assert grown <= MAX_THREADS, grown
    finally:
        for sock in idle:
            sock.close()
