"""Issue 17 item 7: workers of one model with different context limits (different --kv-cache-mb,
hence max_model_len) behind one router. Requests of every size between the two contexts and
beyond: each is served or refused INVALID_ARGUMENT, never INTERNAL, and no message carries a
worker's address. Real worker and router processes; sizes drawn with a fixed seed.
"""

from __future__ import annotations

import random

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.errors import scrub_addresses
from tests import procs

SMALL_KV_MB = 16  # about a third of TEST_KV_CACHE_MB's context
RANDOM_SIZES = 2


@pytest.fixture(scope="module")
def workers(plain_worker, logs):
    """The large context is the session's shared worker (TEST_KV_CACHE_MB, tests/conftest.py); the
    small one is this module's own. Listed large first, as the router is given them."""
    small = procs.start_worker(logs, kv_cache_mb=SMALL_KV_MB)
    try:
        procs.ready(small)
        yield plain_worker, small
    finally:
        small.stop()


def contexts(address: str) -> int:
    from protos.llm.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    return info.max_model_len


def test_heterogeneous_contexts_never_internal_never_an_address(workers, logs):
    big, small = workers
    big_len, small_len = contexts(big.address), contexts(small.address)
    assert small_len < big_len, (small_len, big_len)
    rng = random.Random(7)
    with procs.running_router(logs, [big.address, small.address]) as router:
        with grpc.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            results = []
            # the boundaries: fits both, the large one only, the large one barely, neither; then a
            # few random sizes (each served one costs a prefill of up to the large context)
            sizes = [small_len - 20, small_len + 40, big_len - 30, big_len + 10]
            sizes += [rng.randint(20, big_len + 50) for _ in range(RANDOM_SIZES)]
            for i, size in enumerate(sizes):
                max_tokens = rng.randint(2, 8)
                request = pb.GenerateRequest(
                    request_id=f"het-{i}",
                    token_ids=pb.TokenIds(ids=[1000 + (i * 31 + k) % 30000 for k in range(size)]),
                    stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
                )
                try:
                    msgs = list(stub.Generate(request, timeout=120))
                    assert msgs[-1].finished.usage.completion_tokens == max_tokens
                    results.append((size, "OK", ""))
                except grpc.RpcError as exc:
                    results.append((size, exc.code().name, exc.details()))
    print("\n" + "\n".join(f"{size:5d} tokens: {code} {details[:90]}" for size, code, details in results))
    codes = {code for _, code, _ in results}
    assert codes <= {"OK", "INVALID_ARGUMENT"}, results
    for _, _, details in results:
        for address in (big.address, small.address, "127.0.0.1"):
            assert address not in details, details
        assert scrub_addresses(details) == details, details
    # what fits the large worker only is served (there), not refused
    served = [size for size, code, _ in results if code == "OK"]
    assert any(small_len < size + 8 <= big_len for size in served) or all(
        not (small_len < size + 8 <= big_len) for size in sizes
    ), results
