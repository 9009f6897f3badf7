"""Tokenizing off the event loop, in a bounded pool.

Contract
- input: `run(fn, *args)` from the router's event loop (fn: a tokenizer call; common.tokenizer
  releases the GIL while it encodes, so the loop keeps serving health checks and streams).
- output: fn's result, or fn's exception; `Overloaded` (RESOURCE_EXHAUSTED, retry-after) at once
  when `threads + max_waiting` calls are already in the pool, so a flood of huge prompts never
  queues without bound.
- metrics: `llm_router_tokenize_calls_total` (prompts tokenized or begun) on `registry`.
- state: the executor's threads and the count of calls in the pool. A call whose caller went away
  (cancelled) still counts until its thread finishes, so cancelling does not let more work in.
- proven by: tests/test_trust_admission.py (the huge-prompt flood).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import Counter

from router.errors import Overloaded

T = TypeVar("T")


class TokenizePool:
    # 2 threads: tokenizing is CPU work the router shares with its event loop. max_waiting bounds
    # memory, not latency: a burst of hundreds of ordinary prompts (milliseconds each) must fit;
    # floods are bounded earlier, by each tenant's request rate and concurrency (router.admission).
    def __init__(self, threads: int = 2, max_waiting: int = 1024, retry_after_ms: int = 500, registry=None):
        if threads < 1 or max_waiting < 0:
            raise ValueError("a tokenize pool needs threads >= 1 and max_waiting >= 0")
        self._calls = Counter(
            "llm_router_tokenize_calls",
            "Prompts the router tokenized (or began to): work spent before admission",
            registry=registry,
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._capacity = threads + max_waiting
        self._retry_after_ms = retry_after_ms
        self.in_pool = 0

    async def run(self, fn: Callable[..., T], *args) -> T:
        if self.in_pool >= self._capacity:
            raise Overloaded(
                f"the router is tokenizing {self.in_pool} requests already; retry later", self._retry_after_ms
            )
        loop = asyncio.get_running_loop()
        self.in_pool += 1
        self._calls.inc()
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda _: self._done_soon(loop))
        return await asyncio.wrap_future(future)

    def _done_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._done)
        except RuntimeError:  # the loop closed (shutdown): nothing counts any more
            return

    def _done(self) -> None:
        self.in_pool -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
