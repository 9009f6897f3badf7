"""Graceful drain: count in-flight calls, refuse new ones once draining, wait for the rest.

Contract
- input: `enter()` / `exit()` around every call; `drain(grace_s)` once, on SIGTERM.
- output: `enter()` raises `Unavailable` while draining; `drain` returns True when every in-flight
  call finished within the grace period, False when the grace period ran out.
- state: the in-flight count and an idle event (one event loop, no locks).
- proven by: tests/test_grpc_e2e.py (SIGTERM drain).
"""

from __future__ import annotations

import asyncio

from router.errors import Unavailable


class Drain:
    def __init__(self) -> None:
        self.num_inflight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        if self.draining:
            raise Unavailable("router is shutting down; retry on another router")
        self.num_inflight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.num_inflight -= 1
        assert self.num_inflight >= 0
        if self.num_inflight == 0:
            self._idle.set()

    async def drain(self, grace_s: float) -> bool:
        self.draining = True
        try:
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
            return True
        except asyncio.TimeoutError:
            return False
