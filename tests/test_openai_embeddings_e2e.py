"""POST /v1/embeddings (and `sampling.pooling` over gRPC) against a real router over the session's
worker, through the official openai SDK: the vectors are the worker's pooled hidden states
L2-normalized (checked against a gRPC Generate with the same pooling), base64 (the SDK's default
encoding) decodes to the float form, a batch equals its inputs one by one, token ids equal their
text, usage counts the prompt tokens, and bad input is a 400 naming the parameter. The session
worker's KV pool is whole afterwards (plain_worker)."""

from __future__ import annotations

import base64
import json
import math
import struct

import grpc
import openai
import pytest

from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.openai.embeddings import MAX_INPUTS
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    KEY,
    LIMITED_KEY,
    PAIR_KEY,
    client,
    http_url,
    post,
    router,
    stub,
    worker,
)

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "def add(a, b): return a + b"]


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def grpc_embedding(stub, text: str, pooling: int) -> list[float]:
    vector, finished = None, None
    request = pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(pooling=pooling))
    for msg in stub.Generate(request, metadata=AUTH, timeout=120):
        if msg.HasField("chunk") and msg.chunk.embedding:
            assert vector is None, "sent once"
            vector = list(msg.chunk.embedding)
        elif msg.HasField("finished"):
            finished = msg.finished
    assert finished is not None and finished.usage.completion_tokens <= 1
    return vector


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_the_workers_pooled_states_normalized(client, stub, pooling):
    raw = grpc_embedding(stub, TEXTS[1], pb.POOLING_LAST if pooling == "last" else pb.POOLING_MEAN)
    reply = client.embeddings.create(
        model="", input=TEXTS[1], encoding_format="float", extra_body={"pooling": pooling}
    )
    [item] = reply.data
    assert item.index == 0 and reply.object == "list" and reply.model
    assert abs(norm(item.embedding) - 1) < 1e-5
    assert close(item.embedding, [x / norm(raw) for x in raw])
    unnormalized = client.embeddings.create(
        model="", input=TEXTS[1], encoding_format="float", extra_body={"pooling": pooling, "normalize": False}
    )
    assert close(unnormalized.data[0].embedding, raw, 1e-3 * norm(raw))


def test_batches_base64_token_ids_and_usage(client, router):
    tokenizer = Tokenizer.from_model(default_model_path())
    ones = [client.embeddings.create(model="", input=t, encoding_format="float") for t in TEXTS]
    batch = client.embeddings.create(model="", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in batch.data] == [0, 1, 2]
    for one, item in zip(ones, batch.data):
        assert close(one.data[0].embedding, item.embedding)
    counts = [len(tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(counts)
    ids = client.embeddings.create(
        model="", input=[tokenizer.encode(t, add_special_tokens=True) for t in TEXTS], encoding_format="float"
    )
    for one, item in zip(ones, ids.data):
        assert close(one.data[0].embedding, item.embedding)
    status, raw = post(
        f"{http_url(router)}/embeddings",
        json.dumps({"input": TEXTS[0], "encoding_format": "base64"}).encode(),
        KEY,
    )
    assert status == 200
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), ones[0].data[0].embedding, 1e-6)
    last, mean = (
        client.embeddings.create(model="", input=TEXTS[0], encoding_format="float", extra_body={"pooling": p})
        for p in ("last", "mean")
    )
    assert not close(last.data[0].embedding, mean.data[0].embedding)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "input", "input: required"),
        ({"input": ""}, "input", "input: must not be an empty string"),
        ({"input": []}, "input", "input: must not be empty"),
        ({"input": ["a", ""]}, "input", "input[1]: must not be an empty string"),
        ({"input": ["a", 3]}, "input", "input[1]: must be a string or a list of token ids, got int"),
        ({"input": [[1, 2], []]}, "input", "input[1]: must not be an empty list of token ids"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"input: at most {MAX_INPUTS} inputs"),
        ({"input": [[1, 10**9]]}, "input", "input[0]: token id 1000000000 is outside the vocabulary"),
        ({"input": ["ok", "word " * 9000]}, "input", "input[1]:"),
        ({"input": "a", "dimensions": 64}, "dimensions", "dimensions: not supported"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format: must be float"),
        ({"input": "a", "pooling": "max"}, "pooling", "pooling: must be last or mean"),
        ({"input": "a", "pooling": ["mean"]}, "pooling", "pooling: must be last or mean"),
        ({"input": 7}, "input", "input: must be a string, a list of strings, or token ids, got int"),
        ({"input": "a", "normalize": "yes"}, "normalize", "normalize: must be a boolean"),
        ({"input": "a", "model": "gpt-9"}, "model", "model: unknown model"),  # 404 model_not_found
    ],
)
def test_bad_embedding_requests_are_400_naming_the_parameter(router, body, param, message):
    status, reply = post(f"{http_url(router)}/embeddings", json.dumps(body).encode(), KEY)
    assert status == (404 if param == "model" else 400), reply
    assert reply["error"]["param"] == param and reply["error"]["message"].startswith(message), reply


def test_bad_key_and_grpc_pooling_limits(client, router, stub):
    with openai.OpenAI(base_url=http_url(router), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.embeddings.create(model="", input="x")
    request = pb.GenerateRequest(
        prompt="x",
        sampling=pb.SamplingParams(pooling=pb.POOLING_MEAN),
        stopping=pb.StoppingCriteria(max_tokens=2),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, metadata=AUTH, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("stopping.max_tokens: must be 1 (or unset) with sampling.pooling")


def test_batches_fit_the_tenants_limits(router):
    """Each input is one request to admission: a tenant with max_concurrency 2 gets a batch of 5
    through two at a time; a batch larger than a tenant's request burst (1) could never be admitted
    whole, a 400 saying so (not a 429 whose Retry-After cannot help)."""
    url = f"{http_url(router)}/embeddings"
    status, reply = post(url, json.dumps({"input": TEXTS + TEXTS[:2]}).encode(), PAIR_KEY)
    assert status == 200 and [d["index"] for d in reply["data"]] == [0, 1, 2, 3, 4], reply
    status, reply = post(url, json.dumps({"input": TEXTS[:2]}).encode(), LIMITED_KEY)
    assert status == 400 and reply["error"]["param"] == "input", reply
    assert "more than the 1 requests tenant limited may send at once" in reply["error"]["message"]
