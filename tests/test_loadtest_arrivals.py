"""Arrival processes: mean rate and coefficient of variation of the gaps within tolerance,
reproducible from the seed, and the merged schedule's bounds."""

import itertools
import random
import statistics

import pytest

from loadtest.arrivals import ArrivalProcess, arrival_times, schedule

NUM_GAPS = 20_000


def gaps(process: ArrivalProcess, seed: int = 1) -> list[float]:
    return list(itertools.islice(process.gaps(random.Random(seed)), NUM_GAPS))


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def test_poisson_rate_and_cv():
    g = gaps(ArrivalProcess("poisson", rate_per_s=8.0))
    # mean of 20k exponential gaps: relative standard error 1/sqrt(20k) = 0.7 %; allow 3 %
    assert 1 / statistics.fmean(g) == pytest.approx(8.0, rel=0.03)
    assert cv(g) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("shape, want_cv", [(0.25, 2.0), (4.0, 0.5)])
def test_gamma_burstiness_sets_cv(shape, want_cv):
    g = gaps(ArrivalProcess("gamma", rate_per_s=3.0, burstiness=shape))
    assert 1 / statistics.fmean(g) == pytest.approx(3.0, rel=0.05)
    assert cv(g) == pytest.approx(want_cv, rel=0.08)


def test_constant_rate_has_no_variation():
    g = gaps(ArrivalProcess("constant", rate_per_s=4.0))
    assert set(g) == {0.25}


def test_same_seed_same_stream():
    p = ArrivalProcess("poisson", 2.0)
    assert gaps(p, seed=7) == gaps(p, seed=7)
    assert gaps(p, seed=7) != gaps(p, seed=8)


@pytest.mark.parametrize(
    "kwargs", [{"kind": "uniform"}, {"rate_per_s": 0}, {"kind": "gamma", "burstiness": 0}]
)
def test_invalid_processes(kwargs):
    with pytest.raises(ValueError):
        ArrivalProcess(**kwargs)


def test_schedule_merges_tenants_in_time_order_until_the_duration():
    fast = arrival_times(ArrivalProcess("constant", 4.0), random.Random(0))  # 0.25, 0.5, ...
    slow = arrival_times(ArrivalProcess("constant", 1.0), random.Random(0))  # 1, 2, ...
    plan = schedule([fast, slow], warmup_s=1.0, duration_s=2.0, num_requests=None)
    times = [t for t, _ in plan]
    assert times == sorted(times) and max(times) < 3.0
    assert [i for _, i in plan].count(0) == 11 and [i for _, i in plan].count(1) == 2  # 0.25..2.75; 1, 2


def test_schedule_counts_only_measured_requests():
    stream = arrival_times(ArrivalProcess("constant", 10.0), random.Random(0))  # 0.1, 0.2, ...
    plan = schedule([stream], warmup_s=0.5, duration_s=None, num_requests=5)
    assert len(plan) == 4 + 5  # 0.1..0.4 are warm-up, then 5 measured
    assert sum(t >= 0.5 for t, _ in plan) == 5
    with pytest.raises(ValueError):
        schedule([stream], 0.0, None, None)
