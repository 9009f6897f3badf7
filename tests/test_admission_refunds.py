"""A tenant's tokens/min allowance (router/admission.py) over the real router pieces and scripted
workers (tests/router_harness.py): a request that never reached a worker (cancelled or past its
deadline in the queue) or that the service failed before any output gives its prompt's tokens
back; one a worker took and its client then left keeps them (only unused output is refunded).

The tenant allows 60 tokens a minute (1 a second, burst 60); each request asks 40 prompt + 4
output tokens, so a request that kept its prompt leaves 20 and one that gave it back leaves ~60."""

from __future__ import annotations

import asyncio
import time

import grpc

from router.errors import DeadlineExceeded, Unavailable
from router.tenants import Tenant
from tests.router_harness import Router, ScriptedWorker, request

PROMPT = list(range(1, 41))
TENANT = Tenant("t", max_priority=10, rate_tokens_per_min=60)


def tokens_left(router: Router) -> float:
    return router.admission._buckets[TENANT.name][1].level()


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def run_with(workers, scenario):
    async def main():
        router = await Router.create(workers, tenant=TENANT, poll_s=60)
        try:
            await scenario(router)
            state = router.state()
            assert not state["open"] and state["tokens_in_flight"] == 0 and not state["streams"]
        finally:
            await router.close()

    asyncio.run(main())


def test_a_request_cancelled_or_timed_out_in_the_queue_gives_its_prompt_back():
    worker = ScriptedWorker(max_num_seqs=1)
    worker.behavior = lambda req: [("sleep", 30)] if len(req.prompt_token_ids) == 1 else [("finish",)]

    async def scenario(router):
        busy = asyncio.ensure_future(router.generate(request(ids=[7], max_tokens=1)))  # 2 tokens
        await until(lambda: worker.open == 1, "the busy request never reached the worker")
        queued = asyncio.ensure_future(router.generate(request(ids=PROMPT)))
        await until(lambda: len(router.queue) == 1, "the second request was never queued")
        assert tokens_left(router) < 20  # 60 - 2 - 44 (+ refill)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        assert tokens_left(router) > 55  # all 44 back
        _, err = await router.generate(request(ids=PROMPT), timeout=0.3)  # waits, then times out
        assert isinstance(err, DeadlineExceeded), err
        assert tokens_left(router) > 55
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)

    run_with([worker], scenario)


def test_a_request_every_worker_failed_before_any_output_gives_its_prompt_back():
    a, b = ScriptedWorker(), ScriptedWorker()
    a.behavior = lambda req: [("abort", grpc.StatusCode.INTERNAL)]
    b.behavior = lambda req: [("abort", grpc.StatusCode.UNAVAILABLE)]

    async def scenario(router):
        out, err = await router.generate(request(ids=PROMPT))
        assert isinstance(err, Unavailable) and not out, err
        assert (a.calls, b.calls) == (1, 1)
        assert tokens_left(router) > 55

    run_with([a, b], scenario)


def test_a_request_a_worker_took_keeps_its_prompt_when_its_client_leaves():
    worker = ScriptedWorker()
    worker.behavior = lambda req: [("sleep", 30)]  # prefill work, no token yet

    async def scenario(router):
        call = asyncio.ensure_future(router.generate(request(ids=PROMPT)))
        await until(lambda: worker.open == 1, "the request never reached the worker")
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        left = tokens_left(router)
        assert 19 <= left < 30, left  # 60 - 44 + the 4 unused output tokens (+ refill)

    run_with([worker], scenario)
