"""router/lora_autoload.py's choices, over an in-memory stand-in for AdapterAdmin (workers with a
fixed number of slots): which adapter makes room (least recently named, never one a request in the
router names, never an admin's, the next when a worker refuses), that the search ends, failures
remembered for retry_s only, and one load per name however many wait or leave. The real workers
and router: tests/test_lora_autoload_e2e.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.errors import Overloaded, Unavailable, ValidationError
from router.lora_admin import AdapterRefused, Loaded
from router.lora_autoload import Autoloader


class FakeAdmin:
    """Workers with `slots` adapter slots; names in `missing` have no directory; `running` names
    a worker refuses to unload (requests running there)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.loaded: dict[str, Loaded] = {}
        self.missing: set[str] = set()
        self.running: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None  # set: loads wait for it

    def served_bases(self) -> list[str]:
        return ["tiny"]

    def serves(self, name: str) -> bool:
        return name in self.loaded

    async def load_core(self, name: str, path: str, base: str):
        self.calls.append(("load", name))
        if self.gate is not None:
            await self.gate.wait()
        if name in self.missing:
            raise AdapterRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} has no adapter_config.json")
        if len(self.loaded) >= self.slots:
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION, "full", worker_code=grpc.StatusCode.RESOURCE_EXHAUSTED
            )
        self.loaded[name] = Loaded(base, path)

    async def unload_core(self, name: str):
        self.calls.append(("unload", name))
        if name in self.running:
            raise AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, "requests are running with it")
        del self.loaded[name]


def run(coro):
    return asyncio.run(coro)


def test_the_least_recently_named_idle_adapter_makes_room():
    async def main():
        admin = FakeAdmin(slots=3)
        auto = Autoloader(admin, retry_s=60)
        for name in ("a", "b", "c"):
            with auto.naming(name):
                assert await auto.ensure(name, set(admin.loaded))
        with auto.naming("a"):  # a named again: b is now the least recent
            assert not await auto.ensure("a", set(admin.loaded))
        with auto.naming("d"):
            await auto.ensure("d", set(admin.loaded))
        assert set(admin.loaded) == {"a", "c", "d"}
        # b is held by a request in the router (queued or running): c goes instead, though older
        admin.loaded["b"] = Loaded("tiny", "b")
        del admin.loaded["a"]
        with auto.naming("b"), auto.naming("e"):
            auto.last_used["b"] = 0.0  # the oldest, but named by a request here
            await auto.ensure("e", set(admin.loaded))
        assert set(admin.loaded) == {"b", "d", "e"}

    run(main())


def test_a_worker_that_refuses_the_unload_moves_on_and_the_search_ends():
    async def main():
        admin = FakeAdmin(slots=2)
        auto = Autoloader(admin, retry_s=60)
        for name in ("a", "b"):
            with auto.naming(name):
                await auto.ensure(name, set(admin.loaded))
        admin.running = {"a"}  # still running on a worker: b goes
        with auto.naming("c"):
            await auto.ensure("c", set(admin.loaded))
        assert set(admin.loaded) == {"a", "c"}
        admin.running = {"a", "c"}
        with auto.naming("d"), pytest.raises(Overloaded) as full:
            await auto.ensure("d", set(admin.loaded))
        assert full.value.retry_after_ms == 1000 and "retry later" in full.value.message
        unloads = [n for op, n in admin.calls if op == "unload"]
        assert unloads == ["a", "b", "a", "c"]  # each candidate tried once per load, then it stops
        # An adapter an admin loaded (not in last_used) is never a candidate.
        admin.running.clear()
        auto.last_used.clear()
        with pytest.raises(Overloaded):
            await auto.ensure("d", set(admin.loaded))
        assert set(admin.loaded) == {"a", "c"}

    run(main())


def test_failures_are_remembered_for_retry_s_and_unavailable_is_not():
    async def main():
        admin = FakeAdmin(slots=2)
        admin.missing = {"x"}
        auto = Autoloader(admin, retry_s=60)
        for _ in range(3):
            with pytest.raises(ValidationError) as bad:
                await auto.ensure("x", set())
            assert "unknown model 'x'" in bad.value.message and "adapter_config" in bad.value.message
        assert admin.calls == [("load", "x")]
        auto = Autoloader(admin, retry_s=0)  # not remembered: each request asks again
        for _ in range(2):
            with pytest.raises(ValidationError):
                await auto.ensure("x", set())
        assert admin.calls == [("load", "x")] * 3

        async def gone(name, path, base):
            raise AdapterRefused(grpc.StatusCode.UNAVAILABLE, "no answer")

        admin.load_core = gone
        auto = Autoloader(admin, retry_s=60)
        for _ in range(2):
            with pytest.raises(Unavailable):
                await auto.ensure("y", set())
        assert "y" not in auto._failed
        # Not adapter names, a served name, or several base models: nothing is tried.
        assert not await auto.ensure("../y", set()) and not await auto.ensure("tiny", {"tiny"})
        admin.served_bases = lambda: ["tiny", "other"]
        assert not await auto.ensure("z", set())

    run(main())


def test_one_load_per_name_for_every_waiter_even_when_some_leave():
    async def main():
        admin = FakeAdmin(slots=2)
        admin.gate = asyncio.Event()
        auto = Autoloader(admin, retry_s=60)
        waiters = [asyncio.create_task(auto.ensure("a", set())) for _ in range(5)]
        await asyncio.sleep(0)  # every waiter reached the shared load
        waiters[0].cancel()  # one client leaves: the load goes on for the others
        admin.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [True] * 4
        assert admin.calls == [("load", "a")] and "a" in admin.loaded
        assert not auto._loading

    run(main())


def test_a_name_loaded_while_its_load_waited_is_not_loaded_again():
    """Loads run one at a time: one that waited behind another finds its name served by then (an
    admin loaded it) and asks no worker (which would refuse a second load of a served name)."""

    async def main():
        admin = FakeAdmin(slots=3)
        admin.gate = asyncio.Event()
        auto = Autoloader(admin, retry_s=60)
        first = asyncio.create_task(auto.ensure("b", set()))
        second = asyncio.create_task(auto.ensure("a", set()))
        await asyncio.sleep(0)
        admin.loaded["a"] = Loaded("tiny", "a")  # an admin's load, while b's load holds the lock
        admin.gate.set()
        assert await asyncio.gather(first, second) == [True, True]
        assert admin.calls == [("load", "b")] and "a" not in auto.last_used  # an admin's: kept

    run(main())
