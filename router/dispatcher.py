"""Dispatcher: moves admitted requests from the fair queue to workers, only when one has room.

Contract
- input: `QueuedRequest`s in the `FairQueue` whose payload is a `Pending` (model, prefix hashes,
  a future); the registry's healthy workers, their KV capacity from the load reports
  (`num_total_blocks x block_size` tokens) and this router's reservations on them.
- output: a popped request's future gets a `Placement` (worker + lease + reservation), or
  `Unavailable` when its model has had no healthy worker for `no_worker_grace_s` (a health-probe
  blip does not fail the backlog, and nothing waits for a worker that is gone);
  `place_retry` gives a retry its next worker at once (retries skip the queue).
- room rule: a request of priority p needing n = prompt + max_tokens tokens fits worker w when
      capacity(w) - reserved(w, priority >= p)  >=  min(n, capacity(w))
  where capacity(w) is this router's share of w's KV tokens (1/`replicas` of its blocks when
  several routers share the workers; sequence slots likewise, rounded up)
  and w has a free sequence slot (this router's requests on it < its reported max_num_seqs, so
  requests wait in the router's queue, where admission sees them, not in the worker's), where
  `reserved` sums prompt + max_tokens of this router's open requests on w. Reservations of
  lower priority do not count: the worker's scheduler preempts its lowest-priority running
  sequences (by recompute) when a higher-priority one needs their KV blocks, so a high-priority
  request leaves the router at once for a worker busy with lower-priority work, while requests of
  equal or higher priority never over-commit a worker. A request larger than a worker's whole
  capacity needs that worker empty (of its priority and above), so it cannot wait forever.
- choice among the workers with room: prefix affinity (`PrefixAffinity`, load = outstanding
  tokens / capacity, yielding beyond `imbalance_threshold`), ties to least outstanding tokens.
- wake-ups: the queue's event (push, removal, ticket release, placement release); while requests
  wait, also every `recheck_s`, which covers capacity the registry finds (a worker that comes
  back, a first load report) without a hook into the registry.
- state: per worker the reserved tokens by priority; the affinity map; the balancer's rotation.
- context: a worker takes only requests whose prompt + max_tokens fit its own max_model_len; a
  request that fits no healthy worker of its model fails INVALID_ARGUMENT (never INTERNAL).
- failure modes: a bug while placing one request fails that request (logged), not the loop; a
  failure of the loop itself (`_supervise`) fails the requests queued then with UNAVAILABLE and
  restarts it (`restarts` counts), with a growing pause when it keeps failing.
- proven by: tests/test_fairness_dispatch.py (fake workers), tests/test_fairness_e2e.py,
  tests/test_trust_units.py (supervision), tests/test_trust_limits.py (heterogeneous contexts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from router.affinity import PrefixAffinity
from router.balancer import Lease, LeastOutstandingTokens
from router.errors import DeadlineExceeded, Unavailable, context_exceeded
from router.fair_queue import FairQueue, QueuedRequest
from router.registry import WorkerHandle, WorkerRegistry

log = logging.getLogger(__name__)


def _context_holds(worker: WorkerHandle, item: QueuedRequest) -> bool:
    """The worker's context holds the request's prompt + max_tokens (workers of one model may run
    different --max-model-len or KV sizes, hence contexts)."""
    limit = getattr(worker.info, "max_model_len", 0)  # 0: not reported (yet)
    return not limit or item.num_prompt_tokens + item.max_tokens <= limit


def _new_future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class Pending:
    """The router's handle on a queued request (the `QueuedRequest.payload`)."""

    model: str
    prefix_hashes: list[bytes]
    future: asyncio.Future = field(default_factory=_new_future)  # -> Placement

    def discard(self) -> None:
        """The call ended: stop waiting, or give back a placement the relay never used."""
        if not self.future.done():
            self.future.cancel()
        elif not self.future.cancelled() and self.future.exception() is None:
            self.future.result().release()


