"""Tenant isolation (issue 9) through one real router and one worker (SmolLM2 on CPU), both logging
JSON and exporting spans over OTLP to a receiver in this process.

1. Cached prefixes: the worker's prefix cache is salted with the tenant, so tenant B sending the
   prompt tenant A just warmed gets no cache hit (usage.cached_prompt_tokens == 0) and pays A's
   cold time to first token, not the warm one (medians over distinct prompts; numbers printed).
2. Connections: a tenant with max_concurrency 2 firing 16 requests over 16 separate channels gets
   2 admitted and 14 RESOURCE_EXHAUSTED (reason concurrency, counted on /metrics), and the worker
   never runs more than 2 of them at once. A router started as one of two (`--router-replicas 2`)
   admits 2 of 8 when the file says 4.
3. Spoofing: with A's key, metadata naming B (`x-tenant`, `tenant`, `baggage`) and request fields
   naming B change nothing: the request is admitted and logged as A and finds none of B's cached
   blocks. Two `authorization` entries (A's and another, in either order) are UNAUTHENTICATED, the
   contract in router/tenants.py.
4. Keys never leak: no API key (valid or wrong), nor its sha256, appears in the router's or the
   worker's log, in any exported OTLP span (the raw export bytes are searched), or on either
   /metrics page; an UNAUTHENTICATED message does not echo the presented key.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.errors import AuthError
from router.tenants import Tenant, Tenants, hash_key
from tests import procs

KEYS = {
    "alice": "sk-alice-3f9c2e71d4b8a605",
    "bob": "sk-bob-8e1a47c0b29d5f36",
    "limited": "sk-limited-c5d2f08e93a1b74",
}
WRONG_KEY = "sk-wrong-71be0d6a2c94f853"
TENANTS = "tenants:\n" + "".join(
    f"  - name: {name}\n    key_sha256: {hash_key(key)}\n"
    + ("    max_concurrency: 2\n" if name == "limited" else "")
    for name, key in KEYS.items()
)
PROMPT_LEN = 320  # 20 KV blocks of 16 tokens (cold prefill ~0.8 s here, a warm one ~0.1 s)
NUM_PROMPTS = 3  # distinct prompts: medians beat this shared machine's noise


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


@pytest.fixture(scope="module")
def sink(shared_sink):
    """The session's OTLP receiver (tests/conftest.py): it keeps every export request's bytes, so a
    search covers every attribute, event, status message and resource field, not only what
    `SinkSpan` parses."""
    return shared_sink


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker: JSON logs, /metrics, spans to `sink` within 50 ms."""
    return plain_worker


@pytest.fixture(scope="module")
def router(worker, logs, sink):
    with procs.running_router(
        logs,
        [worker.address],
        "--otlp-endpoint",
        sink.endpoint,
        "--log-format",
        "json",
        "--metrics-port",
        "0",
        tenants=TENANTS,
        metadata=auth("alice"),
        env=procs.FAST_SPAN_EXPORT,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def router_metrics(router):
    return procs.metrics_address(router)


@pytest.fixture(scope="module")
def worker_metrics(worker):
    return procs.worker_metrics_address(worker.address)


def request(prompt_ids: list[int], max_tokens: int = 1, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def generate(stub, req: pb.GenerateRequest, metadata) -> pb.Finished:
    msgs = list(stub.Generate(req, metadata=metadata, timeout=120))
    assert msgs and msgs[-1].HasField("finished")
    return msgs[-1].finished


def refusal(stub, req: pb.GenerateRequest, metadata) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=metadata, timeout=30))
    return err.value


