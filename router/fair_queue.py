"""Per-tenant fair queue: the weighted virtual token counter (VTC, Sheng et al., OSDI'24).

Contract
- input: `push(item)` for an admitted `QueuedRequest`; `pop_next(can_dispatch)` whenever a worker
  may have room; `charge_output(tenant, n)` as a dispatched request's tokens are generated;
  `remove(item)` when a queued request is cancelled; `notify()` when worker capacity changes.
- output: `pop_next` returns the head (highest priority, then oldest) of the active tenant with the
  smallest counter whose head `can_dispatch` accepts, or None; `mode="fcfs"` orders heads by
  (priority, arrival) instead, for comparison. `estimated_wait_s` predicts queue wait (admission).
- state: per tenant a counter (its service: input tokens x 1 + output tokens x 2, divided by its
  weight; input charged at dispatch, output as generated) and a heap of queued items. A tenant
  that becomes active (its queue was empty) is lifted to the smallest counter of the active
  tenants (or, with none, to the counter of the tenant served last), so idleness banks no credit.
  With `hold_for_blocked`, a tenant whose head does not fit holds back tenants that lead it by more
  than that head's cost, so large requests cannot starve behind a stream of small ones, except a
  head of higher priority than the blocked one (the room rule lets it onto a worker full of lower
  priority work, room the blocked head could not use).
  A removed (cancelled) item leaves its heap lazily: at the top, or when the removed entries pass
  2 x the tenant's queued items + 16 (the heap is rebuilt); per-priority sums of queued cost feed
  the wait estimate, so neither memory nor admission time grows with cancellations.
  The dispatch meter (wait estimate, retry-after) counts, from a `pop_next` that finds no room
  until the queue drains, the cost of the requests that waited for room: the fleet's drain rate.
- failure modes: pushing an item twice or with weight <= 0 -> ValueError; charging an unknown
  tenant -> KeyError. The queue never refuses: caps are admission's job (router/admission.py).
  With `hold_for_blocked`, an item no worker can ever take must be removed by its owner, or it
  blocks the tenants that overtake it by more than its cost.
- proven by: tests/test_fairness_vtc.py (service gap within the bound of docs/fairness.md, 2:1
  weights, also with Poisson arrivals and capped per-tenant queues while both tenants stay
  backlogged, no banked credit, work conservation, no starvation); `check_integrity()`;
  `make bench-fairness` end to end (docs/fairness.md: within 10% of the weights at 3x and 6x load);
  tests/test_fair_queue_meter.py (the meter reads the drain rate, not arrivals);
  tests/test_fair_queue_compaction.py (cancellations do not accumulate in a backlogged heap).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

INPUT_COST = 1
OUTPUT_COST = 2


@dataclass(eq=False)
class QueuedRequest:
    tenant: str
    weight: float
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0  # higher first, within the tenant
    payload: Any = None  # the router's handle (e.g. a future)
    arrival_s: float = field(default=0.0, init=False)  # set by push
    seq: int = field(default=-1, init=False)  # arrival order, set by push
    queued: bool = field(default=False, init=False)
    refused: bool = field(default=False, init=False)  # a pop_next found no room for it (the meter)

    @property
    def max_cost(self) -> int:
        """VTC cost if all max_tokens are generated, before dividing by the weight."""
        return INPUT_COST * self.num_prompt_tokens + OUTPUT_COST * self.max_tokens


@dataclass
class _Tenant:
    weight: float
    counter: float = 0.0
    heap: list[tuple[int, int, QueuedRequest]] = field(default_factory=list)
    num_queued: int = 0
    queued_cost: int = 0
    # priority -> [queued items, their max_cost]: the wait estimate reads the work ahead from
    # here, not from the heap, whose removed entries leave it only lazily
    by_priority: dict[int, list[int]] = field(default_factory=dict)
    num_dead: int = 0  # removed items still in the heap

    def head(self) -> QueuedRequest:
        while not self.heap[0][2].queued:  # removed items leave the heap lazily
            heapq.heappop(self.heap)
            self.num_dead -= 1
        return self.heap[0][2]

    def count(self, item: QueuedRequest, sign: int) -> None:
        self.num_queued += sign
        self.queued_cost += sign * item.max_cost
        entry = self.by_priority.setdefault(item.priority, [0, 0])
        entry[0] += sign
        entry[1] += sign * item.max_cost
        if entry[0] == 0:
            del self.by_priority[item.priority]

    def cost_at_or_above(self, priority: int) -> int:
        return sum(cost for p, (_, cost) in self.by_priority.items() if p >= priority)

    def compact(self) -> None:
        """Drops removed entries once they outnumber twice the live ones (plus slack, so that a short
        queue does not rebuild on every cancel): a tenant that stays backlogged with something
        ahead of its cancelled requests would otherwise keep them, payloads and all, for as long
        as it stays backlogged. Amortized O(1) per removal."""
        if self.num_dead > 2 * self.num_queued + 16:
            self.heap = [entry for entry in self.heap if entry[2].queued]
            heapq.heapify(self.heap)
            self.num_dead = 0


class DispatchMeter:
    """Dispatch throughput (max_cost units per second) while requests wait, decayed by half-life.

    The queue says what counts (FairQueue: from a pop that found no room until the queue drains,
    and only requests that waited for room): when nothing waits for room, the dispatch rate
    measures arrivals, not how fast the fleet drains a backlog.
    """

    def __init__(self, clock: Callable[[], float], half_life_s: float):
        self._clock = clock
        self._tau_s = half_life_s / math.log(2)
        self._units = 0.0
        self._busy_s = 0.0
        self._at_s = clock()

    def advance(self, backlogged: bool) -> None:
        now = self._clock()
        dt = now - self._at_s
        if dt <= 0:
            return
        lost = -math.expm1(-dt / self._tau_s)  # the decayed fraction, precise for small dt
        self._units -= self._units * lost
        self._busy_s += (self._tau_s * lost if backlogged else 0.0) - self._busy_s * lost
        self._at_s = now

    def record(self, units: float) -> None:
        self._units += units

    def rate(self) -> float | None:
        """Units per second; None before any waiting request was dispatched."""
        if self._units == 0.0:
            return None
        return self._units / self._busy_s if self._busy_s > 0 else math.inf


class FairQueue:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        mode: Literal["vtc", "fcfs"] = "vtc",
        hold_for_blocked: bool = True,
        meter_half_life_s: float = 10.0,
    ):
        if mode not in ("vtc", "fcfs"):
            raise ValueError(f"mode must be 'vtc' or 'fcfs', got {mode!r}")
        self.mode = mode
        self.hold_for_blocked = hold_for_blocked and mode == "vtc"
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._next_seq = 0
        self._num_queued = 0
        self._last_served: str | None = None
        self._meter = DispatchMeter(clock, meter_half_life_s)
        # Meter state. A request "waited" when a pop_next found no room for it: it was refused
        # as a head, or queued (seq below this mark) when a pop returned None. A request that
        # goes straight to a worker also queues, for the microseconds until the dispatcher task
        # runs; counting it put its whole cost against almost no time (rate inflated 10-20x).
        self._waited_below = 0
        # Backlogged from a pop that found no room until the queue drains: the fleet, not the
        # arrivals, sets the dispatch rate then, and this is the time the meter divides by.
        self._backlogged = False
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return self._num_queued

    def num_queued(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.num_queued if t else 0

    def counter(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return t.counter if t else 0.0

    def counters(self) -> dict[str, float]:
        return {name: t.counter for name, t in self._tenants.items()}

    def push(self, item: QueuedRequest) -> None:
        if item.queued:
            raise ValueError("request is already queued")
        if not item.weight > 0:
            raise ValueError(f"tenant {item.tenant}: weight must be > 0, got {item.weight}")
        self._meter.advance(self._backlogged)
        t = self._tenants.get(item.tenant)
        if t is None:
            t = self._tenants[item.tenant] = _Tenant(item.weight)
        t.weight = item.weight
        if t.num_queued == 0:  # becoming active: no credit for the time spent idle
            t.counter = max(t.counter, self._floor())
        item.seq, item.arrival_s, item.queued, item.refused = self._next_seq, self._clock(), True, False
        self._next_seq += 1
        heapq.heappush(t.heap, (-item.priority, item.seq, item))
        t.count(item, +1)
        self._num_queued += 1
        self.notify()

    def pop_next(self, can_dispatch: Callable[[QueuedRequest], bool]) -> QueuedRequest | None:
        """Dispatch one request: the first head, in fairness order, that `can_dispatch` accepts."""
        self._meter.advance(self._backlogged)
        # (priority, counter) per blocked head: a later tenant at or past the counter is held back,
        # unless its head outranks that blocked head (room the worker frees for higher priority
        # by preemption is not room the blocked head could have used)
        barriers: list[tuple[int, float]] = []
        for name, t in sorted(self._active(), key=self._order_key):
            head = t.head()
            if any(head.priority <= p and t.counter >= b for p, b in barriers):
                continue
            if can_dispatch(head):
                self._take(name, t, head)
                return head
            head.refused = self._backlogged = True
            if self.hold_for_blocked:
                barriers.append((head.priority, t.counter + head.max_cost / t.weight))
        if self._num_queued:  # every queued request now waits for room
            self._waited_below = self._next_seq
        return None

    def charge_output(self, tenant: str, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        t = self._tenants[tenant]
        t.counter += OUTPUT_COST * num_tokens / t.weight

    def remove(self, item: QueuedRequest) -> bool:
        """Take a still-queued request out (cancellation); False if it had already left."""
        if not item.queued:
            return False
        self._meter.advance(self._backlogged)
        t = self._tenants[item.tenant]
        item.queued = False
        t.num_dead += 1  # its heap entry stays until it reaches the top or the heap is compacted
        self._forget(t, item)
        self.notify()
        return True

    def notify(self) -> None:
        """Something the dispatcher waits on changed: a push, a removal, worker capacity."""
        self._changed.set()

    async def wait_for_change(self) -> None:
        """The dispatcher's loop: `pop_next` until None, then await this; no polling, no lost wake-up
        (a change between the last `pop_next` and this call leaves the event set)."""
        await self._changed.wait()
        self._changed.clear()

    def dispatch_rate(self) -> float | None:
        """Recent dispatch throughput while backlogged, in max_cost units per second."""
        self._meter.advance(self._backlogged)
        return self._meter.rate()

    def active_weight(self) -> float:
        """Sum of the weights of the tenants with queued requests."""
        return sum(t.weight for _, t in self._active())

    def estimated_wait_s(self, tenant: str, weight: float, priority: int = 0) -> float | None:
        """Predicted wait of a request pushed now; None when no throughput was measured yet.

        Fluid (GPS) approximation of VTC with no further arrivals: the request leaves when its
        tenant's counter has covered the work queued ahead of it in its own queue; by then every
        other tenant v has been served up to that counter value, min(its backlog, w_v x gap).
        The total work divided by the measured dispatch rate is the wait. fcfs: all work ahead.
        """
        if self._num_queued == 0:
            return 0.0
        rate = self.dispatch_rate()
        if rate is None:
            return None
        own = self._tenants.get(tenant)
        ahead = own.cost_at_or_above(priority) if own else 0
        if self.mode == "fcfs":
            return sum(t.cost_at_or_above(priority) for _, t in self._active()) / rate
        start = own.counter if own and own.num_queued else max(own.counter if own else 0.0, self._floor())
        target = start + ahead / weight
        work = ahead + sum(
            min(t.queued_cost, t.weight * max(0.0, target - t.counter))
            for name, t in self._active()
            if name != tenant
        )
        return work / rate

    def check_integrity(self) -> None:
        total = 0
        for name, t in self._tenants.items():
            live = [i for _, _, i in t.heap if i.queued]
            assert len(live) == t.num_queued, f"{name}: {len(live)} live items, count says {t.num_queued}"
            assert sum(i.max_cost for i in live) == t.queued_cost, f"{name}: queued cost drifted"
            by_priority: dict[int, list[int]] = {}
            for i in live:
                entry = by_priority.setdefault(i.priority, [0, 0])
                entry[0] += 1
                entry[1] += i.max_cost
            assert by_priority == t.by_priority, f"{name}: per-priority sums drifted"
            assert len(t.heap) - len(live) == t.num_dead, f"{name}: dead entry count drifted"
            assert all(i.tenant == name for i in live), f"{name}: holds another tenant's item"
            total += t.num_queued
        assert total == self._num_queued, f"{total} queued items, count says {self._num_queued}"

    def _active(self) -> list[tuple[str, _Tenant]]:
        return [(name, t) for name, t in self._tenants.items() if t.num_queued]

    def _order_key(self, entry: tuple[str, _Tenant]) -> tuple[float, int]:
        t = entry[1]
        head = t.head()
        if self.mode == "fcfs":
            return (-head.priority, head.seq)
        return (t.counter, head.seq)

    def _floor(self) -> float:
        active = [t.counter for _, t in self._active()]
        if active:
            return min(active)
        return self._tenants[self._last_served].counter if self._last_served else 0.0

    def _take(self, name: str, t: _Tenant, item: QueuedRequest) -> None:
        popped = heapq.heappop(t.heap)[2]
        assert popped is item, "dispatched item must be its tenant's head"
        item.queued = False
        self._forget(t, item)
        t.counter += INPUT_COST * item.num_prompt_tokens / t.weight
        self._last_served = name
        if item.refused or item.seq < self._waited_below:
            self._meter.record(item.max_cost)

    def _forget(self, t: _Tenant, item: QueuedRequest) -> None:
        t.count(item, -1)
        self._num_queued -= 1
        if t.num_queued == 0:
            t.heap.clear()
            t.num_dead = 0
        t.compact()  # here, not only in remove: a dispatch lowers the live count the bound follows
        if self._num_queued == 0 and self._backlogged:
            self._meter.advance(True)
            self._backlogged = False  # drained: the time until the next backlog is not service time
