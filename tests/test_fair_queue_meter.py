"""The fair queue's dispatch meter measures the fleet's service rate under a backlog, not arrivals.

Proven: a request that goes straight to a worker (the dispatcher pops it a turn after its push,
so it "waited" microseconds on the real clock) adds nothing to the meter; from a pop that finds
no room until the queue drains, the meter divides the work of the requests that waited for room
by that time, so it reads the fleet's drain rate; idle time after the backlog does not dilute it;
a head refused while another tenant's request went out counts as waiting. End to end (real router
pieces, tests/router_harness.py), the retry-after of a full queue is then one request's work at
the drain rate instead of a few milliseconds.

Found by review 2026-12-04: the meter counted every request whose pop came after its push
(`clock() > arrival_s`), i.e. all of them with time.monotonic, while the backlogged time was the
microseconds the queue held each one: rates 10-20x too high, so retry-after values of a few ms
under a real backlog and deadline refusals that never happened. The fake clock of
tests/test_fairness_admission.py pushed and popped at the same instant, which hid it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from router.errors import Overloaded
from router.fair_queue import OUTPUT_COST, FairQueue, QueuedRequest
from router.tenants import Tenant
from tests.router_harness import Router, ScriptedWorker, request

SERVICE_S = 0.1  # each request holds the only worker slot this long
COST = 4 + 2 * 1  # max_cost of QueuedRequest(tenant, 1.0, 4, 1): prompt + 2 x max_tokens


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def item(tenant: str = "t", prompt: int = 4, max_tokens: int = 1) -> QueuedRequest:
    return QueuedRequest(tenant, 1.0, prompt, max_tokens)


def test_straight_dispatches_do_not_count_and_a_backlog_measures_the_drain_rate():
    clock = FakeClock()
    queue = FairQueue(clock, meter_half_life_s=1e12)
    for _ in range(20):  # light traffic: popped a dispatcher turn (10 us) after the push, with room
        queue.push(item())
        clock.now_s += 1e-5
        assert queue.pop_next(lambda _: True) is not None
        assert queue.pop_next(lambda _: True) is None
        clock.now_s += 1.0
    assert queue.dispatch_rate() is None  # the old meter: 20 x 6 units in 200 us, 600000 units/s
    # a backlog: one slot, taken; three requests wait and leave one per SERVICE_S
    for _ in range(3):
        queue.push(item())
    assert queue.pop_next(lambda _: False) is None  # no room: the backlog starts here
    for left in (2, 1, 0):
        clock.now_s += SERVICE_S
        assert queue.pop_next(lambda _: True) is not None
        if left:
            assert queue.pop_next(lambda _: False) is None
    assert len(queue) == 0
    assert queue.dispatch_rate() == pytest.approx(COST / SERVICE_S)
    clock.now_s += 30.0  # idle: no backlog, so no time against the rate
    queue.push(item())
    clock.now_s += 1e-5
    assert queue.pop_next(lambda _: True) is not None  # straight to a worker again: not counted
    assert queue.dispatch_rate() == pytest.approx(COST / SERVICE_S)


def test_a_head_refused_while_another_tenant_went_out_counts_as_waiting():
    clock = FakeClock()
    queue = FairQueue(clock, meter_half_life_s=1e12)
    big, small = item("a", prompt=100), item("b")
    queue.push(big)
    queue.push(small)
    # room for the small one only: it goes out at once (not counted), the big one waits
    assert queue.pop_next(lambda i: i is small) is small
    clock.now_s += 0.5
    assert queue.pop_next(lambda _: True) is big
    assert queue.dispatch_rate() == pytest.approx(big.max_cost / 0.5)


def test_a_removal_that_drains_the_queue_ends_the_backlog():
    clock = FakeClock()
    queue = FairQueue(clock, meter_half_life_s=1e12)
    first, second = item(), item()
    queue.push(first)
    queue.push(second)
    assert queue.pop_next(lambda _: False) is None
    clock.now_s += SERVICE_S
    assert queue.pop_next(lambda _: True) is first
    assert queue.remove(second)  # cancelled: the queue is empty, the backlog over
    clock.now_s += 100.0
    assert queue.dispatch_rate() == pytest.approx(COST / SERVICE_S)


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def test_retry_after_of_a_full_queue_reflects_the_backlog_not_immediate_dispatches():
    worker = ScriptedWorker(max_num_seqs=1)
    worker.behavior = lambda req: [("sleep", SERVICE_S), ("tok", 1), ("finish",)]
    tenant = Tenant("t", max_priority=10, max_queued=2)
    max_tokens = 20  # the early refusal (before tokenizing) prices a request at 2 x max_tokens
    cost = 4 + OUTPUT_COST * max_tokens
    true_rate = cost / SERVICE_S  # one request per SERVICE_S while backlogged

    async def main():
        router = await Router.create([worker], tenant=tenant, poll_s=60)
        try:
            for _ in range(20):  # light traffic first: nothing ever waits for room
                _, err = await router.generate(request(max_tokens=max_tokens))
                assert err is None, err
            # a backlog: one running, two queued (the tenant's max_queued); one at a time, since
            # requests admitted in the same turn all count as queued until the dispatcher runs
            calls = [asyncio.ensure_future(router.generate(request(max_tokens=max_tokens)))]
            await until(lambda: worker.open == 1, "the first request never reached the worker")
            for n in (1, 2):
                calls.append(asyncio.ensure_future(router.generate(request(max_tokens=max_tokens))))
                await until(lambda: len(router.queue) == n, "the request was never queued")
            await until(lambda: worker.calls == 22, "the first queued request never left the queue")
            calls.append(asyncio.ensure_future(router.generate(request(max_tokens=max_tokens))))
            await until(lambda: len(router.queue) == 2, "the queue never filled")
            rate = router.queue.dispatch_rate()
            _, err = await router.generate(request(max_tokens=max_tokens))
            assert isinstance(err, Overloaded), err
            assert rate is not None, "no backlog was measured"
            print(f"rate {rate:.0f} units/s vs ~{true_rate:.0f}; retry-after {err.retry_after_ms} ms")
            # a busy machine only slows the fleet (a lower rate); the defect read 10-20x too high
            assert 0.2 * true_rate <= rate <= 1.5 * true_rate, rate
            # one request's work (~SERVICE_S) at the whole rate; accept anything above half of it
            assert err.retry_after_ms >= 50, (
                f"retry-after {err.retry_after_ms} ms for a queue that drains one request per "
                f"{SERVICE_S * 1e3:.0f} ms (measured rate {rate:.0f} vs ~{true_rate:.0f} units/s)"
            )
            await asyncio.gather(*calls)
        finally:
            await router.close()

    asyncio.run(main())
