"""router/lora_autoload.py's choices, over an in-memory stand-in for AdapterAdmin (workers with a
fixed number of slots): which adapter makes room (least recently named, never one a request in the
router names, never an admin's, the next when a worker refuses), that the search ends, failures
remembered for retry_s only, and one load per name however many wait or leave. The real workers
and router: tests/test_lora_autoload_e2e.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from router.errors import DeadlineExceeded, Overloaded, Unavailable, ValidationError
from router.lora_admin import AdapterRefused, Loaded
from router.lora_autoload import Autoloader


class FakeAdmin:
    """Workers with `slots` adapter slots: `held` the adapters on them, `loaded` those an admin
    loaded (remembered: `load_core(remember=True)`); names in `missing` have no directory;
    `running` names a worker refuses to unload (requests running there); `unreachable` names only
    a worker that does not answer holds; `unload_gate` set: an unload waits for it."""

    def __init__(self, slots: int):
        self.slots = slots
        self.held: dict[str, Loaded] = {}
        self.loaded: dict[str, Loaded] = {}
        self.missing: set[str] = set()
        self.running: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None  # set: loads wait for it
        self.unload_gate: asyncio.Event | None = None
        self.unreachable: set[str] = set()
        self.elsewhere: set[str] = set()  # on the workers, not yet in this router's view

    def served_bases(self) -> list[str]:
        return ["tiny"]

    def serves(self, name: str) -> bool:
        return name in self.held

    def holds(self, name: str) -> bool:
        return name in self.held

    def admin_load(self, name: str) -> None:
        self.held[name] = self.loaded[name] = Loaded("tiny", name)

    async def load_core(self, name: str, path: str, base: str, *, remember: bool = True):
        self.calls.append(("load", name))
        if self.gate is not None:
            await self.gate.wait()
        if name in self.missing:
            raise AdapterRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a worker refused: {name!r} has no adapter_config.json",
                worker_code=grpc.StatusCode.INVALID_ARGUMENT,
            )
        if len(self.held) >= self.slots:
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION, "full", worker_code=grpc.StatusCode.RESOURCE_EXHAUSTED
            )
        if name in self.elsewhere:  # every worker answers ALREADY_EXISTS (another router loaded it)
            self.held[name] = Loaded(base, path)
            return None, 0
        self.held[name] = Loaded(base, path)
        if remember:
            self.loaded[name] = self.held[name]
        return None, 1

    async def unload_core(self, name: str):
        self.calls.append(("unload", name))
        if self.unload_gate is not None:
            await self.unload_gate.wait()
        if name in self.running:
            raise AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, "requests are running with it")
        if name in self.unreachable:  # only a worker that does not answer holds it: nothing unloaded
            return SimpleNamespace(num_workers=0)
        del self.held[name]
        self.loaded.pop(name, None)
        return SimpleNamespace(num_workers=1)


def gated() -> tuple[FakeAdmin, Autoloader]:
    """Two slots, loads held at `admin.gate` until the test sets it."""
    admin = FakeAdmin(slots=2)
    admin.gate = asyncio.Event()
    return admin, Autoloader(admin, retry_s=60)


def run(coro):
    return asyncio.run(coro)


def test_the_least_recently_named_idle_adapter_makes_room():
    async def main():
        admin = FakeAdmin(slots=3)
        auto = Autoloader(admin, retry_s=60)
        for name in ("a", "b", "c"):
            with auto.naming(name):
                assert await auto.ensure(name, set(admin.held))
        assert not admin.loaded  # loaded on demand: not remembered (no restore, no undoing)
        with auto.naming("a"):  # a named again: b is now the least recent
            assert not await auto.ensure("a", set(admin.held))
        with auto.naming("d"):
            await auto.ensure("d", set(admin.held))
        assert set(admin.held) == {"a", "c", "d"}
        # b is held by a request in the router (queued or running): c goes instead, though older
        admin.held["b"] = Loaded("tiny", "b")
        del admin.held["a"]
        with auto.naming("b"), auto.naming("e"):
            auto.last_used["b"] = 0.0  # the oldest, but named by a request here
            await auto.ensure("e", set(admin.held))
        assert set(admin.held) == {"b", "d", "e"}

    run(main())


def test_a_worker_that_refuses_the_unload_moves_on_and_the_search_ends():
    async def main():
        admin = FakeAdmin(slots=2)
        auto = Autoloader(admin, retry_s=60)
        for name in ("a", "b"):
            with auto.naming(name):
                await auto.ensure(name, set(admin.held))
        admin.running = {"a"}  # still running on a worker: b goes
        with auto.naming("c"):
            await auto.ensure("c", set(admin.held))
        assert set(admin.held) == {"a", "c"}
        admin.running = {"a", "c"}
        with auto.naming("d"), pytest.raises(Overloaded) as full:
            await auto.ensure("d", set(admin.held))
        assert full.value.retry_after_ms == 1000 and "retry later" in full.value.message
        unloads = [n for op, n in admin.calls if op == "unload"]
        assert unloads == ["a", "b", "a", "c"]  # each candidate tried once per load, then it stops
        # An admin unloads both and loads them again: its adapters now, never candidates.
        admin.running.clear()
        for name in ("a", "c"):
            admin.admin_load(name)
        with pytest.raises(Overloaded):
            await auto.ensure("d", set(admin.held))
        assert set(admin.held) == {"a", "c"} and not auto.last_used
        assert [n for op, n in admin.calls if op == "unload"] == unloads  # none tried

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
        assert not auto.would_load("x", {"x"}) and "x" not in auto._failed  # served after all (the
        # router's check before `ensure`, router/service.py `_autoload`)
        auto = Autoloader(admin, retry_s=0)  # not remembered: each request asks again
        for _ in range(2):
            with pytest.raises(ValidationError):
                await auto.ensure("x", set())
        assert admin.calls == [("load", "x")] * 3

        # Not the request's fault, so never remembered: no worker answered, a worker's own failure
        # (INTERNAL), the router's own refusal (an admin's load or unload of that name under way).
        refusals = {
            "y": AdapterRefused(
                grpc.StatusCode.UNAVAILABLE, "no answer", worker_code=grpc.StatusCode.UNAVAILABLE
            ),
            "z": AdapterRefused(grpc.StatusCode.INTERNAL, "failed", worker_code=grpc.StatusCode.INTERNAL),
            "w": AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, "another load or unload is in progress"),
        }

        async def refused(name, path, base, remember=True):
            raise refusals[name]

        admin.load_core = refused
        auto = Autoloader(admin, retry_s=60)
        for name in refusals:
            for _ in range(2):
                with pytest.raises(Unavailable) as unavailable:
                    await auto.ensure(name, set())
                assert (
                    "retry" in unavailable.value.message and "unknown model" not in unavailable.value.message
                )
        assert not auto._failed
        # Not adapter names, a served name, or several base models: nothing is tried.
        assert not await auto.ensure("../y", set()) and not await auto.ensure("tiny", {"tiny"})
        admin.served_bases = lambda: ["tiny", "other"]
        assert not await auto.ensure("v", set())

    run(main())


def test_what_another_router_loaded_or_a_hung_worker_holds_is_not_counted_as_room():
    """A load every worker answers with ALREADY_EXISTS (another router's) is served but not this
    router's to unload; an unload that reached no worker (the one holding it does not answer)
    made no room: the next candidate goes, and the name stays a candidate for later."""

    async def main():
        admin = FakeAdmin(slots=2)
        auto = Autoloader(admin, retry_s=60)
        admin.elsewhere = {"theirs"}  # loaded through another router; this one has not seen it yet
        assert await auto.ensure("theirs", set()) and "theirs" in admin.held
        assert "theirs" not in auto.last_used
        del admin.held["theirs"]
        for name in ("a", "b"):
            assert await auto.ensure(name, set(admin.held))
        admin.unreachable = {"a"}
        assert await auto.ensure("c", set(admin.held))
        assert set(admin.held) == {"a", "c"}
        assert admin.calls[-4:] == [("load", "c"), ("unload", "a"), ("unload", "b"), ("load", "c")]
        assert set(auto.last_used) == {"a", "c"}  # a: still on the hung worker, a candidate later

    run(main())


def test_a_request_outlasting_its_deadline_leaves_and_the_load_goes_on():
    async def main():
        admin, auto = gated()
        patient = asyncio.create_task(auto.ensure("a", set()))
        with pytest.raises(DeadlineExceeded) as late:
            await auto.ensure("a", set(), deadline_s=time.monotonic() + 0.05)
        assert "still loading" in late.value.message
        with pytest.raises(DeadlineExceeded):  # a deadline already past: no wait, no load started
            await auto.ensure("b", set(), deadline_s=time.monotonic() - 1.0)
        assert "b" not in auto._loading
        admin.gate.set()
        assert await asyncio.wait_for(patient, 10.0) and "a" in admin.held
        assert admin.calls == [("load", "a")]

    run(main())


def test_a_request_naming_the_adapter_being_unloaded_loads_it_again():
    """Its unload to make room was under way when the request came (it saw it served): it waits
    behind that load and loads it again, instead of being sent to a worker that drops it."""

    async def main():
        admin = FakeAdmin(slots=1)
        auto = Autoloader(admin, retry_s=60)
        with auto.naming("a"):
            await auto.ensure("a", set(admin.held))
        admin.unload_gate = asyncio.Event()
        with auto.naming("b"):  # b's request: its load evicts a (named by no request now)
            loading_b = asyncio.create_task(auto.ensure("b", set(admin.held)))
            while ("unload", "a") not in admin.calls:
                await asyncio.sleep(0)
        served = set(admin.held)
        assert "a" in served  # the unload is under way
        with auto.naming("a"):
            again = asyncio.create_task(auto.ensure("a", served))
            await asyncio.sleep(0)
            admin.unload_gate.set()
            assert await asyncio.wait_for(loading_b, 10.0)
            admin.unload_gate = None
            assert await asyncio.wait_for(again, 10.0)  # loaded again (b evicted: not named now)
        assert admin.calls == [
            ("load", "a"),
            ("load", "b"),
            ("unload", "a"),
            ("load", "b"),
            ("load", "a"),
            ("unload", "b"),
            ("load", "a"),
        ]

    run(main())


def test_one_load_per_name_for_every_waiter_even_when_some_leave():
    async def main():
        admin, auto = gated()
        waiters = [asyncio.create_task(auto.ensure("a", set())) for _ in range(5)]
        await asyncio.sleep(0)  # every waiter reached the shared load
        waiters[0].cancel()  # one client leaves: the load goes on for the others
        admin.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [True] * 4
        assert admin.calls == [("load", "a")] and "a" in admin.held
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
        admin.admin_load("a")  # an admin's load, while b's load holds the lock
        admin.gate.set()
        assert await asyncio.gather(first, second) == [True, True]
        assert admin.calls == [("load", "b")] and "a" not in auto.last_used  # an admin's: kept

    run(main())
