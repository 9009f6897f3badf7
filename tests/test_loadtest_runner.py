"""The runner against an in-process fake client: closed-loop concurrency, open-loop timing and
warm-up, request-count bounds, the client-side cap, the drain timeout, seeded reproducibility."""

import asyncio

import pytest

from loadtest.config import RunConfig, Target, TenantSpec
from loadtest.lengths import LengthDist
from loadtest.runner import Clock, PointRun
from loadtest.summary import summarize_point
from loadtest.workload import Workload, load_prompts

PROMPTS = load_prompts("bundled")
TARGET = (Target("fake", "grpc", "127.0.0.1:1"),)


class FakeClient:
    """Streams `max_tokens` one-token chunks: first after `ttft_s`, then every `gap_s`."""

    def __init__(self, clock: Clock, ttft_s=0.01, gap_s=0.005, hang_index=None):
        self.clock, self.ttft_s, self.gap_s, self.hang_index = clock, ttft_s, gap_s, hang_index
        self.sent = []
        self.in_flight = self.peak = 0

    async def send(self, spec, record, request_id, api_key="", priority=0):
        record.sent_ns = self.clock.now_ns()
        self.sent.append((spec.tenant, spec.prompt, spec.max_tokens, record.scheduled_ns, api_key))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(1000 if spec.index == self.hang_index else self.ttft_s)
            for _ in range(spec.max_tokens):
                record.chunk_ns.append(self.clock.now_ns())
                record.chunk_tokens.append(1)
                await asyncio.sleep(self.gap_s)
            record.prompt_tokens, record.completion_tokens = 5, spec.max_tokens
            record.finish_reason = "length"
            record.end_ns = self.clock.now_ns()
        finally:
            self.in_flight -= 1


def run_point(tenants, client_kwargs=None, seed=0, **config):
    config = RunConfig(targets=TARGET, tenants=tuple(tenants), progress=False, **config)
    clock = Clock()
    client = FakeClient(clock, **(client_kwargs or {}))
    workloads = {t.name: Workload(t, seed, None, PROMPTS) for t in tenants}
    run = PointRun(config, config.tenants, workloads, client, clock, str(seed), "t", "test")
    records = asyncio.run(run.run())
    return records, client


def tenant(**kw):
    return TenantSpec(**{"prompts": "bundled", "output_len": LengthDist.parse("3"), **kw})


def test_closed_loop_keeps_concurrency_and_stops_at_the_count():
    records, client = run_point([tenant(arrival="closed", concurrency=3)], duration_s=None, num_requests=12)
    assert len(records) == 12 and all(r.ok and not r.warmup for r in records)
    assert client.peak == 3
    assert summarize_point(records, (tenant(),), {})["peak_in_flight"] == 3


def test_open_loop_sends_on_schedule_and_flags_warmup():
    # constant 32 req/s: sends at k/32 s; warm-up 0.1 s -> k = 1, 2, 3; end 0.3 s -> k <= 9
    records, _ = run_point([tenant(arrival="constant", rate_per_s=32.0)], duration_s=0.2, warmup_s=0.1)
    assert len(records) == 9
    assert [r.warmup for r in records] == [True] * 3 + [False] * 6
    for k, r in enumerate(records, start=1):
        assert r.scheduled_ns == int(k / 32 * 1e9)
        assert 0 <= r.sent_ns - r.scheduled_ns < 50_000_000  # sent on time (loose: shared CPU)
    assert summarize_point(records, (tenant(),), {})["num_requests"] == 6


def test_client_cap_makes_requests_wait():
    records, client = run_point(
        [tenant(arrival="constant", rate_per_s=1000.0)],
        {"ttft_s": 0.05},
        duration_s=None,
        num_requests=6,
        max_concurrency=2,
    )
    assert client.peak == 2 and len(records) == 6
    assert max(r.client_wait_s for r in records) >= 0.05


def test_drain_timeout_cancels_what_is_left():
    records, _ = run_point(
        [tenant(arrival="closed", concurrency=2)], {"hang_index": 1}, duration_s=0.2, drain_timeout_s=0.2
    )
    hung = [r for r in records if r.index == 1]
    assert hung[0].status == "CLIENT_DRAIN_TIMEOUT" and hung[0].end_ns >= hung[0].sent_ns
    assert all(r.ok for r in records if r.index != 1)


def test_same_seed_same_request_stream():
    tenants = [
        tenant(name="a", api_key="ka", rate_per_s=30.0),
        tenant(
            name="b",
            api_key="kb",
            arrival="gamma",
            rate_per_s=40.0,
            burstiness=0.5,
            output_len=LengthDist.parse("uniform:1:4"),
        ),
    ]
    first = run_point(tenants, seed=5, duration_s=0.3)[1].sent
    again = run_point(tenants, seed=5, duration_s=0.3)[1].sent
    other = run_point(tenants, seed=6, duration_s=0.3)[1].sent
    assert first == again and first != other
    assert {s[0] for s in first} == {"a", "b"} and {(s[0], s[4]) for s in first} == {("a", "ka"), ("b", "kb")}


@pytest.mark.parametrize("bound", [dict(duration_s=None, num_requests=None), dict(duration_s=-1.0)])
def test_runs_are_bounded(bound):
    with pytest.raises(ValueError):
        RunConfig(targets=TARGET, tenants=(tenant(),), **bound)
