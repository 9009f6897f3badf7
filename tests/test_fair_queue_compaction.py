"""Cancelled requests leave a backlogged tenant's heap; the wait estimate does not walk them.

Proven: while a tenant stays backlogged behind a request that keeps waiting (a higher-priority
head with no room), a stream of requests cancelled in the queue keeps its heap within
3 x queued + 16 entries (at most 2 x queued + 16 of them removed), releases the cancelled
requests' payloads, and 20000 admissions with a deadline (each runs `estimated_wait_s`) stay
cheap; the estimate after the cancellations equals the one computed from the live requests alone,
in both modes, with `check_integrity` holding.

Found by review 2026-12-04: `FairQueue.remove` only marked an item dead, dead entries left the
heap only at its top or when the tenant's queue emptied, and `estimated_wait_s` walked the whole
heap on every admission with a deadline: memory (each dead entry held the router's Pending: a
future, prefix hashes) and per-admission time grew with the number of cancellations.
"""

from __future__ import annotations

import gc
import random
import time
import weakref

import pytest

from router.admission import AdmissionController, TenantLimits
from router.fair_queue import FairQueue, QueuedRequest


class Payload:
    """What a queued request carries (the router's Pending): the test watches it being freed."""


def measured_queue(**kwargs) -> tuple[list[float], FairQueue]:
    """A queue whose meter reads 1000 units/s: 10 requests of cost 100 that waited 1 s for room."""
    clock = [0.0]
    queue = FairQueue(lambda: clock[0], meter_half_life_s=1e12, **kwargs)
    for _ in range(10):
        queue.push(QueuedRequest("warmup", 1.0, 100, 0))
    assert queue.pop_next(lambda _: False) is None
    clock[0] += 1.0
    while queue.pop_next(lambda _: True):
        pass  # drains the ten warm-up requests: they waited, so the meter counts them
    assert queue.dispatch_rate() == pytest.approx(1000.0)
    return clock, queue


def test_cancelled_requests_do_not_stay_in_a_backlogged_tenants_heap():
    clock, queue = measured_queue()
    ctl = AdmissionController(queue, clock=lambda: clock[0])
    tenant = TenantLimits("t", max_queued=16)
    ctl.admit(tenant, 10, 10, priority=5)  # waits for room the whole time: the tenant stays active
    first = Payload()
    ref = weakref.ref(first)
    ctl.admit(tenant, 10, 10, priority=0, payload=first).release()  # cancelled while queued
    del first
    heap = queue._tenants["t"].heap
    largest = 0
    started = time.perf_counter()
    for _ in range(20_000):  # clients that time out in the queue and retry
        ctl.admit(tenant, 10, 10, priority=0, deadline_s=clock[0] + 60, payload=Payload()).release()
        largest = max(largest, len(queue._tenants["t"].heap))
    elapsed_s = time.perf_counter() - started
    gc.collect()
    heap = queue._tenants["t"].heap
    print(f"heap entries {len(heap)} (at most {largest}) for 1 queued; 20k admissions {elapsed_s:.2f} s")
    assert queue.num_queued("t") == 1
    assert ref() is None, "the queue still holds a cancelled request's payload"
    assert largest <= 3 * 1 + 16, f"{largest} heap entries for 1 queued request"
    # linear in the admissions (~0.3 s here); walking the dead entries made it quadratic (minutes)
    assert elapsed_s < 20.0, elapsed_s
    queue.check_integrity()


@pytest.mark.parametrize("mode", ["vtc", "fcfs"])
def test_the_wait_estimate_after_many_cancellations_counts_only_live_requests(mode):
    rng = random.Random(4)
    clock, queue = measured_queue(mode=mode)
    live: dict[str, list[QueuedRequest]] = {"a": [], "b": []}
    for step in range(3000):
        name = rng.choice("ab")
        if len(live[name]) > 20 and rng.random() < 0.5:  # cancel one of a backlogged tenant's
            victim = live[name].pop(rng.randrange(len(live[name])))
            assert queue.remove(victim)
        else:
            req = QueuedRequest(name, 1.0, rng.randint(1, 50), rng.randint(0, 50), rng.randint(0, 3))
            queue.push(req)
            live[name].append(req)
        if step % 100 == 0:
            queue.check_integrity()
        for t in "ab":
            entries = len(queue._tenants[t].heap) if t in queue._tenants else 0
            assert entries <= 3 * len(live[t]) + 16, (t, entries, len(live[t]))
    queue.check_integrity()
    assert live["a"] and live["b"], "the estimate below assumes both tenants backlogged"
    for priority in range(5):
        got = queue.estimated_wait_s("a", 1.0, priority)
        if mode == "fcfs":
            work = sum(r.max_cost for rs in live.values() for r in rs if r.priority >= priority)
        else:  # a's own work ahead, and b served up to the same counter meanwhile
            ahead = sum(r.max_cost for r in live["a"] if r.priority >= priority)
            a, b = queue._tenants["a"], queue._tenants["b"]
            target = a.counter + ahead
            work = ahead + min(b.queued_cost, max(0.0, target - b.counter))
        assert got == pytest.approx(work / 1000.0), priority
