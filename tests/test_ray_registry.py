"""RayRegistry's discovery rules against a fake `ray` module (milliseconds, no cluster): who is asked
for an address and when, restarting and dead actors, static addresses, Ray outages; and the router
loads Ray only when told to discover through it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import types

import pytest

from router.ray_registry import RayRegistry
from tests.procs import REPO


class RayError(Exception):
    """Stands in for ray.exceptions.RayError in the fake Ray module."""


class Ref:
    def __init__(self, value=None, error: Exception | None = None, ready: bool = True):
        self.value, self.error, self.ready = value, error, ready


class Actor:
    def __init__(self, fake: "FakeRay", name: str):
        self._fake, self._name = fake, name
        self.address = types.SimpleNamespace(remote=self._call)

    def _call(self) -> Ref:
        self._fake.calls.append(self._name)
        return self._fake.answers[self._name]


class FakeRay:
    """The slice of the Ray API that discovery uses."""

    def __init__(self):
        self.names: list[tuple[str, str]] = []  # (namespace, name)
        self.answers: dict[str, Ref] = {}
        self.calls: list[str] = []
        self.listing_fails = False
        self.exceptions = types.SimpleNamespace(RayError=RayError)
        self.util = types.SimpleNamespace(
            list_named_actors=self._list,
            client=types.SimpleNamespace(ray=types.SimpleNamespace(is_connected=lambda: False)),
        )

    def _list(self, all_namespaces: bool):
        assert all_namespaces
        if self.listing_fails:
            raise ConnectionError("GCS unreachable")
        return [{"namespace": ns, "name": n} for ns, n in self.names]

    def is_initialized(self) -> bool:
        return True

    def get_actor(self, name: str, namespace: str) -> Actor:
        if (namespace, name) not in self.names:
            raise ValueError(name)
        return Actor(self, name)

    def wait(self, refs, num_returns, timeout):
        assert num_returns == len(refs) and timeout > 0
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def get(self, ref: Ref):
        if ref.error:
            raise ref.error
        return ref.value


@pytest.fixture
def fake() -> FakeRay:
    return FakeRay()


def registry_on(fake: FakeRay, **kwargs) -> RayRegistry:
    registry = RayRegistry("auto", **kwargs)
    registry._ray = fake  # what start() -> _connect() sets to the real module
    return registry


def discover(
    registry: RayRegistry, unhealthy: set[str] = frozenset(), draining: set[str] = frozenset()
) -> list[str]:
    for handle in registry._handles.values():  # the base registry's probe results
        handle.healthy = handle.address not in unhealthy | draining
        handle.draining = handle.address in draining
    return asyncio.run(registry.discover())


def with_handles(registry: RayRegistry, addresses: list[str]) -> None:
    registry._handles = {a: types.SimpleNamespace(address=a, healthy=True, draining=False) for a in addresses}


def test_asks_new_and_unhealthy_actors_only(fake):
    fake.names = [("llm", "worker-0"), ("llm", "worker-1"), ("other", "worker-9"), ("llm", "directory")]
    fake.answers = {"worker-0": Ref("10.0.0.1:7000"), "worker-1": Ref("10.0.0.2:7000")}
    registry = registry_on(fake)
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert sorted(fake.calls) == ["worker-0", "worker-1"]  # other namespaces and names ignored

    with_handles(registry, ["10.0.0.1:7000", "10.0.0.2:7000"])
    fake.calls.clear()
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert fake.calls == []  # healthy workers cost no Ray call

    fake.calls.clear()
    discover(registry, unhealthy={"10.0.0.2:7000"})
    assert fake.calls == ["worker-1"]


def test_restarting_actor_is_left_out_until_it_answers_at_its_new_port(fake):
    fake.names = [("llm", "worker-0"), ("llm", "worker-1")]
    fake.answers = {"worker-0": Ref("10.0.0.1:7000"), "worker-1": Ref("10.0.0.2:7000")}
    registry = registry_on(fake)
    discover(registry)
    with_handles(registry, ["10.0.0.1:7000", "10.0.0.2:7000"])

    restarting = Ref(ready=False)
    fake.answers["worker-1"] = restarting
    assert discover(registry, unhealthy={"10.0.0.2:7000"}) == ["10.0.0.1:7000"]
    fake.calls.clear()
    assert discover(registry) == ["10.0.0.1:7000"]
    assert fake.calls == []  # the pending call is reused, not repeated

    restarting.value, restarting.ready = "10.0.0.2:7100", True
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.2:7100"]


def test_a_probe_round_that_fails_does_not_end_probing(fake):
    """An unexpected error in one round (a listener, an info check) is logged; the next round runs
    (the loop ended silently: no worker was probed again, dead ones stayed healthy)."""
    rounds = []

    class Flaky(RayRegistry):
        async def discover(self):
            rounds.append(len(rounds))
            if len(rounds) == 1:
                raise RuntimeError("a bug in one round")
            return []

    async def main():
        registry = Flaky("auto", poll_s=0.01)
        registry._ray = fake
        task = asyncio.ensure_future(registry._probe_forever())
        try:
            deadline = time.monotonic() + 10
            while len(rounds) < 3:
                assert time.monotonic() < deadline and not task.done(), rounds
                await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(main())


def test_a_blocked_ray_call_does_not_hold_up_health_probes(fake):
    """The GCS unreachable: Ray's listing blocks. Probing goes on with the workers last found, so
    a worker that dies meanwhile is unhealthy within a few probes (it stayed "healthy" for as long
    as Ray blocked: the probe round waited for discovery)."""
    import threading

    from tests.router_harness import MODELS, ScriptedWorker, start_worker

    blocked, release = threading.Event(), threading.Event()
    listing = fake._list

    def slow_list(all_namespaces):
        if blocked.is_set():
            release.wait(30)  # bounded: the test releases it
        return listing(all_namespaces)

    fake.util.list_named_actors = slow_list

    async def main() -> float:
        server, address = await start_worker(ScriptedWorker())
        fake.names, fake.answers = [("llm", "worker-0")], {"worker-0": Ref(address)}
        registry = registry_on(fake, poll_s=0.1, probe_timeout_s=0.2, check_info=MODELS.check)
        registry._connect = lambda: None
        await registry.start()
        try:
            assert [h.address for h in registry.healthy()] == [address]
            blocked.set()  # Ray stops answering ...
            await server.stop(0)  # ... and the worker dies
            start = time.monotonic()
            while registry.healthy():
                assert time.monotonic() - start < 10, "the dead worker stayed healthy"
                await asyncio.sleep(0.05)
            return time.monotonic() - start
        finally:
            release.set()
            await registry.stop()

    assert asyncio.run(main()) < 5


def test_a_draining_worker_stays_while_its_actor_is_busy_stopping(fake):
    """A worker that announced its drain (NOT_SERVING) does not answer address() while its actor
    runs stop(): it stays discovered, so the streams its drain grace lets finish are not cancelled
    as "left the registry" (they were, at the first probe after the drain began)."""
    fake.names = [("llm", "worker-0"), ("llm", "worker-1")]
    fake.answers = {"worker-0": Ref("10.0.0.1:7000"), "worker-1": Ref("10.0.0.2:7000")}
    registry = registry_on(fake)
    discover(registry)
    with_handles(registry, ["10.0.0.1:7000", "10.0.0.2:7000"])
    fake.answers["worker-1"] = Ref(ready=False)  # busy in stop()
    assert discover(registry, draining={"10.0.0.2:7000"}) == ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert discover(registry, unhealthy={"10.0.0.2:7000"}) == ["10.0.0.1:7000"]  # no drain: left out


def test_streams_on_a_worker_that_leaves_discovery_end_as_lost_not_as_client_cancels(fake):
    """A restarting actor drops out of discovery; its handle's open streams must end as worker
    losses (UNAVAILABLE to their clients). Before, only its channel was closed, which cancels the
    calls like a client's cancel: the router sent no status and the client waited for its own
    deadline (a 120 s hang seen in test_ray_cluster's killed-worker test)."""

    class Call:
        def __init__(self):
            self.cancelled = False

        def cancel(self):
            self.cancelled = True

    fake.names = [("llm", "worker-0"), ("llm", "worker-1")]
    fake.answers = {"worker-0": Ref("127.0.0.1:1"), "worker-1": Ref("127.0.0.1:2")}  # nothing listens

    async def main():
        registry = registry_on(fake, probe_timeout_s=0.2, down_after_probes=5)  # probes: not yet down
        await registry._refresh()
        on_1 = registry.track(registry._handles["127.0.0.1:2"], Call())
        on_0 = registry.track(registry._handles["127.0.0.1:1"], Call())
        fake.answers["worker-1"] = Ref(ready=False)  # restarting: asked again, no answer yet
        await registry._refresh()  # the failed probes made both unhealthy, so both are asked
        assert "127.0.0.1:2" not in registry._handles
        try:
            return on_0, on_1
        finally:
            await registry.stop()

    on_0, on_1 = asyncio.run(main())
    assert on_1.call.cancelled and "left the registry" in on_1.down_reason
    assert not on_0.call.cancelled and on_0.down_reason == ""  # still discovered: left alone


def test_dead_actor_is_dropped_and_forgotten_when_unlisted(fake):
    fake.names = [("llm", "worker-0"), ("llm", "worker-1")]
    fake.answers = {"worker-0": Ref("10.0.0.1:7000"), "worker-1": Ref(error=RayError("actor died"))}
    registry = registry_on(fake)
    assert discover(registry) == ["10.0.0.1:7000"]
    fake.names = [("llm", "worker-0")]
    assert discover(registry) == ["10.0.0.1:7000"]
    assert set(registry._actors) == {"worker-0"}


def test_static_addresses_come_first_and_ray_outage_keeps_known_workers(fake):
    fake.names = [("llm", "worker-0")]
    fake.answers = {"worker-0": Ref("10.0.0.1:7000")}
    registry = registry_on(fake, static=("10.0.0.1:7000", "10.0.0.9:7000"))
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.9:7000"]
    fake.listing_fails = True
    assert discover(registry) == ["10.0.0.1:7000", "10.0.0.9:7000"]


def test_router_loads_ray_only_for_ray_discovery():
    code = (
        "import sys, router.__main__, router.server, router.ray_registry, deploy.ray_launch; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_simulated_cluster_retries_a_head_that_does_not_start_then_gives_up(monkeypatch):
    """deploy.sim_cluster: a head start that fails (Ray's bare Exception after its 30 s wait), or
    whose Ray Client server does not listen, is shut down and tried again, START_ATTEMPTS times in
    all, then the error is raised."""
    import ray
    import ray.cluster_utils

    from deploy import sim_cluster

    clusters = []

    class FakeCluster:
        def __init__(self, initialize_head: bool):
            assert not initialize_head
            self.nodes, self.stopped, self.address = [], False, "127.0.0.1:1"
            clusters.append(self)

        def add_node(self, **args):
            if "num_gpus" not in args and len(clusters) < failures + 1:  # the head, failing
                raise Exception("The current node timed out during startup.")
            self.nodes.append(args)

        def wait_for_nodes(self):
            assert len(self.nodes) == 3  # the head and two nodes

        def shutdown(self):
            self.stopped = True

    monkeypatch.setattr(ray.cluster_utils, "Cluster", FakeCluster)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    failures = 1
    with sim_cluster.SimulatedCluster(2, 2) as sim:
        assert sim.cluster is clusters[-1] and len(clusters) == 2 and clusters[0].stopped
    clusters.clear()
    failures = sim_cluster.START_ATTEMPTS
    with pytest.raises(Exception, match="timed out during startup"):
        sim_cluster.SimulatedCluster(2, 2).__enter__()
    assert len(clusters) == sim_cluster.START_ATTEMPTS and all(c.stopped for c in clusters)

    # with a Ray Client port: a head whose client server never listens is started again too
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]  # not listening yet: connections to it are refused
    monkeypatch.setattr(sim_cluster, "CLIENT_SERVER_START_S", 0.5)
    clusters.clear()
    failures = 0

    def head_listening_on_the_second_try(self, **args):
        self.nodes.append(args)
        if "num_gpus" not in args:
            assert args["ray_client_server_port"] == port
            if len(clusters) == 2 and listener.fileno() != -1:  # -1: closed below
                listener.listen()

    monkeypatch.setattr(FakeCluster, "add_node", head_listening_on_the_second_try)
    try:
        with sim_cluster.SimulatedCluster(2, 2, client_port=port) as sim:
            assert sim.cluster is clusters[1] and len(clusters) == 2 and clusters[0].stopped
            assert not sim.cluster.stopped
        listener.close()  # nothing listens any more: every attempt fails, then the timeout is raised
        clusters.clear()
        with pytest.raises(TimeoutError, match=f"nothing listens on port {port}"):
            sim_cluster.SimulatedCluster(2, 2, client_port=port).__enter__()
        assert len(clusters) == sim_cluster.START_ATTEMPTS and all(c.stopped for c in clusters)
    finally:
        listener.close()
