"""Admission: every refusal reason, its retry-after, isolation between tenants, ticket release.

Fake clock throughout. Where retry-after depends on the measured dispatch rate, the queue's
meter gets a half-life so long that it does not decay, and a rate of exactly 1000 max_cost units
per second (10 requests of cost 100 that a pop found no room for, dispatched one second later).
"""

from __future__ import annotations

import math

import pytest

from router.admission import REASONS, AdmissionConfig, AdmissionController, AdmissionError, TenantLimits
from router.fair_queue import FairQueue, QueuedRequest
from router.rate_limit import TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def setup(config: AdmissionConfig = AdmissionConfig(), measured: bool = False):
    clock = FakeClock()
    queue = FairQueue(clock, meter_half_life_s=1e12)
    ctl = AdmissionController(queue, config, clock)
    if measured:  # 1000 units/s: 10 x (100 prompt + 0 output) in one backlogged second
        for _ in range(10):
            queue.push(QueuedRequest("warmup", 1.0, 100, 0))
        assert queue.pop_next(lambda _: False) is None  # no room: the meter counts only waiting
        clock.now_s += 1.0
        while queue.pop_next(lambda _: True):
            pass  # drain the warm-up requests
        assert queue.dispatch_rate() == pytest.approx(1000.0)
    return clock, queue, ctl


def refused(ctl: AdmissionController, tenant: TenantLimits, *args, **kwargs) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        ctl.admit(tenant, *args, **kwargs)
    return info.value


def test_token_bucket_takes_refills_and_reports_the_wait():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10.0, burst=5.0, clock=clock)
    assert bucket.try_take(5) == 0.0
    assert bucket.try_take(2) == pytest.approx(0.2)  # 2 missing at 10/s; nothing taken
    clock.now_s += 0.1
    assert bucket.try_take(2) == pytest.approx(0.1)
    clock.now_s += 0.1
    assert bucket.try_take(2) == 0.0
    assert bucket.try_take(6) == math.inf  # more than the burst: never
    clock.now_s += 100
    assert bucket.level() == 5.0  # capped at the burst
    bucket.try_take(5)
    bucket.give(3)
    assert bucket.level() == 3.0


def test_rate_limit_refuses_with_exact_retry_after_and_spares_other_tenants():
    clock, queue, ctl = setup()
    acme = TenantLimits("acme", rate_requests_per_s=2.0)  # burst 2
    beta = TenantLimits("beta")
    ctl.admit(acme, 10, 10)
    ctl.admit(acme, 10, 10)
    err = refused(ctl, acme, 10, 10)
    assert (err.reason, err.retry_after_ms) == ("rate_limited", 500)
    for _ in range(20):
        ctl.admit(beta, 10, 10)  # unaffected
    clock.now_s += 0.25
    assert refused(ctl, acme, 10, 10).retry_after_ms == 250
    clock.now_s += 0.25
    ctl.admit(acme, 10, 10)
    assert ctl.refusals == {("acme", "rate_limited"): 2}
    assert ctl.admitted == {"acme": 3, "beta": 20}


def test_tokens_per_minute_counts_prompt_plus_max_tokens_and_refunds_unused_output():
    clock, queue, ctl = setup()
    acme = TenantLimits("acme", rate_tokens_per_min=600)  # 10 tokens/s, burst 600
    t1 = ctl.admit(acme, 300, 200)
    err = refused(ctl, acme, 100, 100)  # 100 left, 200 needed: 100 tokens at 10/s
    assert (err.reason, err.retry_after_ms) == ("rate_limited", 10_000)
    t1.release(num_output_tokens=50)  # 150 of the 200 max_tokens were not generated
    ctl.admit(acme, 100, 100)
    err = refused(ctl, acme, 400, 300)  # more than one minute's worth: never admissible
    assert err.reason == "rate_limited" and err.retry_after_ms == 60_000
    assert "600 tokens per minute" in err.message


