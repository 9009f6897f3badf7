"""Hostile input (issue 9) through real router and worker processes: every call ends with a
Finished message or an expected status, never UNKNOWN or INTERNAL.

2. End to end: ~150 seeded hostile calls (bad metadata, raw undecodable bytes and tiny deadlines
   included) against a router and one worker; the status distribution is printed. The router must
   stay alive and SERVING, log no traceback, and leave every KV block of the worker free.
3. gRPC max message size: a router started with --max-message-mb 1 answers a larger request with
   RESOURCE_EXHAUSTED before parsing it, and keeps serving; the default router refuses > 16 MiB.

Found by this file: raw request bytes that do not parse (invalid UTF-8 in a string field, a
truncated varint) ended as UNKNOWN "Unexpected <class DecodeError>" from grpc itself; the router's
ErrorInterceptor now answers INVALID_ARGUMENT `request: not a valid protobuf message`.
In-process property tests and atheris: tests/test_fuzz_input.py.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.tenants import hash_key
from router.validation import CHAT_ROLES
from tests import procs
from tests.test_fuzz_input import FIELD, LIMITS, NASTY, UINT32, VOCAB

# ---------------------------------------------------------------- 2. end to end

FUZZ_KEY, TIGHT_KEY, WRONG_KEY = "fuzz-key-5b1d", "tight-key-90aa", "wrong-key-77c3"
TENANTS = f"""
tenants:
  - name: fuzz
    key_sha256: {hash_key(FUZZ_KEY)}
  - name: tight
    key_sha256: {hash_key(TIGHT_KEY)}
    max_concurrency: 1
"""
AUTH = (("authorization", f"Bearer {FUZZ_KEY}"),)
NUM_CALLS = 150
SEED = 9
# PERMISSION_DENIED: a priority above the tenant's max_priority (router/tenants.py)
ALLOWED = {
    "OK",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "DEADLINE_EXCEEDED",
    "PERMISSION_DENIED",
}


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker (tests/conftest.py)."""
    return plain_worker


def keyed_router(logs, worker, *extra):
    return procs.running_router(logs, [worker.address], *extra, tenants=TENANTS, metadata=AUTH)


@pytest.fixture(scope="module")
def router(logs, worker):
    with keyed_router(logs, worker, "--default-max-tokens", "4") as proc:  # unset max_tokens: quick
        yield proc


