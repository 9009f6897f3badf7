"""Sends one sweep point's request stream through a client and collects a record per request.

Contract
- input: `RunConfig` (bounds, warm-up, client cap, drain timeout), the point's tenants, one
  `Workload` per tenant, a client (`send(spec, record, request_id, api_key, priority)`), a `Clock`.
- output: `list[RequestRecord]`, in send order, warm-up ones flagged.
- open loop: one task sends the merged, precomputed schedule of every open-loop tenant on time
  (a request whose time has passed goes at once; the lag shows as client wait), each request in
  its own task; `max_concurrency` caps requests in flight, the wait counted as client wait.
  closed loop: `concurrency` tasks per tenant, each sending its next request when the last ends.
  A request is warm-up when it was scheduled (open) or sent (closed) before `warmup_s`.
- bounds: sending stops at `warmup_s + duration_s` or after `num_requests` measured requests
  (over all tenants); requests in flight then get `drain_timeout_s`, after which they are
  cancelled and recorded as `CLIENT_DRAIN_TIMEOUT`. The run always ends by itself.
- progress: a live bar with sent / done / failed / in flight / output tokens per second.
"""

from __future__ import annotations

import asyncio
import random
import time

from loadtest.arrivals import ArrivalProcess, arrival_times, schedule
from loadtest.config import RunConfig, TenantSpec
from loadtest.progress import ProgressBar
from loadtest.record import NS_PER_S, RequestRecord
from loadtest.workload import Workload


class Clock:
    """`perf_counter_ns` from a resettable origin: every record of a point shares it."""

    def __init__(self) -> None:
        self.origin_ns = time.perf_counter_ns()

    def reset(self) -> None:
        self.origin_ns = time.perf_counter_ns()

    def now_ns(self) -> int:
        return time.perf_counter_ns() - self.origin_ns

    def now_s(self) -> float:
        return self.now_ns() / NS_PER_S


def open_loop_plan(
    open_tenants: list[TenantSpec], point_seed: str, config: RunConfig
) -> list[tuple[float, int]]:
    """`(send time s, index into open_tenants)` for every open-loop request of a point."""
    streams = [
        arrival_times(
            ArrivalProcess(t.arrival, t.rate_per_s, t.burstiness),
            random.Random(f"{point_seed}:{t.name}:arrivals"),
        )
        for t in open_tenants
    ]
    return schedule(streams, config.warmup_s, config.duration_s, config.num_requests)


class PointRun:
    def __init__(
        self,
        config: RunConfig,
        tenants: tuple[TenantSpec, ...],
        workloads: dict[str, Workload],
        client,
        clock: Clock,
        point_seed: str,
        request_prefix: str,
        label: str,
    ):
        self.config = config
        self.tenants = {t.name: t for t in tenants}
        self.workloads = workloads
        self.client = client
        self.clock = clock
        self.point_seed = point_seed
        self.request_prefix = request_prefix
        self.records: list[RequestRecord] = []
        self._tasks: set[asyncio.Task] = set()
        self._num_measured = 0
        self._num_in_flight = 0
        self._budget_spent = asyncio.Event()
        self._cap = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        bounded_by_count = config.num_requests is not None
        total = config.num_requests if bounded_by_count else config.warmup_s + config.duration_s
        self._bar = ProgressBar(label, total, "req" if bounded_by_count else "s", enabled=config.progress)

    @property
    def end_s(self) -> float | None:
        d = self.config.duration_s
        return None if d is None else self.config.warmup_s + d

    def _take_budget(self, warmup: bool) -> bool:
        """Counts a measured request; False once `num_requests` have been sent."""
        if warmup:
            return True
        limit = self.config.num_requests
        if limit is not None and self._num_measured >= limit:
            return False
        self._num_measured += 1
        if limit is not None and self._num_measured >= limit:
            self._budget_spent.set()
        return True

    async def _one(self, tenant: TenantSpec, scheduled_ns: int, warmup: bool) -> None:
        spec = self.workloads[tenant.name].next()
        record = RequestRecord(
            tenant.name,
            spec.index,
            warmup,
            scheduled_ns,
            input_len=len(spec.prompt_ids) if spec.prompt_ids is not None else None,
        )
        self.records.append(record)
        request_id = f"{self.request_prefix}-{tenant.name}-{spec.index}"
        self._num_in_flight += 1
        try:
            if self._cap is None:
                await self.client.send(spec, record, request_id, tenant.api_key, tenant.priority)
            else:
                async with self._cap:
                    await self.client.send(spec, record, request_id, tenant.api_key, tenant.priority)
        except asyncio.CancelledError:
            record.end_ns = self.clock.now_ns()
            record.sent_ns = record.sent_ns or record.end_ns
            record.status, record.error = "CLIENT_DRAIN_TIMEOUT", "still running when the drain timeout ended"
            raise
        finally:
            self._num_in_flight -= 1

    async def _open_loop(self, open_tenants: list[TenantSpec]) -> None:
        plan = open_loop_plan(open_tenants, self.point_seed, self.config)
        for t_s, i in plan:
            delay_s = t_s - self.clock.now_s()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            warmup = t_s < self.config.warmup_s
            if not self._take_budget(warmup):
                return
            task = asyncio.create_task(self._one(open_tenants[i], int(t_s * NS_PER_S), warmup))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _closed_loop(self, tenant: TenantSpec) -> None:
        while True:
            now_s = self.clock.now_s()
            if self.end_s is not None and now_s >= self.end_s:
                return
            warmup = now_s < self.config.warmup_s
            if not self._take_budget(warmup):
                return
            await self._one(tenant, self.clock.now_ns(), warmup)

    async def _sending_over(self, open_sender: asyncio.Task | None, has_closed: bool) -> None:
        if open_sender is not None:
            await open_sender
        if not has_closed:
            return
        waits = [asyncio.create_task(self._budget_spent.wait())]
        if self.end_s is not None:
            waits.append(asyncio.create_task(asyncio.sleep(max(0.0, self.end_s - self.clock.now_s()))))
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    async def _show_progress(self) -> None:
        while True:
            done = [r for r in self.records if r.end_ns]
            failed = sum(not r.ok for r in done)
            elapsed_s = max(1e-9, self.clock.now_s())
            tokens = sum(r.num_client_tokens for r in self.records)
            if self.config.num_requests is not None:
                progress = sum(not r.warmup for r in done)
            else:
                progress = elapsed_s
            self._bar.update(
                progress,
                f"sent {len(self.records)} done {len(done)} failed {failed} "
                f"in flight {self._num_in_flight} out {tokens / elapsed_s:.1f} tok/s",
            )
            await asyncio.sleep(0.25)

    async def run(self) -> list[RequestRecord]:
        self.clock.reset()
        open_tenants = [t for t in self.tenants.values() if not t.closed_loop]
        closed = [t for t in self.tenants.values() if t.closed_loop]
        ticker = asyncio.create_task(self._show_progress())
        sender = asyncio.create_task(self._open_loop(open_tenants)) if open_tenants else None
        workers = [asyncio.create_task(self._closed_loop(t)) for t in closed for _ in range(t.concurrency)]
        try:
            await self._sending_over(sender, bool(closed))
            pending = set(workers) | set(self._tasks)
            if pending:
                _, late = await asyncio.wait(pending, timeout=self.config.drain_timeout_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            failed = sum(not r.ok for r in self.records)
            self._bar.close(f"{len(self.records)} requests, {failed} failed, {self.clock.now_s():.1f} s")
        return self.records