def test_a_request_refused_after_admission_takes_no_tokens_per_minute():
    """--no-queue: admitted, then refused because no worker has room: its prompt + max_tokens go
    back (it took the tenant's allowance before, so retrying as told drained it)."""
    clock, queue, ctl = setup()
    acme = TenantLimits("acme", rate_tokens_per_min=600)
    for _ in range(10):  # 10 x 200 tokens refused: far more than the 600 a minute
        ticket = ctl.admit(acme, 100, 100)
        ticket.refused()
        assert ctl.num_open("acme") == 0 and ctl.tokens_in_flight == 0
    ctl.admit(acme, 300, 300)  # the whole minute's allowance is still there


def test_tenant_queue_cap_and_concurrency_cap():
    clock, queue, ctl = setup()
    acme = TenantLimits("acme", max_queued=2, max_concurrency=3)
    beta = TenantLimits("beta")
    tickets = [ctl.admit(acme, 10, 10) for _ in range(2)]
    err = refused(ctl, acme, 10, 10)
    assert err.reason == "tenant_queue_full" and err.retry_after_ms == 1000  # no rate measured yet
    ctl.admit(beta, 10, 10)  # unaffected
    assert queue.pop_next(lambda it: it.tenant == "acme") is tickets[0].item  # now running
    ctl.admit(acme, 10, 10)  # 2 queued + 1 running = 3 open
    assert refused(ctl, acme, 10, 10).reason == "concurrency"
    tickets[0].release(num_output_tokens=10)  # finished: 2 open, both queued
    assert refused(ctl, acme, 10, 10).reason == "tenant_queue_full"
    queue.pop_next(lambda it: it.tenant == "acme")
    ctl.admit(acme, 10, 10)
    assert ctl.num_open("acme") == 3 and queue.num_queued("acme") == 2
    assert ctl.refusals == {("acme", "tenant_queue_full"): 2, ("acme", "concurrency"): 1}


def test_capacity_retry_after_follows_the_measured_rate_and_the_tenants_share():
    clock, queue, ctl = setup(measured=True)
    acme = TenantLimits("acme", max_queued=1)
    ctl.admit(acme, 100, 0)
    err = refused(ctl, acme, 100, 0)  # one request of cost 100 at acme's share (all of 1000/s)
    assert (err.reason, err.retry_after_ms) == ("tenant_queue_full", 100)
    ctl.admit(TenantLimits("beta", weight=3.0), 100, 0)  # acme's share drops to 1/4
    assert refused(ctl, acme, 100, 0).retry_after_ms == 400


def test_global_queue_cap_refuses_every_tenant():
    clock, queue, ctl = setup(AdmissionConfig(max_queued_total=3), measured=True)
    for name in "abc":
        ctl.admit(TenantLimits(name), 100, 50)
    err = refused(ctl, TenantLimits("d"), 100, 50)  # d has nothing queued and is still refused
    assert (err.reason, err.retry_after_ms) == ("global_queue_full", 200)  # cost 200 at 1000/s
    queue.pop_next(lambda _: True)
    ctl.admit(TenantLimits("d"), 100, 50)


def test_token_budget_and_ticket_release_return_the_budget():
    clock, queue, ctl = setup(AdmissionConfig(max_tokens_in_flight=1000), measured=True)
    acme = TenantLimits("acme")
    t1 = ctl.admit(acme, 300, 300)
    assert ctl.tokens_in_flight == 600
    err = refused(ctl, acme, 250, 250)  # 1100 > 1000: 100 tokens (~150 cost units) must finish
    assert (err.reason, err.retry_after_ms) == ("token_budget", 150)
    assert queue.pop_next(lambda _: True) is t1.item
    t1.release()
    t1.release()  # idempotent
    assert ctl.tokens_in_flight == 0 and ctl.num_open("acme") == 0
    t2 = ctl.admit(acme, 250, 250)
    t2.release()  # still queued: release is also the cancellation
    assert len(queue) == 0 and ctl.tokens_in_flight == 0
    ctl.set_token_budget(400)
    err = refused(ctl, acme, 250, 250)  # bigger than the whole budget
    assert err.reason == "token_budget" and err.retry_after_ms == 60_000
    ctl.set_token_budget(None)
    ctl.admit(acme, 5000, 5000)


