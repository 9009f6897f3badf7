"""router/lora_admin.py's bookkeeping over several workers, with in-memory worker stubs (the gRPC
path, processes and HTTP are tests/test_lora_runtime_e2e.py's): workers restarted together all
get a remembered adapter back, an unload reaches a worker that had it again, and two routers
managing one adapter settle instead of undoing each other forever."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc.aio import Metadata

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import worker_pb2
from router.lora_admin import AdapterAdmin, AdapterRefused
from router.registry import StaticRegistry, WorkerHandle
from router.tenants import Tenants


class Worker:
    """A worker's adapter list behind Worker.LoadAdapter / UnloadAdapter (each call yields once)."""

    def __init__(self):
        self.adapters: list[str] = []
        self.calls = 0
        self.ops: list[str] = []
        self.version = 0  # info_version: bumped by each load and unload, and by a restart
        self.full = False  # refuses loads as a worker at --max-lora-adapters does

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(model="base", adapters=self.adapters, info_version=self.version)

    async def LoadAdapter(self, request, timeout):
        self.calls += 1
        self.ops.append("load")
        await asyncio.sleep(0)
        if self.full:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(), Metadata(), "full")
        if request.name in self.adapters:  # worker/lora_files.py check_runtime_name
            details = f"adapter {request.name!r} is loaded already (unload it first)"
            raise grpc.aio.AioRpcError(grpc.StatusCode.ALREADY_EXISTS, Metadata(), Metadata(), details)
        self.adapters.append(request.name)
        self.version += 1
        return self.info()

    async def GetInfo(self, request, timeout):
        return self.info()

    async def UnloadAdapter(self, request, timeout):
        self.calls += 1
        self.ops.append("unload")
        await asyncio.sleep(0)
        self.adapters.remove(request.name)
        self.version += 1
        return self.info()


class Models:
    def ids(self) -> list[str]:
        return ["base"]


class TenantsFile:
    current = Tenants.default()


class Context:
    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"


def _router(workers: dict[str, Worker]) -> tuple[AdapterAdmin, StaticRegistry]:
    registry = StaticRegistry(tuple(workers))
    registry._handles = {
        address: WorkerHandle(address, None, stub, info=stub.info(), healthy=True)
        for address, stub in workers.items()
    }
    return AdapterAdmin(registry, Models(), TenantsFile()), registry


async def _probe(admin: AdapterAdmin, registry: StaticRegistry, returning=()) -> None:
    """What the registry's probe does (router/registry.py `_probe`): it reads a worker's info again
    when its info_version changed or it comes back (`returning`), then calls restore; and the
    restores that started."""
    for h in registry.all():
        if h.stub.version != h.info.info_version or h.address in returning:
            h.info = h.stub.info()
            admin.restore(h)
    await asyncio.gather(*admin._tasks)


def test_restarted_workers_all_get_it_back_and_unloads_reach_returning_ones():
    async def scenario():
        workers = {"w1": Worker(), "w2": Worker()}
        admin, registry = _router(workers)
        reply = await admin.load(pb.LoraAdapterRequest(name="x", path="x"), Context())
        assert reply.num_workers == 2 and all(w.adapters == ["x"] for w in workers.values())
        for w in workers.values():  # both restart together: their run-time adapters are gone
            w.adapters = []
        await _probe(admin, registry, returning=workers)
        assert all(w.adapters == ["x"] for w in workers.values())
        registry._handles["w2"].healthy = False  # hung: the unload cannot reach it
        reply = await admin.unload(pb.LoraAdapterRequest(name="x"), Context())
        assert reply.num_workers == 1 and workers["w1"].adapters == [] and workers["w2"].adapters == ["x"]
        await _probe(admin, registry, returning={"w2"})  # w2 answers again: x is unloaded there
        registry._handles["w2"].healthy = True
        assert workers["w2"].adapters == [] and not admin.dropped
        # w2 hangs again and leaves the registry (its actor is gone) before it answers: forgotten.
        await admin.load(pb.LoraAdapterRequest(name="y", path="y"), Context())
        registry._handles["w2"].healthy = False
        await admin.unload(pb.LoraAdapterRequest(name="y"), Context())
        assert admin.dropped == {"y": {"w2"}}
        del registry._handles["w2"]
        await _probe(admin, registry, returning={"w1"})
        assert not admin.dropped

    asyncio.run(scenario())


def test_two_routers_settle():
    async def scenario():
        worker = Worker()
        a, registry_a = _router({"w": worker})
        b, registry_b = _router({"w": worker})
        await a.load(pb.LoraAdapterRequest(name="x", path="x"), Context())
        await _probe(b, registry_b)  # b learns of x from the worker
        await b.unload(pb.LoraAdapterRequest(name="x"), Context())
        for _ in range(4):  # a restores what it loaded; b does not fight it: no more calls after
            await _probe(a, registry_a)
            await _probe(b, registry_b)
        calls = worker.calls
        await _probe(a, registry_a)
        await _probe(b, registry_b)
        assert worker.calls == calls and worker.adapters == ["x"]

    asyncio.run(scenario())


