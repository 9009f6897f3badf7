"""End to end through real processes: client -> router -> worker on 127.0.0.1.

Acceptance 1 (text == engine output, usage), 3 (cancel frees KV blocks within 1 s), 5 (invalid
request table), 6 (SIGTERM drain), plus deadline propagation, stop strings, logprobs and ListModels.
"""

import asyncio
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.tenants import hash_key
from tests import procs

API_KEY = "test-key-1"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
FRANCE = [pb.ChatMessage(role="user", content="What is the capital of France?")]


@pytest.fixture(scope="module")
def worker(plain_worker):
    """The session's shared worker (tests/conftest.py): default engine flags, float32."""
    return plain_worker


@pytest.fixture(scope="module")
def router(worker, logs):
    tenants = f"tenants:\n  - name: tests\n    key_sha256: {hash_key(API_KEY)}\n"
    with procs.running_router(
        logs, [worker.address], "--max-tokens-limit", "512", tenants=tenants, metadata=AUTH
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def worker_stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


@pytest.fixture(scope="module")
def engine():
    """The reference: the same engine config in this process, no gRPC in between."""
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig(dtype="float32", kv_cache_bytes=int(procs.TEST_KV_CACHE_MB * 2**20), num_threads=1)
    )
    yield engine
    engine.shutdown()


def greedy(max_tokens, logprobs=0, stop=(), **kw):
    return pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0, logprobs=logprobs),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, stop=stop),
        **kw,
    )


def collect(stub, request, **kw):
    chunks, finished = [], None
    for msg in stub.Generate(request, metadata=AUTH, **kw):
        if msg.HasField("chunk"):
            assert finished is None, "chunk after Finished"
            chunks.append(msg.chunk)
        else:
            finished = msg.finished
    assert finished is not None
    ids = [t for c in chunks for t in c.token_ids]
    return ids, "".join(c.text for c in chunks), chunks, finished


def engine_output(engine, tokenizer, prompt_ids, max_tokens):
    from worker.types import SamplingParams

    async def run():
        ids = []
        async for out in engine.generate(
            f"ref-{len(prompt_ids)}-{time.monotonic_ns()}",
            prompt_ids,
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
        ):
            ids.extend(out.new_token_ids)
        return ids

    ids = asyncio.run(run())
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["prompt", "chat", "token_ids"])
def test_stream_equals_engine_output(engine, stub, tokenizer, kind):
    text_prompt = "The three primary colors are"
    if kind == "prompt":
        request, prompt_ids = greedy(24, prompt=text_prompt), tokenizer.encode(text_prompt)
    elif kind == "chat":
        request, prompt_ids = (
            greedy(24, chat=pb.Chat(messages=FRANCE)),
            tokenizer.encode_chat([{"role": "user", "content": FRANCE[0].content}]),
        )
    else:
        prompt_ids = tokenizer.encode(text_prompt)
        request = greedy(24, token_ids=pb.TokenIds(ids=prompt_ids))
    request.request_id = f"e2e-{kind}"
    ids, text, chunks, finished = collect(stub, request)
    want_ids, want_text = engine_output(engine, tokenizer, prompt_ids, 24)
    assert ids == want_ids
    assert text == want_text and text
    assert finished.request_id == f"e2e-{kind}"
    assert finished.usage.prompt_tokens == len(prompt_ids)
    assert finished.usage.completion_tokens == len(want_ids)
    assert 0 <= finished.usage.cached_prompt_tokens < len(prompt_ids)
    ended_on_eos = want_ids[-1] in tokenizer.eos_token_ids
    assert finished.reason == (pb.FINISH_REASON_STOP if ended_on_eos else pb.FINISH_REASON_LENGTH)
    assert 0 < finished.timing.ttft_ms <= finished.timing.total_ms
    assert all(not c.logprobs for c in chunks)
    if kind == "chat":
        assert "Paris" in text


def test_stop_string_truncates_and_finishes_with_stop(engine, stub, tokenizer):
    request = greedy(24, chat=pb.Chat(messages=FRANCE), stop=[" Paris"])
    _, full_text = engine_output(
        engine, tokenizer, tokenizer.encode_chat([{"role": "user", "content": FRANCE[0].content}]), 24
    )
    _, text, _, finished = collect(stub, request)
    assert text == full_text[: full_text.index(" Paris")]
    assert finished.reason == pb.FINISH_REASON_STOP


def test_logprobs_parallel_to_tokens(stub):
    request = greedy(8, prompt="Once upon a time", logprobs=1)
    for msg in stub.Generate(request, metadata=AUTH):
        if msg.HasField("chunk") and msg.chunk.token_ids:
            assert len(msg.chunk.logprobs) == len(msg.chunk.token_ids)
            assert all(lp <= 0.0 for lp in msg.chunk.logprobs)


def test_seeded_sampling_is_reproducible(stub):
    request = pb.GenerateRequest(
        prompt="My favourite animal is",
        sampling=pb.SamplingParams(temperature=1.0, seed=7),
        stopping=pb.StoppingCriteria(max_tokens=12, ignore_eos=True),
    )
    first = collect(stub, request)[0]
    assert collect(stub, request)[0] == first and len(first) == 12


def test_list_models(stub):
    models = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    assert len(models) == 1
    assert models[0].num_workers == 1 and models[0].max_model_len > 0 and models[0].id


def test_health_and_reflection(router):
    with grpc.insecure_channel(router.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="llm.v1.Generation")
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"llm.v1.Generation", "grpc.health.v1.Health"} <= names


