"""Open-loop arrival processes: when each request of a tenant is sent, precomputed from a seed.

Contract
- input: `ArrivalProcess(kind, rate_per_s, burstiness)` and a `random.Random`.
- output: `gaps(rng)` yields inter-arrival gaps in seconds forever; `schedule(...)` merges the
  streams of several tenants into one time-ordered, bounded list of `(time_s, tenant_index)`.
- kinds: `poisson` (exponential gaps = gamma with shape 1, coefficient of variation 1),
  `gamma` (shape = burstiness: < 1 burstier than Poisson, > 1 smoother; CV = 1/sqrt(shape)),
  `constant` (gap 1/rate, CV 0). Every kind has mean gap 1/rate. Closed-loop load has no
  arrival process (the runner keeps `concurrency` requests in flight).
- state: none; the same seed gives the same gaps (stdlib `random`, stable across platforms).
- failure modes: ValueError for an unknown kind, rate <= 0 or burstiness <= 0.
- proven by: tests/test_loadtest_arrivals.py (mean rate and CV within tolerance, reproducibility).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass

OPEN_LOOP_KINDS = ("poisson", "gamma", "constant")


@dataclass(frozen=True)
class ArrivalProcess:
    kind: str = "poisson"
    rate_per_s: float = 1.0
    burstiness: float = 1.0  # gamma shape; only used by kind "gamma"

    def __post_init__(self) -> None:
        if self.kind not in OPEN_LOOP_KINDS:
            raise ValueError(f"arrival kind must be one of {OPEN_LOOP_KINDS}, got {self.kind!r}")
        if not self.rate_per_s > 0:
            raise ValueError(f"arrival rate must be > 0 req/s, got {self.rate_per_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness (gamma shape) must be > 0, got {self.burstiness}")

    def gaps(self, rng: random.Random) -> Iterator[float]:
        mean_gap_s = 1.0 / self.rate_per_s
        if self.kind == "constant":
            while True:
                yield mean_gap_s
        shape = 1.0 if self.kind == "poisson" else self.burstiness
        while True:
            yield rng.gammavariate(shape, mean_gap_s / shape)


def arrival_times(process: ArrivalProcess, rng: random.Random) -> Iterator[float]:
    """Send times in seconds from the start of the run. The first request also waits one gap, so
    several tenants do not all fire at t=0."""
    t = 0.0
    for gap in process.gaps(rng):
        t += gap
        yield t


def _tagged(stream: Iterator[float], index: int) -> Iterator[tuple[float, int]]:
    for t in stream:
        yield t, index


def schedule(
    streams: list[Iterator[float]], warmup_s: float, duration_s: float | None, num_requests: int | None
) -> list[tuple[float, int]]:
    """Merges per-tenant send-time streams into `(time_s, stream_index)` in time order, up to
    `warmup_s + duration_s`, or until `num_requests` arrivals at or after `warmup_s` (warm-up
    arrivals do not count). At least one bound must be given; both = whichever comes first."""
    if duration_s is None and num_requests is None:
        raise ValueError("a schedule needs a duration or a request count")
    end_s = None if duration_s is None else warmup_s + duration_s
    merged = heapq.merge(*[_tagged(stream, i) for i, stream in enumerate(streams)])
    out: list[tuple[float, int]] = []
    num_measured = 0
    for t, i in merged:
        if end_s is not None and t >= end_s:
            break
        if num_requests is not None and num_measured >= num_requests:
            break
        out.append((t, i))
        num_measured += t >= warmup_s
    return out
