"""The dispatcher between the fair queue and the workers, against fake workers (no processes).

Room rule under test (router/dispatcher.py): a request of priority p needing n tokens fits a
worker when capacity - reserved(priority >= p) >= min(n, capacity) and it has a free sequence
slot (this router's requests on it < its max_num_seqs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from router.admission import AdmissionController, TenantLimits
from router.affinity import PrefixAffinity, prefix_hashes
from router.dispatcher import Dispatcher, Pending
from router.errors import Unavailable
from router.fair_queue import OUTPUT_COST, FairQueue

BLOCK_SIZE = 16


@dataclass
class FakeWorker:
    address: str
    num_blocks: int = 16  # 256 tokens
    healthy: bool = True
    outstanding_tokens: int = 0
    num_inflight: int = 0
    max_num_seqs: int = 0  # 0: no slot limit
    info: SimpleNamespace = field(init=False)

    def __post_init__(self):
        self.info = SimpleNamespace(model="m", block_size=BLOCK_SIZE, max_num_seqs=self.max_num_seqs)

    @property
    def load(self):
        return SimpleNamespace(num_total_blocks=self.num_blocks)


class FakeRegistry:
    def __init__(self, *workers: FakeWorker):
        self.workers = list(workers)

    def healthy(self, model=None):
        return [w for w in self.workers if w.healthy and (model is None or w.info.model == model)]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def setup(loop, *workers, threshold=0.25, grace_s=0.0, clock=None, replicas=1):
    queue = FairQueue()
    dispatcher = Dispatcher(
        queue,
        FakeRegistry(*workers),
        PrefixAffinity(),
        threshold,
        no_worker_grace_s=grace_s,
        clock=clock or (lambda: 0.0),
        replicas=replicas,
    )
    admission = AdmissionController(queue)

    def submit(tenant="a", prompt=32, max_tokens=32, priority=0, hashes=(), model="m"):
        pending = Pending(model, list(hashes), loop.create_future())
        ticket = admission.admit(TenantLimits(tenant), prompt, max_tokens, priority=priority, payload=pending)
        return pending, ticket

    return queue, dispatcher, submit


def test_requests_leave_the_queue_only_while_a_worker_has_room(loop):
    w = FakeWorker("w0")  # 256 tokens
    queue, dispatcher, submit = setup(loop, w)
    reqs = [submit(prompt=32, max_tokens=32) for _ in range(5)]  # 64 tokens each: 4 fit
    assert dispatcher.dispatch_ready() == 4
    assert [p.future.done() for p, _ in reqs] == [True] * 4 + [False]
    assert dispatcher.reserved_tokens("w0") == 256 and len(queue) == 1
    first = reqs[0][0].future.result()
    assert first.worker is w and w.outstanding_tokens == 256 and w.num_inflight == 4
    first.release()
    first.release()  # idempotent
    assert dispatcher.dispatch_ready() == 1 and reqs[4][0].future.done()
    for p, t in reqs:
        p.discard()  # gives back the placements no relay used
        t.release()
    assert dispatcher.reserved_tokens("w0") == 0 and w.outstanding_tokens == 0 and w.num_inflight == 0


def test_higher_priority_goes_to_a_worker_full_of_lower_priority_work(loop):
    w = FakeWorker("w0")
    queue, dispatcher, submit = setup(loop, w)
    low = [submit(tenant="bulk", prompt=64, max_tokens=64) for _ in range(2)]  # fills the 256 tokens
    assert dispatcher.dispatch_ready() == 2
    urgent = submit(tenant="chat", prompt=64, max_tokens=64, priority=5)
    urgent2 = submit(tenant="chat", prompt=64, max_tokens=64, priority=5)
    too_much = submit(tenant="chat", prompt=64, max_tokens=64, priority=5)
    assert dispatcher.dispatch_ready() == 2  # the two urgent ones: the worker preempts bulk for them
    assert urgent[0].future.done() and urgent2[0].future.done()
    assert not too_much[0].future.done()  # priority >= 5 work already fills the worker
    waiting_low = submit(tenant="bulk", prompt=16, max_tokens=16)
    assert dispatcher.dispatch_ready() == 0 and not waiting_low[0].future.done()
    assert dispatcher.reserved_tokens("w0", min_priority=5) == 256
    assert dispatcher.reserved_tokens("w0") == 512  # over-committed only by lower-priority work
    urgent[0].future.result().release()
    assert dispatcher.dispatch_ready() == 1 and too_much[0].future.done()
    assert len(queue) == 1 and len(low) == 2


def test_request_larger_than_a_worker_waits_for_it_to_empty(loop):
    w = FakeWorker("w0", num_blocks=4)  # 64 tokens
    _, dispatcher, submit = setup(loop, w)
    small, _ = submit(prompt=8, max_tokens=8)
    big, _ = submit(prompt=60, max_tokens=40)  # 100 > 64: needs the whole worker
    assert dispatcher.dispatch_ready() == 1
    small.future.result().release()
    assert dispatcher.dispatch_ready() == 1 and big.future.done()


def test_no_healthy_worker_fails_the_request_instead_of_blocking_the_queue(loop):
    w = FakeWorker("w0", healthy=False)
    queue, dispatcher, submit = setup(loop, w)
    pending, _ = submit()
    other_model, _ = submit(model="other")
    assert dispatcher.dispatch_ready() == 2 and len(queue) == 0
    for p in (pending, other_model):
        assert isinstance(p.future.exception(), Unavailable)


def test_queued_requests_wait_out_a_health_blip_before_failing(loop):
    now = [100.0]
    w = FakeWorker("w0", num_blocks=4)
    queue, dispatcher, submit = setup(loop, w, grace_s=5.0, clock=lambda: now[0])
    first, _ = submit(prompt=32, max_tokens=32)  # fills the worker
    waiting, _ = submit(prompt=32, max_tokens=32)
    assert dispatcher.dispatch_ready() == 1
    w.healthy = False  # a probe timed out
    now[0] += 3.0
    assert dispatcher.dispatch_ready() == 0 and not waiting.future.done()
    w.healthy = True  # back within the grace period; the clock restarts
    first.future.result().release()
    assert dispatcher.dispatch_ready() == 1 and waiting.future.result().worker is w
    late, _ = submit(prompt=32, max_tokens=32)
    w.healthy = False
    assert dispatcher.dispatch_ready() == 0
    now[0] += 5.0  # gone for the whole grace period: fail the backlog
    assert dispatcher.dispatch_ready() == 1 and isinstance(late.future.exception(), Unavailable)
    assert len(queue) == 0
    w.healthy = True
    dispatcher.dispatch_ready()  # nothing queued: the outage is still over
    now[0] += 100.0
    w.healthy = False
    again, _ = submit(prompt=8, max_tokens=8)
    assert dispatcher.dispatch_ready() == 0 and not again.future.done()  # a new grace period


def test_prefix_affinity_until_imbalanced(loop):
    a, b = FakeWorker("a", num_blocks=64), FakeWorker("b", num_blocks=64)  # 1024 tokens each
    _, dispatcher, submit = setup(loop, a, b, threshold=0.25)
    hashes = prefix_hashes(list(range(64)), "t")
    first, _ = submit(tenant="t", hashes=hashes, prompt=64, max_tokens=16)
    dispatcher.dispatch_ready()
    home = first.future.result().worker
    placed = []
    for _ in range(3):  # 80 tokens each: home's load grows 0.08 a time, within the threshold
        p, _ = submit(tenant="t", hashes=hashes, prompt=64, max_tokens=16)
        dispatcher.dispatch_ready()
        placed.append(p.future.result().worker)
    assert placed == [home] * 3
    filler, _ = submit(tenant="u", prompt=64, max_tokens=200)  # no prefix: goes to the idle worker
    dispatcher.dispatch_ready()
    assert filler.future.result().worker is not home
    for _ in range(2):
        p, _ = submit(tenant="t", hashes=hashes, prompt=64, max_tokens=16)
        dispatcher.dispatch_ready()
        placed.append(p.future.result().worker)
    assert placed[-1] is home
    big, _ = submit(tenant="u", prompt=16, max_tokens=0)
    heavy = [submit(tenant="v", prompt=64, max_tokens=200) for _ in range(2)]
    dispatcher.dispatch_ready()
    assert big and heavy
    # now home leads the other worker by more than 25% of its capacity: affinity yields
    loads = {w.address: w.outstanding_tokens / 1024 for w in (a, b)}
    p, _ = submit(tenant="t", hashes=hashes, prompt=64, max_tokens=16)
    dispatcher.dispatch_ready()
    if loads[home.address] - min(loads.values()) > 0.25:
        assert p.future.result().worker is not home
    else:
        assert p.future.result().worker is home


def test_output_is_charged_to_the_tenant_as_it_is_relayed(loop):
    queue, dispatcher, submit = setup(loop, FakeWorker("w0"))
    pending, ticket = submit(tenant="a", prompt=10, max_tokens=20)
    dispatcher.dispatch_ready()
    assert queue.counter("a") == 10  # input charged at dispatch
    placement = pending.future.result()
    placement.progress(3, first=True)
    placement.progress(2, first=False)
    assert queue.counter("a") == 10 + OUTPUT_COST * 5


def test_retry_skips_the_queue_and_excludes_tried_workers(loop):
    a, b = FakeWorker("a", num_blocks=4), FakeWorker("b", num_blocks=4)
    _, dispatcher, submit = setup(loop, a, b)
    fillers = [submit(prompt=32, max_tokens=32) for _ in range(2)]  # both workers full
    dispatcher.dispatch_ready()
    pending, ticket = submit(prompt=32, max_tokens=32)
    dispatcher.dispatch_ready()
    assert not pending.future.done()
    ticket.release()  # e.g. the first attempt's worker failed before a token; retry now:
    retry = dispatcher.place_retry(ticket.item, exclude=["a"])
    assert retry.worker is b and dispatcher.reserved_tokens("b") == 128
    assert dispatcher.place_retry(ticket.item, exclude=["a", "b"]) is None
    assert fillers


def test_run_loop_wakes_on_push_and_release():
    async def main():
        w = FakeWorker("w0", num_blocks=4)  # 64 tokens: one request at a time
        queue = FairQueue()
        dispatcher = Dispatcher(queue, FakeRegistry(w), recheck_s=60.0)
        admission = AdmissionController(queue)
        dispatcher.start()
        try:
            p1, p2 = Pending("m", []), Pending("m", [])
            admission.admit(TenantLimits("a"), 32, 32, payload=p1)
            admission.admit(TenantLimits("b"), 32, 32, payload=p2)
            placement = await asyncio.wait_for(p1.future, 5)
            await asyncio.sleep(0)
            assert not p2.future.done()
            placement.release()
            assert (await asyncio.wait_for(p2.future, 5)).worker is w
        finally:
            await dispatcher.stop()

    asyncio.run(main())


def test_a_worker_with_every_sequence_slot_taken_has_no_room(loop):
    w = FakeWorker("w0", max_num_seqs=2)  # KV room for 4 requests, slots for 2
    queue, dispatcher, submit = setup(loop, w)
    reqs = [submit(prompt=32, max_tokens=32) for _ in range(3)]
    assert dispatcher.dispatch_ready() == 2 and len(queue) == 1
    assert not dispatcher.can_start_now("m")
    reqs[0][0].future.result().release()
    assert dispatcher.can_start_now("m")
    assert dispatcher.dispatch_ready() == 1 and reqs[2][0].future.done()
    for p, t in reqs:
        p.discard()
        t.release()


def test_one_of_several_routers_uses_its_share_of_each_worker(loop):
    # Two routers share the worker: each may reserve half its KV room and half its sequence slots.
    w = FakeWorker("w0", num_blocks=16, max_num_seqs=3)  # 256 tokens, 3 slots -> 128 tokens, 2 slots
    queue, dispatcher, submit = setup(loop, w, replicas=2)
    assert dispatcher.capacity_tokens(w) == 128
    reqs = [submit(prompt=32, max_tokens=32) for _ in range(3)]  # 64 tokens each
    assert dispatcher.dispatch_ready() == 2 and len(queue) == 1  # 128 tokens and 2 slots: full
    assert dispatcher.reserved_tokens("w0") == 128
    reqs[0][0].future.result().release()
    assert dispatcher.dispatch_ready() == 1
    # A worker smaller than the share still takes work (one block), rather than none ever.
    assert dispatcher.capacity_tokens(FakeWorker("w1", num_blocks=1)) == BLOCK_SIZE
    for p, t in reqs:
        p.discard()
        t.release()