def scrape_text(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()


def sample(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def prompt(n: int) -> list[int]:
    """A distinct PROMPT_LEN-token prompt per n (ids well inside the vocabulary)."""
    return [1000 + (n * 7919 + k * 104729) % 40000 for k in range(PROMPT_LEN)]


def test_duplicate_authorization_is_refused_whatever_the_order():
    tenants = Tenants(
        [Tenant("alice", hash_key(KEYS["alice"])), Tenant("bob", hash_key(KEYS["bob"]))], require_key=True
    )
    peer = "ipv4:127.0.0.1:5000"
    spoofed = auth("alice") + (("x-tenant", "bob"), ("tenant", "bob"))
    assert tenants.authenticate(spoofed, peer).name == "alice"
    for extra in (f"Bearer {KEYS['bob']}", f"Bearer {WRONG_KEY}", "Bearer bob", f"Bearer {KEYS['alice']}"):
        second = (("authorization", extra),)
        for metadata in (auth("alice") + second, second + auth("alice")):
            with pytest.raises(AuthError) as err:
                tenants.authenticate(metadata, peer)
            assert "exactly one" in err.value.message and WRONG_KEY not in err.value.message


def test_no_cache_hit_across_tenants(stub):
    """Per prompt: A cold, A warm, then B (same prompt), then B again (B's own cache works)."""
    rows = []
    for n in range(NUM_PROMPTS):
        ids = prompt(n)
        a_cold, a_warm, b_cross, b_warm = (
            generate(stub, request(ids), auth(tenant)) for tenant in ("alice", "alice", "bob", "bob")
        )
        rows.append((a_cold, a_warm, b_cross, b_warm))
        assert a_cold.usage.cached_prompt_tokens == 0
        assert a_warm.usage.cached_prompt_tokens >= PROMPT_LEN - 16
        assert b_cross.usage.cached_prompt_tokens == 0  # A's blocks are not B's
        assert b_warm.usage.cached_prompt_tokens >= PROMPT_LEN - 16

    def median(i):
        return statistics.median(r[i].timing.ttft_ms for r in rows)

    cold, warm, cross, b_warm = median(0), median(1), median(2), median(3)
    print(
        f"\nTTFT medians over {NUM_PROMPTS} prompts of {PROMPT_LEN} tokens: A cold {cold:.1f} ms, "
        f"A warm {warm:.1f} ms (cached {rows[0][1].usage.cached_prompt_tokens}), B same prompt "
        f"{cross:.1f} ms (cached 0), B warm {b_warm:.1f} ms; B/A-cold {cross / cold:.2f}, "
        f"A-warm/A-cold {warm / cold:.2f}"
    )
    assert warm < 0.5 * cold, (cold, warm)
    assert cross > 0.5 * cold, (cold, cross)  # B paid a full prefill
    assert cross > 2 * warm, (warm, cross)


async def fire_at_once(address: str, tenant: str, num: int) -> list[str]:
    """`num` requests of `tenant` over `num` channels, all connected first; each one's status."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(num)]
    try:
        await asyncio.gather(*(c.channel_ready() for c in channels))

        async def one(i, channel):
            stub = generation_pb2_grpc.GenerationStub(channel)
            try:
                req = request(prompt(100 + i)[:32], max_tokens=48)
                async for _ in stub.Generate(req, metadata=auth(tenant), timeout=120):
                    pass  # only the final status matters
                return "OK"
            except grpc.aio.AioRpcError as exc:
                assert tenant in exc.details(), exc.details()
                return exc.code().name

        return await asyncio.gather(*(one(i, c) for i, c in enumerate(channels)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def test_many_connections_do_not_bypass_max_concurrency(router, worker, router_metrics):
    num = 16
    before = scrape_text(router_metrics)
    peak = {"running": 0}
    done = threading.Event()

    def watch():  # the worker's own view: how many of the tenant's sequences run at once
        with grpc.insecure_channel(worker.address) as channel:
            w = worker_pb2_grpc.WorkerStub(channel)
            while not done.is_set():
                load = w.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                peak["running"] = max(peak["running"], load.num_running + load.num_waiting)
                done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcomes = asyncio.run(fire_at_once(router.address, "limited", num))
    finally:
        done.set()
        watcher.join()
    after = scrape_text(router_metrics)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    refused = delta("llm_admission_rejections_total", tenant="limited", reason="concurrency")
    admitted = delta("llm_admitted_requests_total", tenant="limited")
    print(
        f"\n{num} requests over {num} channels, max_concurrency 2: OK {outcomes.count('OK')}, "
        f"RESOURCE_EXHAUSTED {outcomes.count('RESOURCE_EXHAUSTED')}; /metrics admitted {admitted:g}, "
        f"rejections{{reason=concurrency}} {refused:g}; peak running on the worker {peak['running']}"
    )
    assert sorted(set(outcomes)) == ["OK", "RESOURCE_EXHAUSTED"], outcomes
    assert outcomes.count("OK") == 2 and admitted == 2
    assert outcomes.count("RESOURCE_EXHAUSTED") == refused == num - 2
    assert peak["running"] <= 2


def test_one_of_two_routers_enforces_half_of_the_limit(worker, logs):
    # --router-replicas 2: the file's max_concurrency 4 is 2 on this router (docs/fairness.md 6).
    tenants = TENANTS.replace("max_concurrency: 2", "max_concurrency: 4")
    with procs.running_router(
        logs,
        [worker.address],
        "--router-replicas",
        "2",
        "--metrics-port",
        "0",
        tenants=tenants,
        metadata=auth("alice"),
    ) as half_router:
        outcomes = asyncio.run(fire_at_once(half_router.address, "limited", 8))
    assert outcomes.count("OK") == 2 and outcomes.count("RESOURCE_EXHAUSTED") == 6, outcomes


def test_metadata_and_fields_cannot_spoof_another_tenant(stub, router, router_metrics):
    ids = prompt(200)
    assert generate(stub, request(ids), auth("bob")).usage.cached_prompt_tokens == 0
    assert generate(stub, request(ids), auth("bob")).usage.cached_prompt_tokens >= PROMPT_LEN - 16  # B's own

    before = scrape_text(router_metrics)
    spoof = auth("alice") + (
        ("x-tenant", "bob"),
        ("tenant", "bob"),
        ("x-api-tenant", "bob"),
        ("baggage", "tenant=bob"),
        ("x-forwarded-user", "bob"),
    )
    finished = generate(stub, request(ids, request_id="bob"), spoof)
    after = scrape_text(router_metrics)
    assert finished.usage.cached_prompt_tokens == 0  # none of B's blocks
    assert (
        sample(after, "llm_admitted_requests_total", tenant="alice")
        - sample(before, "llm_admitted_requests_total", tenant="alice")
        == 1
    )
    assert sample(after, "llm_admitted_requests_total", tenant="bob") == sample(
        before, "llm_admitted_requests_total", tenant="bob"
    )

    def logged():  # the router writes the line just after the last message
        text = router.log_path.read_text()
        entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        return next(
            (e for e in entries if e["msg"] == "request finished" and e.get("request_id") == "bob"), None
        )

    deadline = time.monotonic() + 10
    while (entry := logged()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry is not None and entry["tenant"] == "alice", entry

    statuses = []
    for second in (f"Bearer {KEYS['bob']}", "Bearer bob", f"Bearer {WRONG_KEY}"):
        extra = (("authorization", second),)
        for metadata in (auth("alice") + extra, extra + auth("alice")):
            err = refusal(stub, request(ids[:16]), metadata)
            statuses.append(err.code())
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    print(
        f"\nspoofed metadata + request_id='bob' with alice's key: admitted as alice, cached_prompt_tokens "
        f"{finished.usage.cached_prompt_tokens} on bob's cached prompt; two authorization entries: "
        f"{sorted({s.name for s in statuses})} x{len(statuses)}"
    )


def test_keys_never_appear_in_logs_spans_or_metrics(
    stub, router, worker, sink, router_metrics, worker_metrics
):
    presented = [
        f"Bearer {WRONG_KEY}",
        WRONG_KEY,
        f"Basic {WRONG_KEY}",
        f"Bearer {WRONG_KEY} {KEYS['alice']}",
        f"Bearer {KEYS['alice']}x",
    ]
    for header in presented:
        err = refusal(stub, request([1, 2, 3]), (("authorization", header),))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert WRONG_KEY not in err.details() and KEYS["alice"] not in err.details(), err.details()
    for i, tenant in enumerate(KEYS):
        generate(stub, request(prompt(300 + i)[:40], max_tokens=2, request_id=f"leak-{tenant}"), auth(tenant))

    def exported(spans):
        last = {s.service for s in spans if s.attributes.get("llm.request_id", "").startswith("leak-limited")}
        return last == {"llm-router", "llm-worker"}

    spans = sink.wait_for(exported, timeout_s=30)
    unauthenticated = [
        s
        for s in spans
        if s.service == "llm-router"
        and "llm.request_id" not in s.attributes
        and s.name == "llm.v1.Generation/Generate"
    ]
    assert len(unauthenticated) >= len(presented)  # the refused calls were exported too
    places = {
        "router log": router.log_path.read_bytes(),
        "worker log": worker.log_path.read_bytes(),
        "OTLP export": sink.raw(),
        "router /metrics": scrape_text(router_metrics).encode(),
        "worker /metrics": scrape_text(worker_metrics).encode(),
    }
    for name in KEYS:  # the search does find what is meant to be there: tenant names
        assert name.encode() in places["router log"] and name.encode() in places["OTLP export"], name
    secrets = {**KEYS, "wrong": WRONG_KEY}
    needles = {f"{name} key": key.encode() for name, key in secrets.items()}
    needles |= {f"{name} key sha256": hash_key(key).encode() for name, key in secrets.items()}
    found = [
        (needle, place)
        for needle, value in needles.items()
        for place, data in places.items()
        if value in data
    ]
    sizes = ", ".join(f"{place} {len(data)} B" for place, data in places.items())
    print(f"\nsearched {len(needles)} secrets (4 keys and their sha256) in {sizes}: {len(found)} found")
    assert not found, found
