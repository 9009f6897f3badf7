"""The statistics of a run, as pure functions of numbers (no I/O, no clock).

Contract
- `percentile(values, q)`: linear interpolation between closest ranks (numpy's default method):
  rank = q/100 * (n - 1). The repo's one percentile definition: the load tester, the benchmarks,
  the soaks and the tests all call it. `summarize(values)` -> `Summary` (n, mean, population std,
  min, p50, p90, p95, p99, p99.9, max) or None for no values.
- `parse_slo("ttft=500ms,tpot=50ms")` -> {"ttft": 0.5, "tpot": 0.05} (seconds; units us/ms/s, a
  bare number is ms). `meets_slo(record, slo)`: the request succeeded and met every bound; a TPOT
  bound is met by a request with <= 1 output token (TPOT undefined), an `itl` bound is on the
  request's largest gap. Goodput = requests meeting the SLOs / duration.
- `jain_index(xs)` = (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one gets everything;
  None when nothing was served.
- `peak_per_bucket(times_ns, amounts, bucket_s)` and `peak_concurrency(intervals)`.
- proven by: tests/test_loadtest_stats.py (hand-computed values).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p95: float
    p99: float
    p999: float
    max: float

    def to_json(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, by linear interpolation between the two
    closest ranks: sort the values, rank = q/100 * (n - 1), and return
    ordered[floor(rank)] + (ordered[floor(rank) + 1] - ordered[floor(rank)]) * frac(rank).
    This is numpy's default (`np.percentile(values, q)`, method "linear", Hyndman & Fan type 7);
    p50 equals `statistics.median`. One value: that value. Raises ValueError for no values or a
    q outside [0, 100].

    >>> percentile([15, 20, 35, 40, 50], 40)  # rank 1.6: 20 + 0.6 * (35 - 20)
    29.0
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> Summary | None:
    if not values:
        return None
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return Summary(
        n, mean, std, min(values), *(percentile(values, q) for q in (50, 90, 95, 99, 99.9)), max(values)
    )


def jain_index(xs: Sequence[float]) -> float | None:
    total, squares = sum(xs), sum(x * x for x in xs)
    if not xs or squares == 0:
        return None
    return total * total / (len(xs) * squares)


def parse_duration_s(text: str) -> float:
    text = text.strip()
    for unit in ("us", "ms", "s"):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * _UNITS_S[unit]
    return float(text) * _UNITS_S["ms"]


def parse_slo(text: str) -> dict[str, float]:
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO {part!r}: expected one of {SLO_METRICS} = a duration, e.g. ttft=500ms")
        slo[name] = parse_duration_s(value)
        if slo[name] <= 0:
            raise ValueError(f"SLO {part!r}: must be > 0")
    return slo


def meets_slo(record, slo: dict[str, float]) -> bool:
    """`record` is a `RequestRecord` (duck-typed: ok, ttft_s, tpot_s, itl_s, e2e_s)."""
    if not record.ok:
        return False
    checks = {
        "ttft": lambda: record.ttft_s is not None and record.ttft_s <= slo["ttft"],
        "tpot": lambda: record.tpot_s is None or record.tpot_s <= slo["tpot"],
        "itl": lambda: max(record.itl_s, default=0.0) <= slo["itl"],
        "e2e": lambda: record.e2e_s <= slo["e2e"],
    }
    return all(checks[name]() for name in slo)


def peak_per_bucket(times_ns: Sequence[int], amounts: Sequence[float], bucket_s: float = 1.0) -> float:
    """The largest total of `amounts` falling in one `bucket_s`-wide bucket, divided by
    `bucket_s` (e.g. peak output tokens/s over 1-second buckets)."""
    buckets: Counter[int] = Counter()
    for t, amount in zip(times_ns, amounts):
        buckets[int(t // (bucket_s * 1e9))] += amount
    return max(buckets.values(), default=0) / bucket_s


def peak_concurrency(intervals: Sequence[tuple[int, int]]) -> int:
    """Most intervals [start, end) open at once."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak
