"""Tenants file parsing and authentication."""
import pytest

from router.errors import AuthError
from router.tenants import Tenants, hash_key, is_loopback_peer

LOOPBACK = "ipv4:127.0.0.1:5555"
REMOTE = "ipv4:10.1.2.3:5555"

YAML = f"""
tenants:
  - name: acme
    key_sha256: {hash_key("acme-secret")}
    weight: 2.0
    max_concurrency: 4
    rate_tokens_per_s: 1000
  - name: beta
    key_sha256: {hash_key("beta-secret")}
"""


def bearer(key):
    return [("authorization", f"Bearer {key}")]


def test_keys_map_to_tenants_and_limits_are_kept():
    t = Tenants.from_yaml(YAML)
    acme = t.authenticate(bearer("acme-secret"), REMOTE)
    assert (acme.name, acme.weight, acme.max_concurrency, acme.rate_tokens_per_s) == ("acme", 2.0, 4, 1000)
    beta = t.authenticate([("x-other", "1")] + bearer("beta-secret"), LOOPBACK)
    assert (beta.name, beta.weight, beta.max_concurrency) == ("beta", 1.0, None)


@pytest.mark.parametrize("metadata, message", [
    ([], "missing API key"),
    ([("authorization", "Basic abc")], "malformed"),
    ([("authorization", "Bearer ")], "malformed"),
    (bearer("wrong"), "invalid API key"),
])
def test_bad_credentials(metadata, message):
    with pytest.raises(AuthError, match=message):
        Tenants.from_yaml(YAML).authenticate(metadata, LOOPBACK)


def test_default_tenant_only_on_loopback():
    t = Tenants.default()
    assert t.authenticate([], LOOPBACK).name == "default"
    assert t.authenticate([], "ipv6:[::1]:80").name == "default"
    with pytest.raises(AuthError, match="loopback"):
        t.authenticate([], REMOTE)
    assert Tenants.default(allow_public=True).authenticate([], REMOTE).name == "default"


@pytest.mark.parametrize("text", [
    "",
    "tenants: []",
    "tenants:\n  - name: a\n    key_sha256: short\n",
    "tenants:\n  - name: a\n    key_sha256: " + "a" * 64 + "\n    colour: red\n",
    "tenants:\n  - name: a\n    key_sha256: " + "a" * 64 + "\n    weight: 0\n",
    "tenants:\n  - {name: a, key_sha256: " + "a" * 64 + "}\n  - {name: a, key_sha256: " + "b" * 64 + "}\n",
])
def test_malformed_files_are_rejected(text):
    with pytest.raises(ValueError):
        Tenants.from_yaml(text)


@pytest.mark.parametrize("peer, loopback", [
    ("ipv4:127.0.0.1:1", True), ("ipv6:[::1]:1", True), ("unix:/tmp/s", True),
    ("ipv4:192.168.0.1:1", False), ("ipv6:[2001:db8::1]:1", False), ("garbage", False),
])
def test_peer_parsing(peer, loopback):
    assert is_loopback_peer(peer) is loopback
