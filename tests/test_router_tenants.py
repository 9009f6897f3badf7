"""Tenants file parsing, validation, authentication and reloading."""

import asyncio
import os
import signal

import pytest

from router.errors import AuthError
from router.tenants import Tenant, Tenants, TenantsFile, hash_key, is_loopback_peer

LOOPBACK = "ipv4:127.0.0.1:5555"
REMOTE = "ipv4:10.1.2.3:5555"

YAML = f"""
tenants:
  - name: acme
    key_sha256: {hash_key("acme-secret")}
    weight: 2.0
    max_concurrency: 4
    max_queued: 8
    rate_requests_per_s: 2.5
    burst_requests: 5
    rate_tokens_per_min: 60000
    default_priority: 3
  - name: beta
    key_sha256: {hash_key("beta-secret")}
"""


def bearer(key):
    return [("authorization", f"Bearer {key}")]


def test_keys_map_to_tenants_and_limits_are_kept():
    t = Tenants.from_yaml(YAML)
    acme = t.authenticate(bearer("acme-secret"), REMOTE)
    assert acme == Tenant(
        "acme",
        hash_key("acme-secret"),
        weight=2.0,
        max_concurrency=4,
        max_queued=8,
        rate_requests_per_s=2.5,
        burst_requests=5,
        rate_tokens_per_min=60000,
        default_priority=3,
    )
    beta = t.authenticate([("x-other", "1")] + bearer("beta-secret"), LOOPBACK)
    assert beta == Tenant("beta", hash_key("beta-secret"))
    assert (beta.max_queued, beta.rate_requests_per_s, beta.rate_tokens_per_min, beta.default_priority) == (
        None,
        None,
        None,
        0,
    )


def test_each_of_several_routers_enforces_its_share_of_the_limits(tmp_path):
    acme = Tenants.from_yaml(YAML).authenticate(bearer("acme-secret"), REMOTE)
    assert acme.share(1) is acme
    half = acme.share(2)
    assert (half.max_concurrency, half.max_queued) == (2, 4)  # caps divided, rounded up
    assert (half.rate_requests_per_s, half.burst_requests, half.rate_tokens_per_min) == (1.25, 2.5, 30000)
    assert (half.weight, half.default_priority, half.key_sha256) == (2.0, 3, acme.key_sha256)
    third = acme.share(3)
    assert (third.max_concurrency, third.max_queued, third.burst_requests) == (2, 3, 5 / 3)
    tiny = Tenant("t", max_concurrency=1, rate_requests_per_s=1.0, burst_requests=1).share(4)
    assert (tiny.max_concurrency, tiny.burst_requests, tiny.rate_requests_per_s) == (1, 1.0, 0.25)
    assert Tenant("u").share(5) == Tenant("u")  # no limits: nothing to share
    # The table (and a reload of it) hands out the shared limits; authentication is unchanged.
    path = tmp_path / "tenants.yaml"
    path.write_text(YAML)
    source = TenantsFile(str(path), replicas=2)
    assert source.current.authenticate(bearer("acme-secret"), REMOTE) == half
    path.write_text(YAML.replace("max_concurrency: 4", "max_concurrency: 6"))
    assert source.reload()
    assert source.current.authenticate(bearer("acme-secret"), REMOTE).max_concurrency == 3


@pytest.mark.parametrize(
    "metadata, message",
    [
        ([], "missing API key"),
        ([("authorization", "Basic abc")], "malformed"),
        ([("authorization", "Bearer ")], "malformed"),
        (bearer("wrong"), "invalid API key"),
    ],
)
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


@pytest.mark.parametrize(
    "text",
    [
        "",
        "tenants: []",
        "tenants:\n  - name: a\n    key_sha256: short\n",
        "tenants:\n  - name: a\n    key_sha256: " + "a" * 64 + "\n    colour: red\n",
        "tenants:\n  - name: a\n    key_sha256: " + "a" * 64 + "\n    weight: 0\n",
        "tenants:\n  - {name: a, key_sha256: "
        + "a" * 64
        + "}\n  - {name: a, key_sha256: "
        + "b" * 64
        + "}\n",
        "tenants:\n  - name: a\n    key_sha256: "
        + "a" * 64
        + "\n    rate_tokens_per_s: 5\n",  # renamed: per_min
        "tenants:\n  - name: a\n    key_sha256: " + "1" * 64 + "\n",  # unquoted digits: YAML reads a number
        "tenants:\n  - name: a\n    key_sha256: " + "a" * 64 + "\n    admin: 'yes'\n",  # a string
    ],
)
def test_malformed_files_are_rejected(text):
    with pytest.raises(ValueError):
        Tenants.from_yaml(text)


