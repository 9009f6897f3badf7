"""Circuit breaker rules (router/circuit.py) on a fake clock."""

import pytest

from router.circuit import CircuitBreaker


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_opens_after_threshold_consecutive_failures_and_half_opens_after_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, base_cooldown_s=2.0, max_cooldown_s=60.0, clock=clock)
    assert not b.record_failure("x", at_s=98.0) and not b.record_failure("x", at_s=99.0) and b.allows()
    assert b.record_failure("boom") and b.state == "open" and not b.allows()
    assert b.last_reason == "boom" and b.cooldown_s == 2.0
    clock.t += 1.99
    assert not b.allows()
    clock.t += 0.02
    assert b.state == "half_open" and b.allows()


def test_success_resets_the_count_so_only_consecutive_failures_open_it():
    b = CircuitBreaker(failure_threshold=2, clock=Clock())
    for _ in range(10):
        b.record_failure("x")
        b.record_success()
    assert b.state == "closed" and b.consecutive_failures == 0


def test_failure_when_half_open_reopens_with_doubled_cooldown_up_to_the_cap():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, base_cooldown_s=1.0, max_cooldown_s=5.0, clock=clock)
    cooldowns = []
    for _ in range(5):
        assert b.record_failure("x")  # opens (first) or re-opens from half-open (a later incident)
        cooldowns.append(b.cooldown_s)
        clock.t += b.cooldown_s  # cool-down over: half-open
        assert b.state == "half_open"
    assert cooldowns == [1.0, 2.0, 4.0, 5.0, 5.0]
    b.record_success()
    assert b.state == "closed" and b.trips == 0
    b.record_failure("x")
    assert b.cooldown_s == 1.0  # back to the base after a success


def test_failures_while_open_do_not_extend_it():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, base_cooldown_s=2.0, clock=clock)
    b.record_failure("x")
    clock.t += 1.0
    assert not b.record_failure("late failure of a call placed before it opened")
    clock.t += 1.0
    assert b.state == "half_open"


def test_failures_of_one_incident_count_once():
    """One failed engine step fails every request in it within milliseconds: one failure, however
    many calls; a failure counted late (at_s, the relay's) still belongs to its own incident."""
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, clock=clock)
    for i in range(6):
        assert not b.record_failure(f"victim {i}", at_s=clock.t + i * 0.005)
    assert b.consecutive_failures == 1 and b.state == "closed" and b.last_reason == "victim 5"
    clock.t += 5.0
    assert not b.record_failure("late report", at_s=100.01)  # happened in the first incident
    assert b.record_failure("a second incident") and b.state == "open"


@pytest.mark.parametrize(
    "kwargs", [dict(failure_threshold=0), dict(base_cooldown_s=0), dict(base_cooldown_s=5, max_cooldown_s=1)]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)
