"""Request bodies decoded off the event loop: a small pool of processes, bounded per tenant.

Contract
- input: `DecodePool.run(tenant, size, fn, *args)`: `fn(*args)` decodes and checks one request body
  of `size` bytes (HTTP: JSON -> the parsed request, router/openai/http.py; gRPC: the protobuf's
  counts, `message_problem` below). `fn` and its arguments and result must pickle.
- output: `fn(*args)`'s result, or its exception re-raised (it must pickle too). A body of at most
  `inline_bytes` is decoded at once on the caller's thread (a few ms at most); a larger one in a
  process of the pool: the C decoders of `json` and protobuf hold the GIL for their whole run, so
  a thread would stall the event loop as much (a 13 MB body of a million `logit_bias` entries:
  ~1 s of json.loads, ~0.3 s of protobuf parse), and a check in a process returns only what
  passed its bounds (compact to send back).
- bounds: one body of a tenant at a time in the pool, `max_waiting` waiting in all (then
  `Busy`: 503); the pool starts on the first large body, or at `warm()` (the router's start-up:
  a spawn and its imports are ~1 s of CPU, which a request should not wait for); a process is replaced after
  `recycle_after` bodies (the memory a 13 MB decode leaves behind goes with it) or when it dies
  (`Busy` for the bodies it held).
- state: the pool and per-tenant semaphores. Proven by: tests/test_request_path.py (a huge
  body over HTTP and over gRPC keeps the event loop on time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import threading
from collections.abc import Callable

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.validation import count_bounds

log = logging.getLogger(__name__)


class Busy(Exception):
    """The pool cannot take the body now: too many are waiting, or its process died."""


class DecodePool:
    def __init__(
        self,
        inline_bytes: int = 256 * 1024,
        processes: int = 2,
        max_waiting: int = 16,
        recycle_after: int = 64,
    ):
        self.inline_bytes, self._processes, self._recycle = inline_bytes, processes, recycle_after
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._per_tenant: dict[str, list] = {}  # tenant -> [its semaphore, bodies using it]
        self._waiting, self._max_waiting = 0, max_waiting
        self.offloaded = 0  # bodies decoded in the pool (tests)

    async def run(self, tenant: str, size: int, fn: Callable, *args):
        if size <= self.inline_bytes:
            return fn(*args)
        if self._waiting >= self._max_waiting:
            raise Busy("too many large request bodies are being decoded; retry")
        self._waiting += 1
        gate = self._per_tenant.setdefault(tenant, [asyncio.Semaphore(1), 0])
        gate[1] += 1
        try:
            async with gate[0]:
                self.offloaded += 1
                return await self._submit(fn, args)
        finally:
            self._waiting -= 1
            gate[1] -= 1
            if gate[1] == 0:  # forget idle tenants
                self._per_tenant.pop(tenant, None)

    def warm(self) -> None:
        """Starts a decoder process now, on a thread, so the first large body does not wait for one
        (a spawn and its imports: ~1 s of a CPU the router shares)."""
        pool = self._executor()
        threading.Thread(target=pool.submit, args=(int,), name="decode-pool-warm", daemon=True).start()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._processes,
                mp_context=multiprocessing.get_context("spawn"),
                max_tasks_per_child=self._recycle,
            )
        return self._pool

    async def _submit(self, fn: Callable, args: tuple):
        pool = self._executor()
        try:
            # submitted from a thread: a submit may start a process (a spawn: ~10-50 ms), not on the loop
            loop = asyncio.get_running_loop()
            return await asyncio.wrap_future(await loop.run_in_executor(None, pool.submit, fn, *args))
        except concurrent.futures.process.BrokenProcessPool:
            if self._pool is pool:  # a decoder died (killed, out of memory): a new pool next time
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            log.error("a request-body decoder process died")
            raise Busy("the request body could not be decoded; retry") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def message_problem(raw: bytes, limits: Limits) -> tuple[str, str] | None:
    """A serialized `GenerateRequest`'s counts against the validator's bounds, before the router's
    event loop parses it: (field, problem) for the first count over its bound, else None (also
    for bytes that do not parse: the service's own parse reports those)."""
    try:
        req = pb.GenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - any parse failure is reported by the caller's parse
        return None
    for field, _, bound, what in count_bounds(limits):
        message, name = field.split(".")
        count = len(getattr(getattr(req, message), name))
        if count > bound:
            return field, f"at most {bound} {what}, got {count}"
    return None
