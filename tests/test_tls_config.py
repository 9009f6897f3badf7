"""Transport security settings without serving: a non-loopback router without API keys and TLS,
and a non-loopback worker without mutual TLS, refuse to start; bad or half-given TLS files are
rejected naming the flag and the path (router, worker, /metrics). Certificates from the throwaway
CA of tests/tls_pki.py; the served side: tests/test_tls.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.telemetry import TelemetryConfig
from router.config import RouterConfig
from router.tenants import hash_key
from tests import procs
from tests.tls_pki import Pki, make_pki
from worker.__main__ import parse_args as parse_worker_args
from worker.config import EngineConfig
from worker.server import WorkerServerConfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


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