def rand_text(rng: random.Random, big: bool = False) -> str:
    r = rng.random()
    if r < 0.3:
        return "".join(rng.choice(NASTY) for _ in range(rng.randint(0, 30)))
    if r < 0.5:
        return "".join(
            chr(rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
            for _ in range(rng.randint(1, 60))
        )
    if r < 0.7 or big:
        piece = rng.choice(NASTY + ["ab", "word "])
        limit = 1_200_000 if big else 3000
        return piece * rng.randint(0, limit // len(piece))
    return " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(rng.randint(1, 80)))


def rand_id(rng: random.Random) -> int:
    return rng.choice(
        [rng.randrange(VOCAB), rng.randrange(VOCAB), VOCAB - 1, VOCAB, UINT32, rng.randrange(2**32)]
    )


def hostile_request(rng: random.Random, model: str, i: int) -> pb.GenerateRequest:
    """Each field hostile one time in twenty (the text always may be), so that about half the
    requests pass validation; valid ones ask for at most 4 tokens."""

    def field(sane, *hostile):
        return rng.choice(hostile) if rng.random() < 0.05 else sane

    req = pb.GenerateRequest(
        request_id=field(f"fuzz-{i}", "", "a b", "x" * 129, "\x00", rand_text(rng)[:150]),
        model=field(rng.choice(["", model]), "gpt-9", rand_text(rng)[:50]),
        priority=field(rng.randint(-1, 3), 2**31 - 1, -(2**31)),
    )
    kind = field(rng.choice(["prompt", "prompt", "chat", "token_ids"]), None)
    if kind == "prompt":
        req.prompt = rand_text(rng, big=rng.random() < 0.05)
    elif kind == "chat":
        req.chat.SetInParent()
        for _ in range(field(rng.randint(1, 4), 0, LIMITS.max_chat_messages + 1)):
            req.chat.messages.add(
                role=field(rng.choice(CHAT_ROLES), "", "tool", "User", "\x00"), content=rand_text(rng)
            )
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        num = field(rng.choice([1, 16, 200, 600]), 0, 1084, 1088, 4000)
        req.token_ids.ids.extend(field(rng.randrange(VOCAB), rand_id(rng)) for _ in range(num))
    s = req.sampling
    if (
        temperature := field(
            rng.choice([None, 0.0, 0.7, 1.0]), -0.0, -1.0, math.nan, math.inf, -math.inf, 3.4e38, 1e-45
        )
    ) is not None:
        s.temperature = temperature
    if (top_p := field(rng.choice([None, 1.0, 0.9]), 0.0, -0.0, 1.5, math.nan, math.inf, 1e-45)) is not None:
        s.top_p = top_p
    s.top_k = field(rng.choice([0, 0, 1, 50]), VOCAB, VOCAB + 1, UINT32)
    if rng.random() < 0.2:
        s.seed = rng.choice([0, 1, 2**64 - 1])
    s.logprobs = field(rng.randint(0, 1), 2, UINT32)
    stop = req.stopping
    if (max_tokens := field(rng.choice([None, 1, 2, 4]), 0, 4097, UINT32)) is not None:
        stop.max_tokens = max_tokens
    num_stops = field(rng.choice([0, 0, 1, 2]), 8, 9, 200)
    stop.stop.extend(
        field(rng.choice(["the", "\n", "\x00", "x" * 64, rand_text(rng)[:60] or "a"]), "", "x" * 65)
        for _ in range(num_stops)
    )
    num_stop_ids = field(rng.choice([0, 0, 1, 4]), 64, 65)
    stop.stop_token_ids.extend(field(rng.randrange(VOCAB), VOCAB, UINT32) for _ in range(num_stop_ids))
    stop.ignore_eos = rng.random() < 0.5
    return req


def hostile_metadata(rng: random.Random) -> tuple[tuple[str, str | bytes], ...]:
    auth = rng.choices(
        [
            [f"Bearer {FUZZ_KEY}"],
            [f"Bearer {TIGHT_KEY}"],
            [],
            [f"Bearer {WRONG_KEY}"],
            ["Bearer"],
            ["Bearer "],
            [f"Basic {FUZZ_KEY}"],
            [f"bearer   {FUZZ_KEY}  "],
            [f"Bearer {FUZZ_KEY}", f"Bearer {WRONG_KEY}"],
            ["Bearer " + "k" * 20_000],
            ["Bearer " + "k" * 3000],
        ],
        weights=[70, 10, 2, 2, 1, 1, 1, 1, 2, 1, 1],
    )[0]
    md = [("authorization", value) for value in auth]
    extras = [
        ("x-tenant", "tight"),
        ("tenant", "tight"),
        ("traceparent", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"),
        ("traceparent", "ff-zz"),
        ("traceparent", "x" * 4000),
        ("tracestate", ",,,=,"),
        ("x-junk-bin", bytes(rng.randrange(256) for _ in range(64))),
    ]
    md += rng.sample(extras, rng.choice([0, 0, 1, 3]))
    return tuple(md)


def hostile_bytes(rng: random.Random, model: str, i: int) -> bytes:
    r = rng.random()
    if r < 0.3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if r < 0.5:
        return b"\x1a\x04\xff\xfe\xc3\x28"  # prompt (field 3) that is not UTF-8
    data = bytearray(hostile_request(rng, model, i).SerializeToString())
    if r < 0.8 and data:
        del data[rng.randrange(len(data)) :]  # truncated
    for _ in range(rng.randint(1, 4)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


async def outcome(call, streaming: bool) -> tuple[str, str]:
    """(status name, details): OK only when a stream ended with exactly one Finished, last."""
    finished = False
    try:
        if not streaming:
            await call
            return "OK", ""
        async for msg in call:
            assert not finished, "a message after Finished"
            finished = msg.HasField("finished")
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    return ("OK", "") if finished else ("NO_FINISHED", "")


def assert_healthy(router) -> None:
    assert router.popen.poll() is None, router.log_tail()
    procs.wait_health(router.address, router, timeout_s=10)
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=2))
        msgs = list(stub.Generate(req, metadata=AUTH, timeout=60))
    assert msgs[-1].HasField("finished") and msgs[-1].finished.usage.completion_tokens >= 1


def test_hostile_requests_end_to_end(router, worker):
    with grpc.insecure_channel(router.address) as channel:
        model = (
            generation_pb2_grpc.GenerationStub(channel)
            .ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=10)
            .models[0]
            .id
        )
    rng = random.Random(SEED)
    calls = []
    for i in range(NUM_CALLS):
        r = rng.random()
        method = "Generate" if r < 0.95 else "ListModels"
        raw = rng.random() < 0.12
        payload = (
            (hostile_bytes(rng, model, i) if method == "Generate" else b"\x0a\x01\xff")
            if raw
            else (hostile_request(rng, model, i) if method == "Generate" else pb.ListModelsRequest())
        )
        timeout = rng.uniform(0.001, 0.3) if rng.random() < 0.12 else 30.0
        calls.append((method, raw, payload, hostile_metadata(rng), timeout))
    results: collections.Counter[str] = collections.Counter()
    fields: collections.Counter[str] = collections.Counter()  # INVALID_ARGUMENT by field

    async def main():
        limit = asyncio.Semaphore(4)
        async with grpc.aio.insecure_channel(router.address) as channel:

            def callable_for(method, raw):
                serialize = (lambda b: b) if raw else (lambda m: m.SerializeToString())
                path = f"/llm.v1.Generation/{method}"
                if method == "Generate":
                    return channel.unary_stream(
                        path,
                        request_serializer=serialize,
                        response_deserializer=pb.GenerateResponse.FromString,
                    )
                return channel.unary_unary(
                    path, request_serializer=serialize, response_deserializer=pb.ListModelsResponse.FromString
                )

            async def one(method, raw, payload, metadata, timeout):
                async with limit:
                    call = callable_for(method, raw)(payload, metadata=metadata, timeout=timeout)
                    status, details = await outcome(call, streaming=method == "Generate")
                    results[status] += 1
                    if status == "INVALID_ARGUMENT":
                        assert FIELD.match(details), details
                        fields[details.split(":")[0].split("[")[0]] += 1

            await asyncio.gather(*(one(*c) for c in calls))

    start = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - start
    print(
        f"\n{NUM_CALLS} hostile calls in {elapsed:.1f} s (seed {SEED}): {dict(results.most_common())}; "
        f"INVALID_ARGUMENT by field: {dict(fields.most_common())}"
    )
    bad = {k: v for k, v in results.items() if k not in ALLOWED}
    assert not bad, (bad, router.log_tail())
    assert results["OK"] >= 10 and results["INVALID_ARGUMENT"] >= 30, results  # the mix reached both sides
    load, _ = procs.wait_all_blocks_free(worker.address)
    assert_healthy(router)
    log = router.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "unhandled error" not in log, router.log_tail()
    print(f"worker KV blocks free after the run: {load.num_free_blocks}/{load.num_total_blocks}")


# ---------------------------------------------------------------- 3. gRPC max message size


def send_prompt(address: str, num_chars: int, timeout_s: float = 60.0) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            list(
                stub.Generate(
                    pb.GenerateRequest(prompt="a" * num_chars, stopping=pb.StoppingCriteria(max_tokens=1)),
                    metadata=AUTH,
                    timeout=timeout_s,
                )
            )
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_max_message_size_refuses_larger_requests_and_keeps_serving(router, worker, logs):
    with keyed_router(logs, worker, "--max-message-mb", "1") as small:
        over = send_prompt(small.address, 1_100_000)
        under = send_prompt(small.address, 900_000)  # fits the message, not the model's context
        assert over == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert under == grpc.StatusCode.INVALID_ARGUMENT
        assert_healthy(small)
    default_over = send_prompt(router.address, 17 * 2**20)  # the 16 MiB default
    assert default_over == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_healthy(router)
    print(
        f"\n--max-message-mb 1: 1.1 MB prompt -> {over.name}, 0.9 MB -> {under.name}; "
        f"default router, 17 MiB -> {default_over.name}"
    )