class Placement:
    """One request on one worker: the balancer lease, the KV reservation, output charging."""

    def __init__(self, dispatcher: Dispatcher, worker: WorkerHandle, item: QueuedRequest):
        self.worker = worker
        self._dispatcher = dispatcher
        self._tenant = item.tenant
        self._priority = item.priority
        self._num_tokens = item.num_prompt_tokens + item.max_tokens
        self._lease = Lease(worker, item.num_prompt_tokens, item.max_tokens)
        self._released = False
        dispatcher._reserved.setdefault(worker.address, Counter())[self._priority] += self._num_tokens

    def progress(self, num_new_tokens: int, first: bool) -> None:
        self._lease.progress(num_new_tokens, first)
        self._dispatcher.queue.charge_output(self._tenant, num_new_tokens)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._lease.release()
        reserved = self._dispatcher._reserved[self.worker.address]
        reserved[self._priority] -= self._num_tokens
        if not reserved[self._priority]:
            del reserved[self._priority]
        self._dispatcher.queue.notify()  # room freed


class Dispatcher:
    def __init__(
        self,
        queue: FairQueue,
        registry: WorkerRegistry,
        affinity: PrefixAffinity | None = None,
        imbalance_threshold: float = 0.25,
        recheck_s: float = 1.0,
        no_worker_grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        replicas: int = 1,
    ):
        self.queue = queue
        self._replicas = replicas  # routers sharing the workers: this one uses 1/replicas of each
        self._registry = registry
        self._affinity = affinity or PrefixAffinity()
        self._imbalance = imbalance_threshold
        self._recheck_s = recheck_s
        self._no_worker_grace_s = no_worker_grace_s
        self._clock = clock
        self._no_worker_since: dict[str, float] = {}  # model -> when its last healthy worker went
        self._balancer = LeastOutstandingTokens()
        self._reserved: dict[str, Counter[int]] = {}
        self._task: asyncio.Task | None = None
        self.restarts = 0  # times the dispatcher loop failed and was restarted

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="dispatcher")

    async def _supervise(self) -> None:
        """`run`, restarted when it fails: the requests queued at the time fail with UNAVAILABLE
        (the client may retry at once) instead of waiting for a loop that is gone."""
        backoff_s = 0.01
        while True:
            try:
                await self.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - logged; the loop restarts
                self.restarts += 1
                log.exception(
                    "dispatcher loop failed (restart %d): failing the queued requests", self.restarts
                )
                self._fail_queued(Unavailable("the router's dispatcher failed; retry the request"))
                await asyncio.sleep(backoff_s)  # a fault that repeats does not spin
                backoff_s = min(1.0, backoff_s * 2)

    def _fail_queued(self, error: Exception) -> None:
        try:
            while (item := self.queue.pop_next(lambda _item: True)) is not None:
                if not item.payload.future.done():
                    item.payload.future.set_exception(error)
        except Exception:  # noqa: BLE001 - the queue itself is broken: callers' deadlines end them
            log.exception("could not fail the queued requests")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            self.dispatch_ready()
            if len(self.queue):
                try:  # asyncio.timeout: 3.11's wait_for can drop stop()'s cancellation (gh-86296)
                    async with asyncio.timeout(self._recheck_s):
                        await self.queue.wait_for_change()
                except TimeoutError:
                    pass  # the periodic recheck: capacity may have appeared without a queue event
            else:
                await self.queue.wait_for_change()

    def dispatch_ready(self) -> int:
        """Places queued requests, in the queue's order, while some worker has room; returns how many."""
        for model in [m for m in self._no_worker_since if self._registry.healthy(m)]:
            del self._no_worker_since[model]  # back, even if nothing was queued for it meanwhile
        n = 0
        while (item := self.queue.pop_next(self._has_room)) is not None:
            try:
                self._place(item)
            except Exception as exc:  # noqa: BLE001 - one request fails, the dispatcher goes on
                log.exception("placing a request failed")
                if not item.payload.future.done():
                    item.payload.future.set_exception(exc)
            n += 1
        return n

    async def wait_placed(self, pending: Pending, deadline_s: float | None, now_s: float) -> Placement:
        """Waits in the queue until dispatched; `DeadlineExceeded` when the deadline passes first."""
        timeout = None if deadline_s is None else max(0.0, deadline_s - now_s)
        try:  # asyncio.timeout: 3.11's wait_for drops a cancellation that comes with the placement
            async with asyncio.timeout(timeout):
                return await pending.future
        except TimeoutError:
            raise DeadlineExceeded("deadline passed while the request waited in the router's queue") from None

    def place_retry(self, item: QueuedRequest, exclude: Collection[str]) -> Placement | None:
        """Another worker for a request whose worker failed before its first token, room or not
        (but a context that holds it)."""
        workers = [w for w in self._registry.healthy(item.payload.model) if _context_holds(w, item)]
        worker = self._balancer.choose(workers, exclude=exclude)
        return None if worker is None else Placement(self, worker, item)

    def reserved_tokens(self, address: str, min_priority: int | None = None) -> int:
        reserved = dict(self._reserved.get(address, ()))  # one atomic copy: /metrics reads it from a thread
        return sum(n for p, n in reserved.items() if min_priority is None or p >= min_priority)

    def has_free_slot(self, worker: WorkerHandle) -> bool:
        """Fewer of this router's requests on the worker than its share of the sequences the worker
        runs at once (max_num_seqs / replicas, rounded up)."""
        slots = worker.info.max_num_seqs if worker.info is not None else 0
        return not slots or worker.num_inflight < -(-slots // self._replicas)

    def can_start_now(self, model: str) -> bool:
        """Some healthy worker of `model` has a free sequence slot (KV room is checked at placement)."""
        return any(
            self.has_free_slot(w) and self.capacity_tokens(w) > 0 for w in self._registry.healthy(model)
        )

    def capacity_tokens(self, worker: WorkerHandle) -> int:
        """This router's share of the worker's KV capacity, in tokens (whole blocks)."""
        if worker.load is None or worker.info is None or worker.load.num_total_blocks <= 0:
            return 0
        return max(1, worker.load.num_total_blocks // self._replicas) * worker.info.block_size

    def _fits(self, worker: WorkerHandle, item: QueuedRequest) -> bool:
        capacity = self.capacity_tokens(worker)
        if capacity <= 0 or not self.has_free_slot(worker) or not _context_holds(worker, item):
            return False
        need = min(item.num_prompt_tokens + item.max_tokens, capacity)
        return capacity - self.reserved_tokens(worker.address, item.priority) >= need

    def _has_room(self, item: QueuedRequest) -> bool:
        model = item.payload.model
        workers = self._registry.healthy(model)
        if workers:
            # none whose context holds it: let it out, so that `_place` fails it (it would never fit)
            return any(self._fits(w, item) for w in workers) or not any(
                _context_holds(w, item) for w in workers
            )
        # none for a while: let it out, so that `_place` fails it instead of it blocking the queue
        since = self._no_worker_since.setdefault(model, self._clock())
        return self._clock() - since >= self._no_worker_grace_s

    def _place(self, item: QueuedRequest) -> None:
        pending: Pending = item.payload
        if pending.future.done():  # its call already ended
            return
        healthy = self._registry.healthy(pending.model)
        workers = [w for w in healthy if self._fits(w, item)]
        if not workers:
            largest = max((getattr(w.info, "max_model_len", 0) for w in healthy), default=0)
            need = item.num_prompt_tokens + item.max_tokens
            error = (
                # the largest context a worker of this model holds (a worker may hold less than the model)
                context_exceeded("stopping.max_tokens", largest, item.num_prompt_tokens, item.max_tokens)
                if healthy and largest and need > largest
                else Unavailable(f"no healthy worker for model {pending.model!r}")
            )
            pending.future.set_exception(error)
            return
        first = self._balancer.choose(workers)  # listed first: affinity's ties go to it
        by_address = {w.address: w for w in [first, *workers]}
        loads = {a: w.outstanding_tokens / self.capacity_tokens(w) for a, w in by_address.items()}
        chosen = self._affinity.choose(loads, pending.prefix_hashes, self._imbalance)
        pending.future.set_result(Placement(self, by_address[chosen], item))
