"""RayRegistry reconnecting a Ray connection it made itself, against a fake Ray Client (milliseconds,
no cluster): after the client gave up (a head restart), discovery keeps the known workers, makes no
Ray call on the dead connection, tries `ray.shutdown()` + `ray.init()` once per round at most with a
growing pause, and once connected again finds the relaunched workers through new actor handles.
A router that did not connect itself (Ray initialised in-process) never shuts Ray down."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

import router.ray_registry as ray_registry
from router.ray_registry import RayRegistry
from tests.test_ray_registry import FakeRay, Ref

ADDRESS = "ray://head:10001"


class StaleUse(AssertionError):
    """A handle or call of a connection that is gone was used."""


class ClientRay(FakeRay):
    """A Ray Client connection: `connection` counts ray.init()s; handles and calls remember theirs.
    Once the client gave up, `is_connected()` is False and a call fails as Ray's does
    (ConnectionError); the test also records it, since the real listing would auto-start a local
    Ray (ray.init() with no address) instead."""

    def __init__(self):
        super().__init__()
        self.connected, self.head_up, self.connection = False, True, 0
        self.inits: list[float] = []  # the fake clock at each ray.init()
        self.shutdowns = 0
        self.dead_calls: list[str] = []
        self.clock = 0.0
        self.util.client.ray.is_connected = lambda: self.connected
        self.util.client.ray.list_named_actors = self._list  # what common.ray_names uses then

    def is_initialized(self) -> bool:
        return self.connected

    def init(self, address: str, namespace: str, **kwargs) -> None:
        assert address == ADDRESS and not self.connected, "init beside a live connection"
        self.inits.append(self.clock)
        if not self.head_up:
            raise ConnectionError("ray client connection timeout")
        self.connected, self.connection = True, self.connection + 1

    def shutdown(self) -> None:
        self.connected, self.shutdowns = False, self.shutdowns + 1

    def _alive(self, what: str) -> None:
        if not self.connected:
            self.dead_calls.append(what)
            raise ConnectionError("Client is shutting down.")

    def _list(self, all_namespaces: bool):
        self._alive("list")
        return super()._list(all_namespaces)

    def get_actor(self, name: str, namespace: str):
        self._alive("get_actor")
        actor = super().get_actor(name, namespace)
        actor.connection, call = self.connection, actor._call

        def remote():
            if actor.connection != self.connection:
                raise StaleUse(f"{name}: a handle of connection {actor.connection}")
            self._alive("address")
            ref = call()
            ref.connection = self.connection
            return ref

        actor.address = types.SimpleNamespace(remote=remote)
        return actor

    def wait(self, refs, num_returns, timeout):
        self._alive("wait")
        stale = [r for r in refs if getattr(r, "connection", self.connection) != self.connection]
        if stale:
            raise StaleUse(f"{len(stale)} call(s) of an old connection")
        return super().wait(refs, num_returns, timeout)


@pytest.fixture
def client(monkeypatch) -> ClientRay:
    fake = ClientRay()
    monkeypatch.setitem(sys.modules, "ray", fake)  # what _connect() imports
    return fake


def connected_registry(fake: ClientRay) -> RayRegistry:
    registry = RayRegistry(ADDRESS, call_timeout_s=0.5)
    registry._clock = lambda: fake.clock
    registry._connect()
    assert registry._connected_here and fake.inits == [0.0]
    return registry


def discover(registry: RayRegistry, unhealthy=frozenset()) -> list[str]:
    """One round, as the probe loop runs it: `unhealthy` are the addresses whose probes failed."""
    registry._handles = {
        a: types.SimpleNamespace(address=a, healthy=a not in unhealthy, draining=False)
        for a in registry._found or []
    }
    return asyncio.run(registry.discover())


def test_router_reconnects_after_ray_client_gave_up_and_finds_relaunched_workers(client):
    client.names = [("llm", "worker-0"), ("llm", "worker-1")]
    client.answers = {"worker-0": Ref("10.0.0.1:7000"), "worker-1": Ref("10.0.0.2:7000")}
    registry = connected_registry(client)
    old = ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert discover(registry) == old

    # The head restarts: the client's reconnect grace period ran out (it gave up), and the launcher
    # relaunches the workers at new addresses once the head is back.
    client.connected, client.head_up = False, False
    client.answers = {"worker-0": Ref("10.0.1.1:7000"), "worker-1": Ref("10.0.1.2:7000")}
    rounds = 0
    while client.clock < 120:  # two minutes of 0.5 s rounds while the head stays down
        inits = len(client.inits)
        assert discover(registry, unhealthy=set(old)) == old  # the known workers are kept
        assert len(client.inits) - inits <= 1  # at most one attempt per round
        client.clock += 0.5
        rounds += 1
    assert client.dead_calls == []  # no listing (a local ray.init()) nor call on the dead client
    pauses = [b - a for a, b in zip(client.inits[1:], client.inits[2:])]
    assert pauses[:5] == [1.0, 2.0, 4.0, 8.0, 16.0] and set(pauses[5:]) == {30.0}, pauses
    assert len(client.inits) - 1 < rounds / 20  # not a busy loop: 240 rounds, 8 attempts
    assert client.shutdowns == len(client.inits) - 1  # the dead client freed before each init

    client.head_up = True
    client.clock += 30.0  # the next attempt is due
    assert discover(registry, unhealthy=set(old)) == ["10.0.1.1:7000", "10.0.1.2:7000"]
    assert client.connection == 2 and client.dead_calls == []
    client.calls.clear()
    inits = len(client.inits)
    assert discover(registry) == ["10.0.1.1:7000", "10.0.1.2:7000"]
    assert client.calls == [] and len(client.inits) == inits  # healthy again: no actor call, no init


def test_reconnect_drops_old_handles_and_pending_calls_and_forgets_unlisted_workers(client):
    client.names = [("llm", "worker-0"), ("llm", "worker-1"), ("llm", "worker-2")]
    client.answers = {
        "worker-0": Ref("10.0.0.1:7000"),
        "worker-1": Ref("10.0.0.2:7000"),
        "worker-2": Ref("10.0.0.3:7000"),
    }
    registry = connected_registry(client)
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    client.answers["worker-1"] = Ref(ready=False)  # restarting: its call stays pending
    assert discover(registry, unhealthy={"10.0.0.2:7000"}) == ["10.0.0.1:7000", "10.0.0.3:7000"]
    assert set(registry._pending) == {"worker-1"}

    client.connected = False  # the client gave up; after the restart worker-2 was not relaunched
    client.names = [("llm", "worker-0"), ("llm", "worker-1")]
    client.answers["worker-1"] = Ref("10.0.1.2:7000")
    # worker-0 still answers at its address (healthy): kept without a call; worker-1 is asked
    # through a new handle (a stale handle or pending call raises StaleUse)
    assert discover(registry) == ["10.0.0.1:7000", "10.0.1.2:7000"]
    assert client.connection == 2 and client.dead_calls == []
    assert set(registry._actors) == {"worker-0", "worker-1"} and registry._pending == {}


def test_calls_failing_with_connection_errors_reconnect_while_ray_still_reports_connected(client):
    client.names, client.answers = [("llm", "worker-0")], {"worker-0": Ref("10.0.0.1:7000")}
    registry = connected_registry(client)
    assert discover(registry) == ["10.0.0.1:7000"]
    client.listing_fails = True  # FakeRay raises ConnectionError; is_connected() stays True
    for _ in range(ray_registry._FAILURES_BEFORE_RECONNECT):
        assert discover(registry) == ["10.0.0.1:7000"]
        client.clock += 0.5
    assert len(client.inits) == 1
    client.listing_fails = False
    assert discover(registry) == ["10.0.0.1:7000"]
    assert len(client.inits) == 2 and client.shutdowns == 1


def test_ray_initialised_in_process_is_never_shut_down(client):
    """`make serve`: the router runs beside the Ray it did not start; a lost connection there is
    not the router's to repair (today's behaviour: keep the known workers)."""
    client.connected = True  # ray.init() ran before the registry
    client.names, client.answers = [("llm", "worker-0")], {"worker-0": Ref("10.0.0.1:7000")}
    registry = RayRegistry(ADDRESS)
    registry._clock = lambda: client.clock
    registry._connect()
    assert not registry._connected_here
    assert discover(registry) == ["10.0.0.1:7000"]
    client.connected = False
    for _ in range(5):
        assert discover(registry) == ["10.0.0.1:7000"]
        client.clock += 60
    assert client.shutdowns == 0 and client.inits == []