def test_cancel_frees_kv_blocks_within_one_second(stub, worker, worker_stub):
    request = pb.GenerateRequest(
        prompt="Count to one thousand:", stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
    )
    call = stub.Generate(request, metadata=AUTH)
    got = 0
    for msg in call:
        got += len(msg.chunk.token_ids)
        if got >= 3:
            break
    load = worker_stub.GetLoad(worker_pb2.GetLoadRequest())
    assert load.num_running == 1 and load.num_free_blocks < load.num_total_blocks
    call.cancel()
    assert procs.wait_all_blocks_free(worker.address, timeout_s=1.0)[1] < 1.0


def test_deadline_propagates_to_worker(stub, worker):
    request = pb.GenerateRequest(
        prompt="Write a long story:", stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
    )
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, request, timeout=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    procs.wait_all_blocks_free(worker.address, timeout_s=1.0)


def _invalid_table(max_model_len):
    ok = {"prompt": "hello"}
    return [
        ("missing key", {**ok}, (), grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
        (
            "wrong key",
            {**ok},
            (("authorization", "Bearer nope"),),
            grpc.StatusCode.UNAUTHENTICATED,
            "invalid API key",
        ),
        ("no input", {}, AUTH, grpc.StatusCode.INVALID_ARGUMENT, "input:"),
        ("empty prompt", {"prompt": ""}, AUTH, grpc.StatusCode.INVALID_ARGUMENT, "prompt:"),
        (
            "prompt over context",
            {"prompt": "hello " * (max_model_len + 10)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt: This model's maximum context length is {max_model_len} tokens. However, your prompt",
        ),
        (
            "prompt that no tokenization fits",
            {"prompt": "x" * (max_model_len * 100)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"characters of prompt cannot fit in {max_model_len} tokens",
        ),
        (
            "chat that no tokenization fits",
            {"chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="y" * (max_model_len * 100))])},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.messages: ",
        ),
        (
            "negative temperature",
            {**ok, "sampling": pb.SamplingParams(temperature=-1)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        (
            "top_p 0",
            {**ok, "sampling": pb.SamplingParams(top_p=0)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (
            "top_p 2",
            {**ok, "sampling": pb.SamplingParams(top_p=2)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p",
        ),
        (
            "top_k huge",
            {**ok, "sampling": pb.SamplingParams(top_k=10**6)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_k",
        ),
        (
            "max_tokens 0",
            {**ok, "stopping": pb.StoppingCriteria(max_tokens=0)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.max_tokens",
        ),
        (
            "max_tokens over limit",
            {**ok, "stopping": pb.StoppingCriteria(max_tokens=513)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.max_tokens",
        ),
        (
            "too many stops",
            {**ok, "stopping": pb.StoppingCriteria(stop=[str(i) for i in range(9)])},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.stop",
        ),
        (
            "unknown model",
            {**ok, "model": "no-such-model"},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "model: unknown model",
        ),
        (
            "token id out of vocab",
            {"token_ids": pb.TokenIds(ids=[1, 10**6])},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids.ids",
        ),
        (
            "empty token ids",
            {"token_ids": pb.TokenIds()},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids.ids",
        ),
        (
            "bad chat role",
            {"chat": pb.Chat(messages=[pb.ChatMessage(role="wizard", content="hi")])},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.messages[0].role",
        ),
        (
            "logprobs 5",
            {**ok, "sampling": pb.SamplingParams(logprobs=5)},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.logprobs",
        ),
        (
            "stop id out of vocab",
            {**ok, "stopping": pb.StoppingCriteria(stop_token_ids=[10**6])},
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
            "stopping.stop_token_ids",
        ),
    ]


def test_invalid_requests_get_status_and_message_then_server_still_serves(stub):
    max_model_len = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models[0].max_model_len
    table = _invalid_table(max_model_len)
    assert len(table) >= 15
    for name, fields, metadata, code, message in table:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=30))
        assert info.value.code() == code, (name, info.value.details())
        assert message in info.value.details(), (name, info.value.details())
    ids, text, _, finished = collect(stub, greedy(4, prompt="Still there?"))
    assert len(ids) == finished.usage.completion_tokens > 0


def test_sigterm_drains_router(worker, logs):
    """In-flight streams finish, new calls get UNAVAILABLE, exit status 0 (acceptance 6)."""
    proc = procs.start_router(logs, [worker.address])
    try:
        procs.ready(proc)
        procs.wait_for_workers(proc.address, 1)
        with grpc.insecure_channel(proc.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                prompt="List some fruits:", stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True)
            )
            started = threading.Barrier(3)
            results = [None, None]

            def stream(i):
                tokens, finished = 0, None
                for msg in stub.Generate(request, timeout=120):
                    if msg.HasField("chunk"):
                        if tokens == 0:
                            started.wait()
                        tokens += len(msg.chunk.token_ids)
                    else:
                        finished = msg.finished
                results[i] = (tokens, finished)

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            started.wait(timeout=60)
            proc.signal(signal.SIGTERM)
            procs.wait_health(proc.address, want=health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=5)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(pb.GenerateRequest(prompt="late"), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in info.value.details()
            for t in threads:
                t.join(timeout=60)
            for tokens, finished in results:
                assert tokens == 24 and finished.reason == pb.FINISH_REASON_LENGTH
                assert finished.usage.completion_tokens == 24
        assert proc.popen.wait(timeout=30) == 0
    finally:
        proc.stop()
