"""Per-worker circuit breaker: stop sending requests to a worker whose calls keep failing.

Contract
- input: `record_failure(reason, at_s)` for a call that failed on the worker's side (the stream
  broke, the worker answered INTERNAL / UNAVAILABLE, or it stopped answering) at `at_s` (now by
  default; the relay counts some failures only later, router/relay.py), `record_success()` for a
  call that produced a final message; the clock (time.monotonic by default).
- output: `allows()` -> whether the router may place a request on the worker now; `state` is
  "closed" (normal), "open" (no traffic until the cool-down ends) or "half_open" (cool-down over:
  traffic is allowed again, one more failure re-opens at once with twice the cool-down).
- rule: `failure_threshold` consecutive failures open the circuit for
  `min(base_cooldown_s * 2**trips, max_cooldown_s)`, where `trips` counts openings since the last
  success; a success closes it and resets both counters. Failures within `incident_s` (50 ms) of
  the last counted one are one incident and count once: one failed engine step fails every request
  in it at once, so one request that breaks a step would otherwise open a busy worker's circuit by
  itself. Health probes do not close it: a worker
  that passes health checks but fails every call stays out for the cool-down, so a broken worker
  costs at most one failed request per cool-down instead of one per probe period.
- state: consecutive failures, trips, when it opened, the last reason (one event loop, no locks).
- failure modes: none.
- proven by: tests/test_router_circuit.py (units), tests/test_faults.py (a worker that fails every
  call), tests/test_relay_races.py (a request that fails its workers).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        base_cooldown_s: float = 2.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        incident_s: float = 0.05,
    ):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not 0 < base_cooldown_s <= max_cooldown_s:
            raise ValueError("cool-downs must satisfy 0 < base_cooldown_s <= max_cooldown_s")
        self._threshold = failure_threshold
        self._base = base_cooldown_s
        self._max = max_cooldown_s
        self._clock = clock
        self._incident_s = incident_s
        self._counted_at: float | None = None  # when the last counted failure happened
        self.consecutive_failures = 0
        self.trips = 0  # openings since the last success
        self.opened_at: float | None = None
        self.cooldown_s = 0.0
        self.last_reason = ""

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if self._clock() - self.opened_at < self.cooldown_s else "half_open"

    def allows(self) -> bool:
        return self.state != "open"

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.trips = 0
        self.opened_at = None

    def record_failure(self, reason: str, at_s: float | None = None) -> bool:
        """Counts one failure (not when part of the last counted one's incident); returns True
        when this failure opened (or re-opened) the circuit."""
        self.last_reason = reason
        at_s = self._clock() if at_s is None else at_s
        if self._counted_at is not None and abs(at_s - self._counted_at) < self._incident_s:
            return False
        self._counted_at = at_s
        self.consecutive_failures += 1
        if self.state == "half_open" or (
            self.opened_at is None and self.consecutive_failures >= self._threshold
        ):
            self.cooldown_s = min(self._base * 2**self.trips, self._max)
            self.trips += 1
            self.opened_at = self._clock()
            return True
        return False
