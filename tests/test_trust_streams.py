"""Issue 17 item 2: clients that never read their stream hold nothing for long.

Real processes: a worker that runs 2 sequences at once (--max-num-seqs 2) and a router with a 1 s
stream idle timeout. A tenant opens 2 x max_num_seqs streams with a small HTTP/2 window and never
reads them (so the router's writes to it stall once the window is full). Another tenant's request
with a 10 s deadline completes; every stalled stream ends after the idle timeout
(DEADLINE_EXCEEDED on the router), and every KV block of the worker is then free. Worker-side backpressure
(a bounded per-stream buffer) is checked on the worker directly: a reader that stops reading stops
its sequence's generation.
"""

from __future__ import annotations

import time

import grpc
import pytest

from common.auth import METADATA_KEY
from devtools.stalled_client import StalledClient
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.tenants import hash_key
from tests import procs

MAX_NUM_SEQS = 2
IDLE_S = 1.0  # the router's
# Longer than the control call of the backpressure test takes (CONTROL_TOKENS decode steps, about
# 1 s on a busy 2-vCPU machine, ~3.5 s with the connect and prefill), which must end while the
# stalled call is still parked: 5 s was exceeded once (a fresh-clone CI on a Zen 3 running 1.5x
# slower than usual, 2026-12-02), so 10.
WORKER_IDLE_S = 10.0
CONTROL_TOKENS = 20  # an unthrottled 8-token prompt would pass its first 16-token block within them
TOKEN = "streams-test-token"
TENANTS = f"""
tenants:
  - name: staller
    key_sha256: "{hash_key("staller-key")}"
  - name: good
    key_sha256: "{hash_key("good-key")}"
"""
# A client that never reads: a small stream window, no window growth (BDP probing off).
STALLED_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def worker(logs):
    with procs.running_workers(
        logs,
        1,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--worker-token",
        TOKEN,
        "--stream-idle-timeout-s",
        str(WORKER_IDLE_S),
        "--stream-buffer-messages",
        "4",
        "--num-threads",
        "1",  # on a shared 2-vCPU machine OpenMP barriers under CPU steal make 2 threads ~10x slower
    ) as started:
        yield started[0]


def load(address: str) -> worker_pb2.LoadReport:
    return procs.worker_load(address, ((METADATA_KEY, TOKEN),))


def wait_all_free(address: str, timeout_s: float) -> worker_pb2.LoadReport:
    return procs.wait_all_blocks_free(address, timeout_s, ((METADATA_KEY, TOKEN),))[0]


def idle_endings(router: procs.Proc) -> float:
    """Requests the router ended as deadline_exceeded (the stream idle timeout's status)."""
    return sum(
        value
        for (name, labels), value in procs.scrape(router).items()
        if name == "llm_requests_total" and ("status", "deadline_exceeded") in labels
    )


def request(request_id: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[1000 + i for i in range(8)]),
        sampling=pb.SamplingParams(temperature=0.0, logprobs=1),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def test_stalled_readers_end_after_the_idle_timeout_and_free_every_block(worker, logs):
    with procs.running_router(
        logs,
        [worker.address],
        "--stream-idle-timeout-s",
        str(IDLE_S),
        "--worker-token",
        TOKEN,
        tenants=TENANTS,
        metadata=(("authorization", "Bearer good-key"),),
    ) as router:
        with grpc.insecure_channel(router.address) as channel:  # warm-up: first calls pay one-off costs
            good = (("authorization", "Bearer good-key"),)
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request("warm", 2), metadata=good))
        staller = (("authorization", "Bearer staller-key"),)
        client = StalledClient(router.address)
        streams = [
            client.open_stream(
                "/llm.v1.Generation/Generate", request(f"stall-{i}", 400).SerializeToString(), staller, 300
            )
            for i in range(2 * MAX_NUM_SEQS)
        ]  # never read: the router cannot send them a byte
        try:
            with grpc.insecure_channel(router.address) as channel:
                start = time.monotonic()
                msgs = list(
                    generation_pb2_grpc.GenerationStub(channel).Generate(
                        request("good", 4), metadata=(("authorization", "Bearer good-key"),), timeout=10
                    )
                )
                good_s = time.monotonic() - start
            assert msgs[-1].finished.usage.completion_tokens == 4
            # Each stalled call ends on the router (its handler observed as deadline_exceeded).
            # The HTTP/2 stream itself stays half-open until the client's connection closes: gRPC
            # queues the status behind the response bytes this client refuses to take.
            deadline = time.monotonic() + 60
            while (idle := idle_endings(router)) < len(streams):
                assert time.monotonic() < deadline, f"{idle} of {len(streams)} stalled streams ended"
                time.sleep(0.2)  # polling the router's /metrics; no event to wait on across processes
            report = wait_all_free(worker.address, 30)
            print(f"\ngood request {good_s:.2f} s beside {len(streams)} stalled streams; {report}")
        finally:
            client.close()


def test_worker_stops_generating_for_a_reader_that_stops_reading(worker):
    """Backpressure on the worker: a direct call (with the token) whose reader never takes a byte.
    Its sequence stops after about `--stream-buffer-messages` tokens (an 8-token prompt then stays
    within its first 16-token KV block) instead of running on towards max_tokens = 900, and it
    keeps its slot until the worker's idle timeout aborts it. The proof that it stopped: a second
    call read normally runs CONTROL_TOKENS decode steps beside it (the worker batches both), in
    which an unthrottled sequence would have grown past its first block."""
    client = StalledClient(worker.address)
    try:
        message = worker_pb2.WorkerRequest(
            request_id="backpressure",
            prompt_token_ids=[1000 + i for i in range(8)],
            sampling=worker_pb2.WorkerSampling(max_tokens=900, top_p=1.0, ignore_eos=True),
        ).SerializeToString()
        client.open_stream("/llm.v1.Worker/Generate", message, ((METADATA_KEY, TOKEN),), 300)
        deadline = time.monotonic() + 30
        while load(worker.address).num_running == 0:
            assert time.monotonic() < deadline, "the stalled call never started"
            time.sleep(0.05)  # polling another process's state
        control = worker_pb2.WorkerRequest(
            request_id="control",
            prompt_token_ids=[5000 + i for i in range(8)],
            sampling=worker_pb2.WorkerSampling(max_tokens=CONTROL_TOKENS, top_p=1.0, ignore_eos=True),
        )
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            outputs = list(stub.Generate(control, metadata=((METADATA_KEY, TOKEN),), timeout=60))
        assert sum(len(out.token_ids) for out in outputs) == CONTROL_TOKENS
        deadline = time.monotonic() + 10
        # the worker updates its load report just after a step's outputs go out: poll for the
        # report that no longer counts the control call
        while (report := load(worker.address)).num_running > 1:
            assert time.monotonic() < deadline, f"the control call never left: {report}"
            time.sleep(0.05)  # polling another process's state
        # parked, not finished: it still holds its slot (and, below, its one block)
        assert report.num_running == 1, f"the stalled call ended before the control call did: {report}"
        used = report.num_total_blocks - report.num_free_blocks  # the control's blocks are free again
        assert used == 1, f"the sequence kept generating for a reader that takes nothing: {report}"
        wait_all_free(worker.address, 30)  # the worker's idle timeout (WORKER_IDLE_S) ends it
    finally:
        client.close()
