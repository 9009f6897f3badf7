"""Admission edges found by review on 2026-12-04 (router/admission.py, router/service.py):
- a burst of one tenant admitted in one event-loop turn counted itself as queued until the
  dispatcher's next turn, so an idle worker's room was refused as `tenant_queue_full` (the
  service now places an admitted request at once where a worker has room);
- after a tenants-file reload, calls from before it carry the old limits: every switch between
  old and new limits built the tenant's buckets afresh, full, handing out a whole tokens/min
  allowance each time (buckets are now resized, keeping their levels)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.admission import AdmissionController, AdmissionError, TenantLimits
from router.fair_queue import FairQueue
from router.tenants import Tenant
from tests.router_harness import Router, ScriptedWorker, request

TENANT = Tenant("t", max_priority=10, max_queued=1)


def test_a_burst_an_idle_worker_can_start_is_not_refused_as_queued():
    worker = ScriptedWorker(max_num_seqs=8)

    async def main():
        router = await Router.create([worker], tenant=TENANT, poll_s=60)
        try:
            results = await asyncio.gather(*(router.generate(request()) for _ in range(3)))
            errors = [err for _, err in results]
            assert errors == [None] * 3, (
                f"{errors}: refused on an idle worker with room for all three "
                f"(refusals {dict(router.admission.refusals)})"
            )
        finally:
            await router.close()

    asyncio.run(main())


def test_a_reload_does_not_refill_the_tokens_per_minute_on_every_old_new_alternation():
    clock = [0.0]
    queue = FairQueue(lambda: clock[0])
    ctl = AdmissionController(queue, clock=lambda: clock[0])
    old = TenantLimits("t", rate_tokens_per_min=100, rate_requests_per_s=100.0)
    new = TenantLimits("t", rate_tokens_per_min=100, rate_requests_per_s=50.0)  # tokens/min unchanged
    ctl.admit(old, 50, 50)  # the minute's 100 tokens are spent
    with pytest.raises(AdmissionError):
        ctl.admit(old, 50, 50)
    admitted = 0
    for tenant in (new, old, new, old):  # new calls, and calls that began before the reload
        with contextlib.suppress(AdmissionError):  # refused: the allowance is spent, as it should be
            ctl.admit(tenant, 50, 50)
            admitted += 1
    assert admitted == 0, f"{admitted} more minutes' worth of tokens admitted at the same instant"
