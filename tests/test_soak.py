"""Overload and cancellation storm (benchmarks/soak.py) against real worker and router processes.

`make test` runs short versions that check behaviour: every call ends with a final message or a
status (none outlives its deadline), overload is shed with RESOURCE_EXHAUSTED, and afterwards
every KV block is free and every router gauge of open work is 0. The short overload (4 s at 3x
the capacity measured over 2.5 s: 27-44 calls, 8-12 served and 15-36 refused in three runs here at
load average 5) has a worker of its own (a batch of 2); the short storm (80 streams, each phase
cancelled 22-35 times) runs its own router over the session's shared worker. The full runs (60 s
at 3x the measured capacity, 1,000 cancelled streams over two workers) also check the issue's
speed and memory targets; they are marked slow (`--runslow`); `make soak` runs them as a benchmark
that writes docs/data/reliability/*.json. The hostile-tenant run (issue 45) is checked at its --quick
size: the attacker's answers and the stack's state, not its latency goals.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.soak import WORKER_ARGS, OverloadArgs, StormArgs, run_overload, run_storm
from benchmarks.soak_hostile import HostileArgs, run_hostile, table
from benchmarks.soak_stack import Stack


@pytest.fixture
def overload_stack():
    # The latency-protecting configuration: the router never queues (--no-queue) and the worker's
    # batch is small enough that a mixed step stays close to a lone prefill on this CPU.
    stack = Stack(1, ("--kv-cache-mb", "64", "--max-num-seqs", "2", *WORKER_ARGS), ("--no-queue",))
    yield stack
    stack.stop()


@pytest.fixture
def storm_stack(plain_worker):
    """A router of its own over the session's shared worker (tests/conftest.py): the storm must leave
    it idle with every KV block free (check_storm, then plain_worker's own check)."""
    stack = Stack(0, running_workers=(plain_worker.address,))
    yield stack
    stack.stop()


@pytest.fixture
def two_worker_storm_stack():
    stack = Stack(2, ("--kv-cache-mb", "48", *WORKER_ARGS))
    yield stack
    stack.stop()


def check_overload(result: dict) -> None:
    print(f"\noverload: {result}")
    statuses = result["statuses"]
    assert result["hung"] == 0 and set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, statuses
    assert statuses.get("OK", 0) > 0 and statuses.get("RESOURCE_EXHAUSTED", 0) > 0, statuses
    assert result["idle"], result["not_idle"]


def check_storm(result: dict) -> None:
    print(f"\ncancellation storm: {result}")
    assert result["hung"] == 0
    assert result["idle"], result["not_idle"]  # every KV block free, every router gauge 0
    assert result["served_afterwards"] == "OK"
    assert result["peak_router"]["queue_length"] > 0 and result["peak_router"]["worker_streams"] > 0
    phases = result["phases"]
    for phase in ("cancelled before any response", "cancelled before any token", "cancelled mid-stream"):
        assert phases.get(phase, 0) > 0, phases


def test_overload_short(overload_stack):
    result = asyncio.run(
        run_overload(
            overload_stack, OverloadArgs(duration_s=4, capacity_s=2.5, clients=2, unloaded_requests=3, seed=1)
        )
    )
    check_overload(result)
    # Shedding is immediate, not a wait in a queue: generous bound for a shared 2-core machine.
    assert result["refusal_latency"]["p99_ms"] < 1000, result["refusal_latency"]


def test_cancellation_storm_short(storm_stack):
    check_storm(asyncio.run(run_storm(storm_stack, StormArgs(streams=80, max_open=64, seed=1))))


@pytest.mark.slow
def test_overload_full(overload_stack):
    result = asyncio.run(run_overload(overload_stack, OverloadArgs(clients=2)))
    check_overload(result)
    targets = result["targets"]
    assert targets["refusal_p99_under_50ms"], result["refusal_latency"]
    assert targets["accepted_ttft_p99_within_2x_unloaded"], (result["accepted_ttft"], result["unloaded_ttft"])
    assert targets["rss_growth_under_10pct"], result["rss_growth_pct"]


@pytest.mark.slow
def test_cancellation_storm_full(two_worker_storm_stack):
    check_storm(asyncio.run(run_storm(two_worker_storm_stack, StormArgs(streams=1000))))


def test_hostile_short():
    """Issue 45 at --quick size (benchmarks/soak_hostile.py): each hostile request from the attacker
    tenant gets its expected answer (a 4xx naming the problem or a 429; 200 for the forged control
    tokens, which must stay text, and for the one canonical adapter name, the only adapter then
    listed); nothing hangs, nothing answers 5xx, every KV block is free after every row; the victim
    and the /health probe are served throughout, the slow-connection row included (its sockets
    come from another loopback address: a per-client cap must not lock the victim out). The
    latency and memory goals are the benchmark's (`python -m benchmarks.soak hostile`), not
    asserted here beyond sanity bounds."""
    result = run_hostile(HostileArgs.small(seed=1), WORKER_ARGS)
    print("\n" + table(result))
    rows = result["rows"]
    assert set(rows) == {
        "logit_bias_wrong_key",
        "schema_compile",
        "regex_n16",
        "tool_args",
        "control_tokens",
        "lora_names",
        "slow_connections",
    }
    for name, row in rows.items():
        assert all(row["correct"].values()), (name, row["correct"], row["not_idle"])
        if name != "slow_connections":  # its goal (every socket closed) needs a window past the
            # server's header timeout: the full run's 30 s; tests/test_openai_limits_e2e.py times it
            assert row["targets"]["attacker_answer"], (name, row["attacker_first_answer"], row)
        for side in ("victim_alone", "victim_beside"):
            for kind, seen in row[side].items():
                assert seen["statuses"] == ["200"], (name, side, kind, seen)
                assert seen["max_s"] < 30, (name, side, kind, seen)  # sanity, not the 1.5x goal
        assert row["health"]["error_count"] == 0, (name, row["health"])
        assert row["health"]["max_ms"] < 10_000, (name, row["health"])  # sanity, not the 100 ms goal
    assert rows["control_tokens"]["control_tokens"]["forged_control_tokens"] == 0
    assert [x["status"] for x in rows["lora_names"]["attacker_first_answer"]][0] == 200
