"""Issue 17 items 3, 4 and 9 end to end (real worker and router processes).

- Huge-prompt flood: a tenant limited to 1 request/s sends a burst of the largest CJK prompts the
  early length filter lets through; at least 95% are refused before tokenization (the router's
  `rate_limited` refusals), and grpc.health.v1 Check latency p99 stays under 250 ms meanwhile
  (the event loop does not stall: tokenizing releases the GIL, off the loop, in a bounded pool).
- Priority abuse: a tenant asking for priority 2^31-1 is refused (PERMISSION_DENIED) and the
  other tenant's sequence is never preempted (the worker's llm_preemptions_total does not grow), while
  a tenant allowed priority 5 gets it.
- Deadlines: a tenant's max_deadline_s ends a call that set none (DEADLINE_EXCEEDED), and every
  KV block is free afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from loadtest.stats import percentile
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.tenants import hash_key
from tests import procs

TENANTS = f"""
tenants:
  - name: flood
    key_sha256: "{hash_key("flood-key")}"
    rate_requests_per_s: 1
  - name: victim
    key_sha256: "{hash_key("victim-key")}"
  - name: abuser
    key_sha256: "{hash_key("abuser-key")}"
  - name: urgent
    key_sha256: "{hash_key("urgent-key")}"
    max_priority: 5
  - name: bounded
    key_sha256: "{hash_key("bounded-key")}"
    max_deadline_s: 1
"""
FLOOD_S = 4.0
VICTIM_TOKENS = 60  # the victim still runs after the five refusals (checked), a few ms each
BURST = 40


def key(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {name}-key"),)


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker (tests/conftest.py): default engine flags, idle between modules."""
    return plain_worker


@pytest.fixture(scope="module")
def router(worker, logs):
    with procs.running_router(logs, [worker.address], tenants=TENANTS, metadata=key("victim")) as proc:
        yield proc


def scrape_worker(address: str) -> dict:
    return procs.scrape(procs.worker_metrics_address(address))


def counter(samples, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


PROBER = """
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, seconds = sys.argv[1], float(sys.argv[2])
latencies = []
with grpc.insecure_channel(address) as channel:
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected before timing starts
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)  # a probe every 20 ms
print(json.dumps(latencies), flush=True)
"""


def test_huge_prompt_flood_is_refused_before_tokenizing_and_health_stays_fast(router, tokenizer):
    """The health probes run in their own process, so that this process's work (serializing 250
    kB prompts) does not count as the router's latency."""
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), metadata=key("victim")).models
        # the largest prompt the early length filter lets through: ~235k tokens to encode
        chars = models[0].max_model_len * tokenizer.max_chars_per_token - 1
        prompt = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(chars))
        request = pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(max_tokens=4))
        tokenized_before = procs.scrape(router).get(("llm_router_tokenize_calls_total", ()), 0.0)
        prober = subprocess.Popen(
            [sys.executable, "-c", PROBER, router.address, str(FLOOD_S + 1.0)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert prober.stdout.readline().strip() == "ready"
            codes = []
            end = time.monotonic() + FLOOD_S
            while time.monotonic() < end:  # bursts of BURST requests, all in flight at once
                calls = [stub.Generate(request, metadata=key("flood"), timeout=60) for _ in range(BURST)]
                for call in calls:
                    try:
                        list(call)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as exc:
                        codes.append(exc.code())
            latencies = json.loads(prober.communicate(timeout=60)[0])
        finally:
            prober.kill()
            prober.wait()
    samples = procs.scrape(router)
    assert ("llm_router_tokenize_calls_total", ()) in samples
    tokenized = samples[("llm_router_tokenize_calls_total", ())] - tokenized_before
    refused_early = counter(samples, "llm_admission_rejections_total", tenant="flood", reason="rate_limited")
    p99_ms = percentile(latencies, 99) * 1e3
    lag = counter(samples, "llm_router_event_loop_lag_seconds")
    print(
        f"\nflood of {len(codes)} x {chars:,}-character prompts in {FLOOD_S:g} s: {refused_early:.0f} "
        f"refused before tokenizing ({refused_early / len(codes):.1%}), {tokenized:.0f} tokenized; statuses "
        f"{sorted({c.name for c in codes})}; health p99 {p99_ms:.1f} ms, max "
        f"{max(latencies) * 1e3:.1f} ms over {len(latencies)} probes; loop lag gauge {lag * 1e3:.1f} ms"
    )
    assert grpc.StatusCode.INTERNAL not in codes and grpc.StatusCode.UNKNOWN not in codes
    assert refused_early >= 0.95 * len(codes) and tokenized <= 0.05 * len(codes), (refused_early, tokenized)
    # What this guards against costs seconds per probe (one of these prompts encoded on the
    # router's event loop); 100 ms failed once at 112 ms (2026-12-02, a slow hour of this 2-vCPU
    # machine, the other test process busy on the second core), so the bound leaves that room.
    assert len(latencies) >= 20 and p99_ms < 250, p99_ms


def test_priority_above_the_tenants_cap_is_refused_and_preempts_no_one(router, worker):
    samples = scrape_worker(worker.address)
    assert any(name == "llm_preemptions_total" for name, _ in samples)  # (a missing one would read 0)
    preempted_before = counter(samples, "llm_preemptions_total")  # the shared worker's, since its start
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), metadata=key("victim")).models
        context = models[0].max_model_len
        # the victim's sequence holds most of the KV pool (prompt + output near the context): the
        # abusive prompt would not fit beside it, so running it first would preempt the victim
        victim_prompt = [1000 + i % 30000 for i in range(context - 200)]
        victim = stub.Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=victim_prompt),
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=VICTIM_TOKENS, ignore_eos=True),
            ),
            metadata=key("victim"),
            timeout=300,
        )
        first = next(victim)  # running on the worker
        assert first.HasField("chunk")
        abusive = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[2000 + i for i in range(300)]),
            stopping=pb.StoppingCriteria(max_tokens=8),
            priority=2**31 - 1,
        )
        refused = []
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(abusive, metadata=key("abuser"), timeout=30))
            refused.append(err.value.code())
            assert "max" in err.value.details() or "highest" in err.value.details()
        assert refused == [grpc.StatusCode.PERMISSION_DENIED] * 5
        assert procs.worker_load(worker.address).num_running == 1  # the victim ran all along
        rest = list(victim)
        assert rest[-1].finished.usage.completion_tokens == VICTIM_TOKENS
        # a tenant allowed priority 5 gets it
        allowed = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_tokens=2), priority=5)
        assert list(stub.Generate(allowed, metadata=key("urgent"), timeout=60))[-1].HasField("finished")
    assert counter(scrape_worker(worker.address), "llm_preemptions_total") == preempted_before


def test_a_tenants_max_deadline_ends_a_call_that_set_none(router, worker):
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            prompt="Write a long story:", stopping=pb.StoppingCriteria(max_tokens=900, ignore_eos=True)
        )
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=key("bounded")))  # no client deadline at all
        took_s = time.monotonic() - start
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert took_s < 30, took_s
    procs.wait_all_blocks_free(worker.address, timeout_s=30)