def test_routers_loading_on_demand_never_undo_each_other():
    """The autoloader's loads (`remember=False`, router/lora_autoload.py) through two routers over
    the same workers: a second load of a name a worker holds already counts as served there, an
    eviction by one is not reloaded by the other's restore, a load by one is not unloaded by the
    other's; an admin's load refused by a worker that holds the name leaves it there."""

    async def scenario():
        workers = {"w1": Worker(), "w2": Worker()}
        a, registry_a = _router(workers)
        b, registry_b = _router(workers)

        async def probes():
            for _ in range(2):
                await _probe(a, registry_a)
                await _probe(b, registry_b)

        await a.load_core("x", "x", "base", remember=False)
        reply, fresh = await b.load_core("x", "x", "base", remember=False)  # b had not read the change
        assert (reply.num_workers, fresh) == (2, 0) and all(w.adapters == ["x"] for w in workers.values())
        assert all("x" in h.info.adapters for h in registry_b.all())  # routable through b at once
        await a.unload_core("x")  # a makes room
        await probes()
        assert all(w.adapters == [] for w in workers.values())  # b does not load it back
        await b.load_core("x", "x", "base", remember=False)
        await probes()
        assert all(w.adapters == ["x"] for w in workers.values())  # a does not unload it
        workers["w2"].adapters.append("y")  # another router's, which this one has not read yet
        with pytest.raises(AdapterRefused) as refused:
            await a.load_core("y", "y", "base")
        assert (
            refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            and "loaded already" in refused.value.message
        )
        assert workers["w1"].adapters == ["x"] and workers["w2"].adapters == ["x", "y"]  # w1 only rolled back
        # A worker that refused outright (full) is not asked to unload: it may hold the name by
        # then, loaded through another router.
        workers["w2"].adapters, workers["w2"].full = ["x"], True
        for w in workers.values():
            w.ops.clear()
        with pytest.raises(AdapterRefused):
            await a.load_core("z", "z", "base", remember=False)
        assert workers["w1"].ops == ["load", "unload"] and workers["w2"].ops == ["load"]
        # An admin's unload through b, then a's load on demand of that name: b's restore keeps it.
        workers["w2"].full = False
        await probes()
        await b.load(pb.LoraAdapterRequest(name="sql", path="sql"), Context())
        await b.unload(pb.LoraAdapterRequest(name="sql"), Context())
        await probes()
        assert not b.dropped  # no worker holds it: forgotten
        await a.load_core("sql", "sql", "base", remember=False)
        await probes()
        assert all("sql" in w.adapters for w in workers.values())

    asyncio.run(scenario())


class _Engine:
    """What WorkerService.LoadAdapter uses of an AsyncEngine: reads block until released."""

    def __init__(self):
        import threading

        self.engine, self.reading, self.release, self.installed = self, [], threading.Event(), []

    def read_adapter(self, name, path):
        self.reading.append(name)
        if not self.release.wait(10):
            raise TimeoutError("the test never released the read")
        return name

    async def call(self, fn):
        return fn(self)

    def install_adapter(self, name, adapter):
        self.installed.append(name)


def test_a_worker_runs_one_load_at_a_time_even_when_its_caller_gives_up():
    """A load whose caller is cancelled mid-read keeps the worker's load lock until its work ends:
    the next load's read starts only then (so it sees the first adapter's slot taken); the
    cancelled call is counted as such."""
    from worker.server import WorkerService

    async def main():
        engine = _Engine()
        service = WorkerService(engine)
        service.GetInfo = lambda request, context: asyncio.sleep(0)
        first = asyncio.create_task(
            service.LoadAdapter(worker_pb2.LoadAdapterRequest(name="a", path="a"), None)
        )
        deadline = asyncio.get_running_loop().time() + 10
        while not engine.reading:  # the read thread started
            assert asyncio.get_running_loop().time() < deadline, "the first read never started"
            await asyncio.sleep(0.001)
        first.cancel()  # the router's deadline ran out
        second = asyncio.create_task(
            service.LoadAdapter(worker_pb2.LoadAdapterRequest(name="b", path="b"), None)
        )
        for _ in range(50):  # give b every chance to start reading (it must not)
            await asyncio.sleep(0.001)
        assert engine.reading == ["a"], engine.reading  # b waits for a's read and install
        engine.release.set()
        await asyncio.wait_for(second, 10)
        assert first.cancelled() and engine.installed == ["a", "b"] and engine.reading == ["a", "b"]

    asyncio.run(main())