@pytest.mark.parametrize(
    "fields",
    [
        {"weight": float("inf")},
        {"weight": "2"},
        {"weight": True},
        {"max_concurrency": 0},
        {"max_queued": 0},
        {"max_queued": 2.5},
        {"max_queued": True},
        {"rate_requests_per_s": 0},
        {"rate_requests_per_s": -1},
        {"rate_tokens_per_min": "fast"},
        {"burst_requests": 5},  # a burst without a rate
        {"rate_requests_per_s": 1, "burst_requests": 0.5},  # a burst smaller than one request
        {"default_priority": 1.5},
        {"default_priority": "high"},
    ],
)
def test_bad_limits_are_rejected(fields):
    with pytest.raises(ValueError, match="tenant a"):
        Tenant("a", **fields)


def write(path, text):
    path.write_text(text)
    st = path.stat()  # a distinct mtime even on coarse-grained file systems
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_reload_swaps_the_table_and_keeps_it_when_the_new_file_is_bad(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, YAML)
    source = TenantsFile(str(path))
    old = source.current
    acme = old.authenticate(bearer("acme-secret"), LOOPBACK)
    assert not source.reload_if_changed()  # unchanged
    write(
        path,
        YAML.replace("weight: 2.0", "weight: 3.0")
        + f"""  - name: gamma
    key_sha256: {hash_key("gamma-secret")}
""",
    )
    assert source.reload_if_changed() and source.num_reloads == 1
    assert source.current.authenticate(bearer("acme-secret"), LOOPBACK).weight == 3.0
    assert source.current.authenticate(bearer("gamma-secret"), LOOPBACK).name == "gamma"
    assert (
        acme.weight == 2.0 and old.authenticate(bearer("acme-secret"), LOOPBACK) is acme
    )  # in flight: unchanged
    current = source.current
    write(path, "tenants: [oops")  # a typo: logged, the previous table stays
    assert not source.reload_if_changed() and source.current is current
    write(path, YAML.replace("- name: acme\n    key_sha256", "- key_sha256"))  # no name: the same
    assert not source.reload_if_changed() and source.current is current  # (a TypeError ended the watch)
    assert not source.reload_if_changed()  # the same bad file is not re-read every poll
    path.unlink()
    assert not source.reload_if_changed() and source.current is current


def test_watch_and_sighup_reload(tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, YAML)
    source = TenantsFile(str(path))

    async def main():
        loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(source.watch(0.01))
        try:
            write(path, YAML.replace("max_queued: 8", "max_queued: 9"))
            while source.num_reloads < 1:
                await asyncio.sleep(0.01)
            loop.add_signal_handler(signal.SIGHUP, source.reload)
            os.kill(os.getpid(), signal.SIGHUP)
            while source.num_reloads < 2:
                await asyncio.sleep(0.01)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            watcher.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert source.current.authenticate(bearer("acme-secret"), LOOPBACK).max_queued == 9


def test_no_file_means_the_default_tenant_and_nothing_to_reload():
    source = TenantsFile(None)
    assert source.current.authenticate([], LOOPBACK).name == "default"
    assert not source.reload() and not source.reload_if_changed()


@pytest.mark.parametrize(
    "peer, loopback",
    [
        ("ipv4:127.0.0.1:1", True),
        ("ipv6:[::1]:1", True),
        ("unix:/tmp/s", True),
        ("ipv4:192.168.0.1:1", False),
        ("ipv6:[2001:db8::1]:1", False),
        ("garbage", False),
    ],
)
def test_peer_parsing(peer, loopback):
    assert is_loopback_peer(peer) is loopback
