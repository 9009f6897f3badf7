"""Load-test statistics against values computed by hand: percentiles, per-request metrics,
goodput, Jain's fairness index, throughput peaks and the per-point summary."""

import math
import random
import statistics

import pytest

from loadtest.config import TenantSpec
from loadtest.record import RequestRecord
from loadtest.stats import (
    jain_index,
    meets_slo,
    parse_slo,
    peak_concurrency,
    peak_per_bucket,
    percentile,
    summarize,
)
from loadtest.summary import summarize_point

MS = 1_000_000  # ns


def record(
    tenant="a", sent_ms=0, chunks_ms=(), tokens=None, end_ms=None, status="OK", warmup=False, prompt_tokens=10
):
    """A finished request; the server's usage (OK only) matches the chunks' tokens."""
    tokens = list(tokens or [1] * len(chunks_ms))
    if end_ms is None:
        end_ms = chunks_ms[-1] if chunks_ms else sent_ms
    ok = status == "OK"
    return RequestRecord(
        tenant=tenant,
        index=0,
        warmup=warmup,
        scheduled_ns=sent_ms * MS,
        sent_ns=sent_ms * MS,
        end_ns=end_ms * MS,
        chunk_ns=[t * MS for t in chunks_ms],
        chunk_tokens=tokens,
        status=status,
        prompt_tokens=prompt_tokens if ok else None,
        completion_tokens=sum(tokens) if ok else None,
    )


def test_percentile_interpolates_between_closest_ranks():
    values = [4, 1, 3, 2]  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 0) == 1
    assert percentile(values, 50) == 2.5  # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7 -> 3 + 0.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 100) == 4
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentile_method_is_pinned_on_a_known_sample():
    """The one percentile definition (benchmarks, soaks and tests call it too) is linear
    interpolation between closest ranks, numpy's default, Hyndman & Fan type 7. Pinned by hand on
    a known sample, so a switch to nearest rank or another method fails here."""
    sample = [50, 15, 40, 20, 35]  # sorted: 15 20 35 40 50, ranks 0..4
    expected = {0: 15, 10: 17, 25: 20, 40: 29, 50: 35, 75: 40, 90: 46, 99: 49.6, 100: 50}
    for q, value in expected.items():  # rank = q/100 * 4; 40 -> 1.6: 20 + 0.6 * 15
        assert percentile(sample, q) == pytest.approx(value), q
    assert percentile(sample, 50) == statistics.median(sample)
    assert percentile([1, 2, 3, 4], 50) == statistics.median([1, 2, 3, 4]) == 2.5
    with pytest.raises(ValueError):
        percentile(sample, 101)
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 16, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 37.5, 50, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12), (n, q)


def test_summary_fields():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert (s.n, s.mean, s.min, s.max, s.p50) == (4, 2.5, 1.0, 4.0, 2.5)
    assert s.std == pytest.approx(math.sqrt(1.25))  # population std: mean of squared deviations
    assert s.p95 == pytest.approx(3.85) and s.p999 == pytest.approx(3.997)
    assert summarize([]) is None


def test_jain_index_hand_values():
    assert jain_index([5, 5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25  # one tenant gets everything: 1/n
    assert jain_index([1, 2, 3]) == pytest.approx(36 / 42)  # (1+2+3)^2 / (3 * (1+4+9))
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_per_request_metrics():
    # sent at 0; chunks at 100 (2 tokens), 150 (1), 250 (1) ms; 4 output tokens
    r = record(chunks_ms=(100, 150, 250), tokens=[2, 1, 1])
    assert r.ttft_s == pytest.approx(0.1)
    assert r.itl_s == pytest.approx([0.05, 0.1])  # one gap per chunk pair, whatever its size
    assert r.e2e_s == pytest.approx(0.25)
    assert r.tpot_s == pytest.approx((0.25 - 0.1) / 3)  # (E2E - TTFT) / (4 - 1)
    assert record(chunks_ms=(100,)).tpot_s is None  # undefined for one output token
    assert record(status="UNAVAILABLE").ttft_s is None


def test_parse_slo_units():
    assert parse_slo("ttft=500ms,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo("e2e=2s, itl=300") == {"e2e": 2.0, "itl": 0.3}  # a bare number is ms
    assert parse_slo("ttft=1500us") == {"ttft": pytest.approx(0.0015)}
    assert parse_slo("") == {}
    for bad in ("latency=1s", "ttft", "ttft=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_meets_slo():
    slo = {"ttft": 0.2, "tpot": 0.06}
    assert meets_slo(record(chunks_ms=(100, 150, 200)), slo)  # TTFT 100, TPOT 50
    assert not meets_slo(record(chunks_ms=(300, 350)), slo)  # TTFT 300
    assert not meets_slo(record(chunks_ms=(100, 200, 300)), slo)  # TPOT 100
    assert meets_slo(record(chunks_ms=(100,)), slo)  # TPOT undefined: met
    assert not meets_slo(record(status="DEADLINE_EXCEEDED"), {"e2e": 10.0})
    assert not meets_slo(record(chunks_ms=(10, 20, 500)), {"itl": 0.4})  # largest gap 480 ms


def test_peaks():
    # tokens at 0.1 s (3), 0.9 s (2), 1.2 s (4): buckets [0, 1) = 5, [1, 2) = 4
    assert peak_per_bucket([100 * MS, 900 * MS, 1200 * MS], [3, 2, 4]) == 5
    assert peak_per_bucket([], []) == 0
    assert peak_concurrency([(0, 10), (5, 15), (10, 20), (12, 13)]) == 3  # at 12: [5,15) [10,20) [12,13)
    assert peak_concurrency([(0, 5), (5, 10)]) == 1  # [start, end): no overlap


def test_point_summary_by_hand():
    tenants = (TenantSpec(name="a", weight=1.0), TenantSpec(name="b", weight=2.0))
    records = [
        record("a", 0, (100, 200, 300), end_ms=300, prompt_tokens=10),  # 3 out, TTFT 100, TPOT 100
        record("a", 500, (600, 650), end_ms=700, prompt_tokens=10),  # 2 out, TTFT 100, TPOT 100
        record("b", 1000, (1400, 1500, 1600, 1700), end_ms=2000, prompt_tokens=20),  # TTFT 400, TPOT 200
        record("b", 1500, end_ms=1600, status="RESOURCE_EXHAUSTED"),
        record("a", -900, (-800,), end_ms=-700, warmup=True),  # warm-up: ignored
    ]
    s = summarize_point(records, tenants, {"ttft": 0.2})
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0 -> last end 2000 ms
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(9 / 2)
    assert s["total_token_throughput"] == pytest.approx((40 + 9) / 2)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["ttft_s"]["max"] == pytest.approx(0.4)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.1 + 0.3 / 3 * 2) / 3)
    assert s["itl_s"]["n"] == 2 + 1 + 3
    assert s["goodput"] == {"requests_per_s": pytest.approx(1.0), "num_good": 2, "fraction": 0.5}
    assert s["peak_in_flight"] == 2
    # service = (input + 2 x output) / weight: a = (10 + 6) + (10 + 4) = 30; b = (20 + 8) / 2 = 14
    assert s["tenants"]["a"]["weighted_service"] == 30
    assert s["tenants"]["b"]["weighted_service"] == 14
    assert s["fairness"]["jain_index"] == pytest.approx(44**2 / (2 * (30**2 + 14**2)))
    timeline = s["fairness"]["timeline"]
    assert timeline["service"]["a"][-1] == 30 and timeline["service"]["b"][-1] == 14
    assert s["fairness"]["max_service_gap"] == 30  # after 1 s: a has everything, b nothing yet
