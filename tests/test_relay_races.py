"""The relay (router/relay.py) at its edges, with the real router pieces over scripted workers
(tests/router_harness.py): a client's cancellation in the turn the registry declares its worker
down is the client's (no retry for a client that left); a call whose reader stops at the finish
(the embeddings front) still counts as a success for the worker's circuit breaker; a worker whose
channel closed after the request was placed is a worker lost before its first token (retried); a
request that fails its workers with INTERNAL is tried on two and opens no circuit; one failed
engine step counts once against its worker."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
import pytest

from protos.llm.v1 import worker_pb2 as wpb
from router.errors import RequestFailed
from router.observe import RequestObservation
from router.openai.embeddings import _embed_one
from tests.router_harness import Ctx, Router, ScriptedWorker, request, tokens


def test_a_client_cancel_in_the_turn_its_worker_goes_down_is_not_retried():
    async def main():
        a, b = ScriptedWorker(), ScriptedWorker()
        router = await Router.create([a, b], poll_s=60)
        try:
            a.behavior = lambda req: [("sleep", 30)]
            b.behavior = lambda req: [("tok", 1)] * 4 + [("finish",)]
            handle_a, handle_b = router.handles()
            handle_b.outstanding_tokens += 10_000  # the first attempt goes to a
            call = asyncio.ensure_future(router.generate(request()))
            deadline = time.monotonic() + 10
            # until a's stream is open on both ends: a stream tracked by the router may not have
            # reached the worker yet (a CI run cancelled it first: a.calls was 0)
            while not (handle_a.streams and a.open == 1):
                assert time.monotonic() < deadline, "the request never reached worker a"
                await asyncio.sleep(0.01)
            handle_b.outstanding_tokens -= 10_000
            for stream in list(handle_a.streams):
                stream.cancel_down("worker declared down (probe)")  # the registry, in the same turn
            call.cancel()  # ... as the client's cancel
            with pytest.raises(asyncio.CancelledError):
                await call
            assert (a.calls, b.calls) == (1, 0)  # not retried on b for a client that left
            state = router.state()
            assert not state["open"] and state["tokens_in_flight"] == 0 and not state["streams"]
        finally:
            await router.close()

    asyncio.run(main())


def test_a_call_read_only_to_its_finish_counts_as_a_success():
    """The embeddings front returns at the Finished event and closes the call: the relay's success
    report came after it, so it never ran, and sporadic failures between embeddings added up to an
    open circuit."""

    async def main():
        worker = ScriptedWorker()

        async def embedding(request, context):
            worker.calls += 1
            yield wpb.WorkerResponse(
                token_ids=[5],
                embedding=[0.6, 0.8],
                finished=wpb.WorkerFinished(reason=wpb.WORKER_FINISH_REASON_LENGTH),
            )

        worker.Generate = embedding
        router = await Router.create([worker], poll_s=60)
        try:
            [handle] = router.registry.all()
            for _ in range(2):
                router.registry.call_failed(handle, "sporadic failure")

            async def observed(req):  # as router/openai/app.py reads a call
                obs = RequestObservation(None, ())
                try:
                    async with aclosing(router.service.generate(req, Ctx(), obs)) as events:
                        async for response in events:
                            yield getattr(response, response.WhichOneof("kind"))
                finally:
                    obs.finish()

            req = request(max_tokens=1)
            req.sampling.pooling = 1
            for _ in range(3):
                vector, _ = await _embed_one(observed(req), 0)
                assert vector == pytest.approx([0.6, 0.8])
            assert handle.breaker.consecutive_failures == 0
            router.registry.call_failed(handle, "one more")
            assert router.registry.healthy()  # one failure after successes: the circuit stays closed
        finally:
            await router.close()

    asyncio.run(main())


def test_a_worker_whose_channel_closed_after_placement_is_retried_elsewhere():
    """A worker that leaves discovery (the Ray registry's refresh closes its channel) between the
    request's placement and its call: creating the call raises UsageError, which reached the
    client as INTERNAL; it is a worker lost before its first token, retried on another."""

    async def main():
        a, b = ScriptedWorker(), ScriptedWorker()
        router = await Router.create([a, b], poll_s=60)
        try:
            handle_a, handle_b = router.handles()
            handle_b.outstanding_tokens += 10_000  # the first attempt goes to a
            await handle_a.channel.close()  # gone from discovery, still in this placement's view
            out, err = await router.generate(request())
            handle_b.outstanding_tokens -= 10_000
            assert err is None, err
            assert sum(len(r.chunk.token_ids) for r in out if r.HasField("chunk")) == 4
            assert (a.calls, b.calls) == (0, 1)
        finally:
            await router.close()

    asyncio.run(main())


def test_a_request_that_fails_its_workers_is_tried_on_two_and_opens_no_circuit():
    """Input that breaks the engine fails each worker it reaches with INTERNAL. It was retried on
    every worker, each failure counting against that worker's circuit: a few such requests in a
    row opened every circuit. Now it stops after two workers (INTERNAL to the client), and a
    failure counts only once another worker served the same request."""

    async def main():
        workers = [ScriptedWorker() for _ in range(3)]
        for w in workers:
            w.behavior = lambda req: [("abort", grpc.StatusCode.INTERNAL)]
        router = await Router.create(workers, poll_s=60)
        try:
            for _ in range(4):
                out, err = await router.generate(request())
                assert isinstance(err, RequestFailed) and err.code == grpc.StatusCode.INTERNAL, err
                assert "failed on 2 workers" in err.message and not out
            assert sum(w.calls for w in workers) == 8  # two workers per request, never the third
            assert all(h.breaker.consecutive_failures == 0 for h in router.handles())
            assert len(router.registry.healthy()) == 3
            workers[2].behavior = lambda req: [("tok", 1)] * 4 + [("finish",)]
            handles = router.handles()
            handles[1].outstanding_tokens += 20_000  # tried on 0 first, then on 2 (served), never 1
            handles[2].outstanding_tokens += 10_000
            before = [w.calls for w in workers]
            out, err = await router.generate(request())
            assert err is None and len(tokens(out)) == 4, err
            assert [w.calls - n for w, n in zip(workers, before)] == [1, 0, 1]
            counted = [h.breaker.consecutive_failures for h in handles]
            assert counted == [1, 0, 0], counted  # the worker that failed it, once another served it
        finally:
            await router.close()

    asyncio.run(main())


def test_one_failed_step_counts_once_against_its_worker():
    """A failed engine step fails every request in it at once (INTERNAL each): one incident for
    the circuit breaker, not one failure per request (which opened a busy worker's circuit)."""

    async def main():
        a, b = ScriptedWorker(), ScriptedWorker()
        step_failed = asyncio.Event()

        async def failing_step(request, context):
            a.calls += 1
            a.open += 1
            try:
                await step_failed.wait()
                await context.abort(grpc.StatusCode.INTERNAL, "engine step failed: RuntimeError")
            finally:
                a.open -= 1
            yield wpb.WorkerResponse()  # unreachable; makes this an async generator

        a.Generate = failing_step
        router = await Router.create([a, b], poll_s=60)
        try:
            handle_a, handle_b = router.handles()
            handle_b.outstanding_tokens += 10_000  # every first attempt goes to a
            calls = [asyncio.ensure_future(router.generate(request())) for _ in range(4)]
            deadline = time.monotonic() + 10
            while a.open < 4:
                assert time.monotonic() < deadline, f"{a.open} of 4 requests reached worker a"
                await asyncio.sleep(0.01)
            handle_b.outstanding_tokens -= 10_000
            step_failed.set()
            for out, err in await asyncio.gather(*calls):
                assert err is None and len(tokens(out)) == 4, err  # retried on b, served
            assert handle_a.breaker.consecutive_failures == 1 and handle_a.breaker.state == "closed"
        finally:
            await router.close()

    asyncio.run(main())
