"""The hold for blocked heads (router/fair_queue.py, `hold_for_blocked`) does not hold back a head of
higher priority than the blocked one: docs/fairness.md section 7 promises that "a high-priority
request goes out at once to a worker that is full of lower-priority work" (the worker preempts
for it). Found by review on 2026-12-04: when another tenant's lower-priority head was blocked and
the urgent request's tenant led it by more than that head's cost, the urgent request waited until
the lower-priority work on the worker ended (a long batch stream: indefinitely), though the room
rule let it onto the worker and the blocked head could not use that room anyway.

Fake workers as in tests/test_fairness_dispatch.py."""

from __future__ import annotations

import asyncio

from router.admission import AdmissionController, TenantLimits
from router.affinity import PrefixAffinity
from router.dispatcher import Dispatcher, Pending
from router.fair_queue import FairQueue
from tests.test_fairness_dispatch import FakeRegistry, FakeWorker


def test_an_urgent_request_is_not_held_behind_another_tenants_blocked_low_priority_head():
    loop = asyncio.new_event_loop()
    try:
        w = FakeWorker("w0")
        queue = FairQueue()
        dispatcher = Dispatcher(queue, FakeRegistry(w), PrefixAffinity(), clock=lambda: 0.0)
        admission = AdmissionController(queue)

        def submit(tenant, priority=0):
            pending = Pending("m", [], loop.create_future())
            admission.admit(TenantLimits(tenant), 64, 64, priority=priority, payload=pending)
            return pending

        batch = [submit("chat") for _ in range(2)]  # chat's long priority-0 jobs fill the worker
        assert dispatcher.dispatch_ready() == 2
        other = submit("bulk")  # another tenant's priority-0 request: no room, it waits
        for p in batch:  # chat's jobs stream on (output charged as relayed)
            p.future.result().progress(64, first=True)
        urgent = submit("chat", priority=5)
        # room rule: no priority >= 5 work on w0, 256 - 0 >= 128: the worker takes it at once
        assert dispatcher._fits(w, queue._tenants["chat"].head())
        dispatcher.dispatch_ready()
        assert not other.future.done()
        assert urgent.future.done(), (
            "the priority-5 request waits for chat's priority-0 jobs to end, held behind bulk's "
            f"blocked priority-0 head (counters {queue.counters()})"
        )
    finally:
        loop.close()
