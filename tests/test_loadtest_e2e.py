"""Acceptance 2: `python -m loadtest` runs two-tenant load against a real worker + router with a
tenants file; the report files exist and parse, and agree with the server's own counts. 6 s of it
(1.5 s warm-up + 4.5 s measured) at 4x the rates this test used to offer for 20 s (3 s + 17 s):
the seeded plan has 20 requests, 4 of them warm-up (the 20 s run's had 14, 2 of them warm-up).

"The server's own counts": what it reports per request (Finished.usage: prompt and completion
tokens), the worker's load report after the run (nothing running or waiting, every KV block free
again) and, when the router announces a Prometheus endpoint ("metrics at http://.../metrics" in
its log), its `llm_requests_total`, `llm_prompt_tokens_total` and `llm_generation_tokens_total`
over the run. Checked: every request of the seeded plan was sent and finished OK; the server's
completion counts equal the token ids the client received (and max_tokens, with ignore_eos); the
server's prompt counts equal the client's synthetic prompt lengths; the summary's totals equal
the sums over requests.jsonl.
"""

import json
import re

import pytest

from loadtest.cli import main, parse_args
from loadtest.runner import open_loop_plan
from loadtest.sweep import point_seed
from router.tenants import hash_key
from tests import procs

KEYS = {"alice": "alice-key", "bob": "bob-key"}
OUTPUT_LEN = 8
DURATION_S, WARMUP_S = 4.5, 1.5


@pytest.fixture(scope="module")
def server(logs, plain_worker):
    """The session's shared worker (tests/conftest.py) and a router of this module's tenants."""
    tenants = "tenants:\n" + "".join(
        f"  - name: {name}\n    key_sha256: {hash_key(key)}\n    weight: {2.0 if name == 'alice' else 1.0}\n"
        for name, key in KEYS.items()
    )
    alice = (("authorization", f"Bearer {KEYS['alice']}"),)
    with procs.running_router(logs, [plain_worker.address], tenants=tenants, metadata=alice) as router:
        yield plain_worker, router


def test_two_tenant_load_report_agrees_with_the_server(server, tmp_path):
    worker, router = server
    out = tmp_path / "report"
    announced = re.search(r"metrics at (http://\S+/metrics)", router.log_tail(100_000))
    metrics = ["--metrics-url", announced.group(1)] if announced else []
    argv = [
        *metrics,
        "--target",
        router.address,
        "--duration-s",
        str(DURATION_S),
        "--warmup-s",
        str(WARMUP_S),
        "--seed",
        "7",
        "--tenant",
        f"name=alice,key={KEYS['alice']},weight=2,rate=2.8,input_len=uniform:16:48",
        "--tenant",
        f"name=bob,key={KEYS['bob']},arrival=gamma,burstiness=0.5,rate=1.6,input_len=24,prefix_len=32",
        "--output-len",
        str(OUTPUT_LEN),
        "--slo",
        "ttft=3s,tpot=500ms",
        "--out-dir",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0

    report_text = (out / "report.json").read_text()
    assert not any(key in report_text for key in KEYS.values())  # keys are never written out
    report = json.loads(report_text)
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert "| TTFT |" in (out / "report.md").read_text()
    for png in ("latency_cdf.png", "tenant_service.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert report["seed"] == 7 and report["git"]["commit"] and report["config"]["warmup_s"] == WARMUP_S
    assert report["targets"]["target"]["server_info"]["models"][0]["num_workers"] == 1

    # every request of the seeded plan (same seed -> same stream) was sent and finished OK
    config = parse_args(argv)
    plan = open_loop_plan(list(config.tenants), point_seed(7, 0), config)
    assert len(requests) == len(plan) >= 8
    assert 0 < sum(r["warmup"] for r in requests) < len(requests)  # both warm-up and measured ones
    assert all(r["status"] == "OK" for r in requests), [r["error"] for r in requests if r["status"] != "OK"]
    assert {r["tenant"] for r in requests} == {"alice", "bob"}

    # the server's own counts (Finished.usage) agree with what the client sent and received
    for r in requests:
        assert r["completion_tokens"] == sum(r["chunk_tokens"]) == OUTPUT_LEN
        assert r["prompt_tokens"] == r["input_len"]
    if metrics:  # the router's Prometheus counters over the run, warm-up included
        counters = report["points"][0]["server_counters"]
        assert counters["llm_requests_total"] == len(requests)
        assert counters["llm_prompt_tokens_total"] == sum(r["prompt_tokens"] for r in requests)
        assert counters["llm_generation_tokens_total"] == OUTPUT_LEN * len(requests)
    load = procs.worker_load(worker.address)
    assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, load.num_total_blocks)

    # the summary is the sum over the measured requests
    point = report["points"][0]
    s = point["summary"]
    measured = [r for r in requests if not r["warmup"]]
    assert (s["num_requests"], s["completed"], s["failed"]) == (len(measured), len(measured), 0)
    assert s["server_completion_tokens"] == s["client_output_tokens"] == OUTPUT_LEN * len(measured)
    assert s["server_prompt_tokens"] == sum(r["prompt_tokens"] for r in measured)
    assert point["all_requests"]["server_completion_tokens"] == OUTPUT_LEN * len(requests)
    assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["tpot_s"]["n"] == len(measured)
    assert s["itl_s"]["n"] == sum(len(r["chunk_ns"]) - 1 for r in measured)
    services = []
    for name, weight in (("alice", 2.0), ("bob", 1.0)):
        mine = [r for r in measured if r["tenant"] == name]
        assert s["tenants"][name]["completed"] == len(mine)
        services.append(sum(r["prompt_tokens"] + 2 * r["completion_tokens"] for r in mine) / weight)
        assert s["tenants"][name]["weighted_service"] == pytest.approx(services[-1])
    jain = sum(services) ** 2 / (2 * sum(x * x for x in services))
    assert s["fairness"]["jain_index"] == pytest.approx(jain)
    assert 0 <= s["goodput"]["num_good"] <= len(measured)
