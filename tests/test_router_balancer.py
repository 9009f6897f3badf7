"""Least-outstanding-tokens choice and lease accounting."""

from dataclasses import dataclass

from router.balancer import Lease, LeastOutstandingTokens


@dataclass
class W:
    address: str
    outstanding_tokens: int = 0
    num_inflight: int = 0


def test_picks_least_outstanding_tokens():
    a, b, c = W("a", 100), W("b", 10), W("c", 50)
    assert LeastOutstandingTokens().choose([a, b, c]).address == "b"


def test_ties_broken_by_inflight_then_rotation():
    bal = LeastOutstandingTokens()
    a, b = W("a", 0, 2), W("b", 0, 1)
    assert bal.choose([a, b]).address == "b"
    a.num_inflight = 1
    picks = {bal.choose([a, b]).address for _ in range(4)}
    assert picks == {"a", "b"}


def test_exclude_and_empty():
    bal = LeastOutstandingTokens()
    a, b = W("a"), W("b", 99)
    assert bal.choose([a, b], exclude={"a"}).address == "b"
    assert bal.choose([a, b], exclude={"a", "b"}) is None
    assert bal.choose([]) is None


def test_concurrent_requests_spread_through_leases():
    bal = LeastOutstandingTokens()
    workers = [W("a"), W("b")]
    leases = []
    for _ in range(6):
        w = bal.choose(workers)
        leases.append(Lease(w, num_prompt_tokens=10, max_tokens=20))
    assert [w.num_inflight for w in workers] == [3, 3]
    for lease in leases:
        lease.release()
    assert [(w.outstanding_tokens, w.num_inflight) for w in workers] == [(0, 0), (0, 0)]


def test_lease_progress_and_release_are_exact():
    w = W("a")
    lease = Lease(w, num_prompt_tokens=10, max_tokens=5)
    assert w.outstanding_tokens == 15
    lease.progress(1, first=True)  # prefill done + one token
    assert w.outstanding_tokens == 4
    lease.progress(10, first=False)  # never below zero for this lease
    assert w.outstanding_tokens == 0
    lease.release()
    lease.release()  # idempotent
    assert (w.outstanding_tokens, w.num_inflight) == (0, 0)