def test_deadline_refused_early_from_the_estimated_wait():
    clock, queue, ctl = setup(measured=True)
    heavy, light = TenantLimits("heavy"), TenantLimits("light")
    for _ in range(5):
        ctl.admit(heavy, 100, 0)  # 500 units ahead of heavy's next request: 0.5 s at 1000/s
    err = refused(ctl, heavy, 100, 0, deadline_s=clock.now_s + 0.3)
    assert (err.reason, err.retry_after_ms) == ("deadline", 200)
    ctl.admit(heavy, 100, 0, deadline_s=clock.now_s + 0.6)
    # light's counter is lifted to heavy's; under fair sharing nothing of heavy's is ahead of it
    ctl.admit(light, 100, 0, deadline_s=clock.now_s + 0.05)
    # light's next request: its own 100 ahead, and heavy is served as much meanwhile
    assert queue.estimated_wait_s("light", 1.0) == pytest.approx(0.2)
    assert refused(ctl, light, 100, 0, deadline_s=clock.now_s).reason == "deadline"
    assert ctl.refusals == {("heavy", "deadline"): 1, ("light", "deadline"): 1}


def test_deadline_admits_when_no_rate_was_measured_and_priority_jumps_the_tenants_queue():
    clock, queue, ctl = setup()
    acme = TenantLimits("acme")
    for _ in range(50):
        ctl.admit(acme, 100, 100, deadline_s=clock.now_s + 0.001)  # no estimate yet: optimistic
    clock2, queue2, ctl2 = setup(measured=True)
    for _ in range(5):
        ctl2.admit(acme, 100, 0)
    assert queue2.estimated_wait_s("acme", 1.0, priority=0) == pytest.approx(0.5)
    assert queue2.estimated_wait_s("acme", 1.0, priority=1) == 0.0
    ctl2.admit(acme, 100, 0, priority=1, deadline_s=clock2.now_s + 0.01)


def test_refusal_takes_nothing_and_reasons_are_metric_labels():
    clock, queue, ctl = setup(AdmissionConfig(max_tokens_in_flight=100))
    acme = TenantLimits("acme", rate_requests_per_s=1.0)
    assert refused(ctl, acme, 100, 100).reason == "token_budget"
    ctl.admit(acme, 50, 50)  # the refused request did not spend the rate limit
    assert set(REASONS) == {
        "tenant_queue_full",
        "global_queue_full",
        "rate_limited",
        "token_budget",
        "deadline",
        "concurrency",
        "no_capacity",
    }
    assert all(r.isidentifier() and r.islower() for r in REASONS)
    queue.check_integrity()


def test_default_priority_comes_from_the_tenant():
    clock, queue, ctl = setup()
    urgent = TenantLimits("acme", default_priority=5)
    ticket = ctl.admit(urgent, 1, 1)
    assert ticket.item.priority == 5
    assert ctl.admit(urgent, 1, 1, priority=0).item.priority == 0


def test_precheck_refuses_on_caps_before_tokenizing_and_counts_like_admit():
    clock, queue, ctl = setup(AdmissionConfig(max_queued_total=1))
    acme = TenantLimits("acme", max_concurrency=5)
    ctl.precheck(acme, 10)  # room: nothing raised, nothing taken
    ctl.admit(acme, 5, 5)
    with pytest.raises(AdmissionError) as err:
        ctl.precheck(acme, 10)
    assert err.value.reason == "global_queue_full" and err.value.retry_after_ms >= 1
    assert ctl.refusals[("acme", "global_queue_full")] == 1 and ctl.num_open("acme") == 1
    no_room = ctl.refuse(acme, "no_capacity", 10, "busy")
    assert no_room.reason == "no_capacity" and ctl.refusals[("acme", "no_capacity")] == 1
