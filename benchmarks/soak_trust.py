"""Trust-boundary soaks (issue 17) against real worker and router processes on 127.0.0.1.

    python -m benchmarks.soak trust     # (make soak runs it with the others)

Contract
- one stack: a worker with `--max-num-seqs 2` and a worker token, a router with that token, a
  tenants file (flood: 1 request/s; victim, abuser, good: no limits) and `--stream-idle-timeout-s`.
- scenarios, each with targets checked and printed as PASS/MISS:
  - direct worker call: GetLoad, GetInfo and Generate without the token -> UNAUTHENTICATED.
  - stalled readers: 2 x max_num_seqs streams from a client that never reads (an HTTP/2 window of
    0 bytes, devtools/stalled_client.py); another tenant's request with a 10 s deadline completes;
    every stalled call ends on the router (deadline_exceeded) within the idle timeout + 30 s; every
    KV block is then free.
  - huge-prompt flood: bursts of the largest CJK prompt the early filter admits from the 1 req/s
    tenant for `flood_s`; >= 95% refused before tokenization (`llm_router_tokenize_calls_total`
    against the requests sent); grpc.health.v1 Check p99 < 100 ms (probed every 20 ms from a
    separate process); the router's `llm_router_event_loop_lag_seconds` reported.
  - priority abuse: a victim's long sequence holds most of the KV pool while a tenant asks for
    priority 2^31-1 `abuses` times: every one refused (PERMISSION_DENIED), 0 preemptions on the
    worker, the victim completes.
- output: a dict of measurements and targets (benchmarks/soak.py writes the JSON).
- proven by: tests/test_trust_*.py (the same checks, smaller); this module is the `make soak` run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.soak_stack import Stack
from common.auth import METADATA_KEY
from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from devtools.stalled_client import StalledClient
from loadtest.stats import percentile
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.tenants import hash_key

TOKEN = "soak-worker-token"
MAX_NUM_SEQS = 2
TENANTS = "tenants:\n" + "".join(
    f'  - name: {name}\n    key_sha256: "{hash_key(name + "-key")}"\n{extra}'
    for name, extra in (
        ("flood", "    rate_requests_per_s: 1\n"),
        ("victim", ""),
        ("abuser", ""),
        ("good", ""),
        ("staller", ""),
    )
)
PROBER = """
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, seconds = sys.argv[1], float(sys.argv[2])
latencies = []
with grpc.insecure_channel(address) as channel:
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
print(json.dumps(latencies), flush=True)
"""


@dataclass
class TrustArgs:
    idle_timeout_s: float = 2.0
    flood_s: float = 10.0
    burst: int = 40
    abuses: int = 20
    seed: int = 0


def key(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {name}-key"),)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def worker_call(address: str, method: str, metadata=()):
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        if method == "GetLoad":
            return stub.GetLoad(worker_pb2.GetLoadRequest(), metadata=metadata, timeout=5)
        if method == "GetInfo":
            return stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=metadata, timeout=5)
        sampling = worker_pb2.WorkerSampling(max_tokens=2, top_p=1.0)
        request = worker_pb2.WorkerRequest(request_id="direct", prompt_token_ids=[1, 2, 3], sampling=sampling)
        return list(stub.Generate(request, metadata=metadata, timeout=30))


def wait_blocks_free(address: str, timeout_s: float) -> float | None:
    """Seconds until the worker is empty with every KV block free; None if not within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        load = worker_call(address, "GetLoad", ((METADATA_KEY, TOKEN),))
        if load.num_running == load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def direct_calls(stack: Stack) -> dict:
    codes = {}
    for method in ("GetLoad", "GetInfo", "Generate"):
        try:
            worker_call(stack.worker_addresses[0], method)
            codes[method] = "OK"
        except grpc.RpcError as exc:
            codes[method] = exc.code().name
    return {
        "codes": codes,
        "targets": {"direct_calls_unauthenticated": set(codes.values()) == {"UNAUTHENTICATED"}},
    }


def ids_request(request_id: str, num_prompt: int, max_tokens: int, offset: int = 1000) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[offset + i % 30000 for i in range(num_prompt)]),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def stalled_readers(stack: Stack, args: TrustArgs) -> dict:
    before = total(scrape(stack.metrics_url), "llm_requests_total", status="deadline_exceeded")
    client = StalledClient(stack.address)
    n = 2 * MAX_NUM_SEQS
    try:
        for i in range(n):
            message = ids_request(f"stall-{i}", 8, 400).SerializeToString()
            client.open_stream("/llm.v1.Generation/Generate", message, key("staller"), 300)
        start = time.monotonic()
        good_ok = False
        with grpc.insecure_channel(stack.address) as channel:
            try:
                msgs = list(
                    generation_pb2_grpc.GenerationStub(channel).Generate(
                        ids_request("good", 8, 4, 5000), metadata=key("good"), timeout=10
                    )
                )
                good_ok = msgs[-1].finished.usage.completion_tokens == 4
            except grpc.RpcError as exc:
                good_ok = f"{exc.code().name}: {exc.details()}"
        good_s = time.monotonic() - start
        ended_s = None
        while time.monotonic() - start < args.idle_timeout_s + 30:
            ended = (
                total(scrape(stack.metrics_url), "llm_requests_total", status="deadline_exceeded") - before
            )
            if ended >= n:
                ended_s = time.monotonic() - start
                break
            time.sleep(0.2)
        free_s = wait_blocks_free(stack.worker_addresses[0], 30)
    finally:
        client.close()
    return {
        "stalled_streams": n,
        "other_tenant_s": round(good_s, 2),
        "stalled_ended_s": None if ended_s is None else round(ended_s, 2),
        "blocks_free_after_s": None if free_s is None else round(free_s, 2),
        "targets": {
            "other_tenant_completed_within_10s": good_ok is True,
            "stalled_streams_ended": ended_s is not None,
            "every_kv_block_free": free_s is not None,
        },
    }


