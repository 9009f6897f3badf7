"""Token bucket: the per-tenant rate limits (requests/s, tokens/min).

Contract
- input: `TokenBucket(rate_per_s, burst, clock)`; `try_take(n)` / `wait_s(n)` / `give(n)` with n
  in the bucket's unit (requests or tokens).
- output: `resized(rate, burst)`: the bucket under new limits, its level carried over (at most the
  new burst). `try_take(n)` returns 0.0 and takes n when n are available, otherwise the seconds until
  n will be (nothing taken); `math.inf` when n exceeds the burst and so can never be available.
- state: the fill level and the clock reading it was computed at; the bucket starts full and
  refills continuously at `rate_per_s` up to `burst`.
- failure modes: rate <= 0, burst <= 0 or n < 0 -> ValueError. A clock that goes backwards is
  treated as no time passing.
- proven by: tests/test_fairness_admission.py (bucket arithmetic, retry-after == time to refill).
"""

from __future__ import annotations

import math
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float]):
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._level = burst
        self._at_s = clock()

    def level(self) -> float:
        """Tokens available now."""
        now = self._clock()
        if now > self._at_s:
            self._level = min(self.burst, self._level + (now - self._at_s) * self.rate_per_s)
            self._at_s = now
        return self._level

    def wait_s(self, n: float) -> float:
        """Seconds until `n` tokens are available (0.0 if they are now); takes nothing."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.burst:
            return math.inf
        missing = n - self.level()
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def try_take(self, n: float) -> float:
        wait = self.wait_s(n)
        if wait == 0.0:
            self._level -= n
        return wait

    def resized(self, rate_per_s: float, burst: float) -> "TokenBucket":
        """This bucket under new limits (a tenants-file reload): itself if they are the same, else a
        new one holding what this one holds now (at most the new burst), never a full one."""
        if (rate_per_s, burst) == (self.rate_per_s, self.burst):
            return self
        bucket = TokenBucket(rate_per_s, burst, self._clock)
        bucket._level = min(burst, self.level())
        return bucket

    def give(self, n: float) -> None:
        """Return unused tokens (e.g. the output a request did not generate), up to the burst."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._level = min(self.burst, self.level() + n)