def prompt_flood(stack: Stack, args: TrustArgs) -> dict:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        context = stub.ListModels(pb.ListModelsRequest(), metadata=key("good")).models[0].max_model_len
        chars = context * tokenizer.max_chars_per_token - 1
        text = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(chars))
        request = pb.GenerateRequest(prompt=text, stopping=pb.StoppingCriteria(max_tokens=4))
        tokenized_before = total(scrape(stack.metrics_url), "llm_router_tokenize_calls_total")
        prober = subprocess.Popen(
            [sys.executable, "-c", PROBER, stack.address, str(args.flood_s + 1.0)],
            stdout=subprocess.PIPE,
            text=True,
        )
        codes: dict[str, int] = {}
        lag_max = 0.0
        try:
            assert prober.stdout.readline().strip() == "ready"
            end = time.monotonic() + args.flood_s
            while time.monotonic() < end:
                calls = [stub.Generate(request, metadata=key("flood"), timeout=60) for _ in range(args.burst)]
                for call in calls:
                    try:
                        list(call)
                        name = "OK"
                    except grpc.RpcError as exc:
                        name = exc.code().name
                    codes[name] = codes.get(name, 0) + 1
                lag_max = max(lag_max, total(scrape(stack.metrics_url), "llm_router_event_loop_lag_seconds"))
            latencies = json.loads(prober.communicate(timeout=60)[0])
        finally:
            prober.kill()
            prober.wait()
    sent = sum(codes.values())
    tokenized = total(scrape(stack.metrics_url), "llm_router_tokenize_calls_total") - tokenized_before
    p99_ms = percentile(latencies, 99) * 1e3
    return {
        "prompt_chars": chars,
        "requests": sent,
        "statuses": codes,
        "tokenized": int(tokenized),
        "refused_before_tokenizing": round(1 - tokenized / sent, 4),
        "health_probes": len(latencies),
        "health_p50_ms": round(percentile(latencies, 50) * 1e3, 2),
        "health_p99_ms": round(p99_ms, 2),
        "event_loop_lag_max_ms": round(lag_max * 1e3, 1),
        "targets": {
            "refused_before_tokenizing_95pct": tokenized <= 0.05 * sent,
            "health_p99_under_100ms": p99_ms < 100,
            "no_internal_or_unknown": not ({"INTERNAL", "UNKNOWN"} & set(codes)),
        },
    }


def priority_abuse(stack: Stack, args: TrustArgs) -> dict:
    address = stack.worker_addresses[0]
    metrics = worker_call(address, "GetInfo", ((METADATA_KEY, TOKEN),)).metrics_address
    before = total(scrape(f"http://{metrics}/metrics"), "llm_preemptions_total")
    codes: dict[str, int] = {}
    with grpc.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        context = stub.ListModels(pb.ListModelsRequest(), metadata=key("good")).models[0].max_model_len
        victim = stub.Generate(ids_request("victim", context - 200, 150), metadata=key("victim"), timeout=300)
        next(victim)  # running: its sequence holds most of the pool
        abusive = ids_request("abuse", 300, 8, 9000)
        abusive.priority = 2**31 - 1
        for _ in range(args.abuses):
            try:
                list(stub.Generate(abusive, metadata=key("abuser"), timeout=30))
                name = "OK"
            except grpc.RpcError as exc:
                name = exc.code().name
            codes[name] = codes.get(name, 0) + 1
        victim_done = list(victim)[-1].finished.usage.completion_tokens == 150
    preemptions = total(scrape(f"http://{metrics}/metrics"), "llm_preemptions_total") - before
    return {
        "abusive_requests": args.abuses,
        "statuses": codes,
        "preemptions": int(preemptions),
        "targets": {
            "abuse_refused": codes == {"PERMISSION_DENIED": args.abuses},
            "zero_preemptions": preemptions == 0,
            "victim_completed": victim_done,
        },
    }


def run_trust(args: TrustArgs, worker_args: tuple[str, ...]) -> dict:
    tenants = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    tenants.write(TENANTS)
    tenants.close()
    stack = Stack(
        1,
        ("--max-num-seqs", str(MAX_NUM_SEQS), "--worker-token", TOKEN, "--kv-cache-mb", "48", *worker_args),
        (
            "--worker-token",
            TOKEN,
            "--tenants",
            tenants.name,
            "--stream-idle-timeout-s",
            str(args.idle_timeout_s),
        ),
    )
    try:
        with grpc.insecure_channel(stack.address) as channel:  # ready: the router sees the worker
            deadline = time.monotonic() + 120
            while (
                not generation_pb2_grpc.GenerationStub(channel)
                .ListModels(pb.ListModelsRequest(), metadata=key("good"), timeout=5)
                .models
            ):
                assert time.monotonic() < deadline, "the router did not see its worker"
                time.sleep(0.1)
        parts = {
            "direct_worker_call": direct_calls(stack),
            "stalled_readers": stalled_readers(stack, args),
            "prompt_flood": prompt_flood(stack, args),
            "priority_abuse": priority_abuse(stack, args),
        }
    finally:
        stack.stop()
    result = {name: {k: v for k, v in part.items() if k != "targets"} for name, part in parts.items()}
    result["targets"] = {
        f"{name}.{t}": ok for name, part in parts.items() for t, ok in part["targets"].items()
    }
    return result
