"""Tokenize / Detokenize (gRPC) and POST /tokenize, /detokenize, GET /v1/models/{id} (HTTP) against a
real router over the session's worker: the ids are those Generate sees (a chat's count equals the
generation's usage.prompt_tokens, tools included), detokenizing gives the rendered prompt back, and
bad input is INVALID_ARGUMENT / 400 naming the field, a bad key 401."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    KEY,
    LIMITED_KEY,
    client,
    grpc_generate,
    http_url,
    post,
    router,
    stub,
    worker,
)
from tests.test_chat_tools import CONVERSATION, WEATHER


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model(default_model_path())


def test_grpc_tokenize_gives_generates_ids_and_detokenize_the_text(stub, tokenizer):
    [card] = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    reply = stub.Tokenize(pb.TokenizeRequest(prompt="Hello there"), metadata=AUTH)
    assert reply.model == card.id and reply.max_model_len == card.max_model_len
    assert list(reply.token_ids) == tokenizer.encode("Hello there", add_special_tokens=True)
    bare = stub.Tokenize(pb.TokenizeRequest(prompt="Hello there", add_special_tokens=False), metadata=AUTH)
    assert list(bare.token_ids) == tokenizer.encode("Hello there")
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="user", content="What is the weather in Paris?")],
        tools=[pb.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"]))],
    )
    ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat), metadata=AUTH).token_ids)
    _, finished = grpc_generate(stub, AUTH, chat=chat, stopping=pb.StoppingCriteria(max_tokens=1))
    assert len(ids) == finished.usage.prompt_tokens
    text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), metadata=AUTH).text
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(grpc.RpcError) as err:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 10**6]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(
        "token_ids:"
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(prompt="x", model="gpt-9"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("model:")
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(prompt="x"), metadata=(("authorization", "Bearer wrong"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_tokenize_counts_what_the_chat_completion_counts(router, client, tokenizer):
    base = http_url(router).removesuffix("/v1")
    body = {"messages": CONVERSATION, "tools": [WEATHER]}
    status, tokenized = post(f"{base}/tokenize", json.dumps(body).encode(), KEY)
    reply = client.chat.completions.create(model="", max_tokens=1, **body)
    assert status == 200 and tokenized["count"] == len(tokenized["tokens"]) == reply.usage.prompt_tokens
    status, llama_form = post(f"{base}/tokenize", json.dumps({"content": "Hello"}).encode(), KEY)
    assert status == 200 and llama_form["tokens"] == tokenizer.encode("Hello", add_special_tokens=True)
    status, text = post(f"{base}/detokenize", json.dumps({"tokens": llama_form["tokens"]}).encode(), KEY)
    assert status == 200 and text["prompt"] == text["content"] == tokenizer.decode(llama_form["tokens"])


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"nothing": 1}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),  # model_not_found
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * 100_000}, 400, "tokens"),  # more than the model's context
        ("/tokenize", {"prompt": "\ud800"}, 400, None),  # a lone surrogate: no protobuf string
        ("/tokenize", {"content": 5}, 400, "content"),  # llama.cpp's field named as sent
    ],
)
def test_http_token_errors_name_the_parameter(router, path, body, status, param):
    got, answer = post(http_url(router).removesuffix("/v1") + path, json.dumps(body).encode(), KEY)
    assert (got, answer["error"]["param"]) == (status, param), answer


def test_token_calls_take_the_tenants_admission_claim(stub, router):
    """The limited tenant (a burst of one, then 0.001 per second): one call, then 429 / RESOURCE_EXHAUSTED."""
    limited = (("authorization", f"Bearer {LIMITED_KEY}"),)
    stub.Tokenize(pb.TokenizeRequest(prompt="x"), metadata=limited)
    with pytest.raises(grpc.RpcError) as err:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), metadata=limited)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.value.details()
    got, _ = post(http_url(router).removesuffix("/v1") + "/tokenize", b'{"prompt": "x"}', LIMITED_KEY)
    assert got == 429


def test_llama_cpp_form_adds_no_bos_unless_asked(router, tokenizer):
    base = http_url(router).removesuffix("/v1")
    _, plain = post(f"{base}/tokenize", json.dumps({"content": "Hi"}).encode(), KEY)
    _, special = post(f"{base}/tokenize", json.dumps({"content": "Hi", "add_special": True}).encode(), KEY)
    assert plain["tokens"] == tokenizer.encode("Hi") and special["tokens"] == tokenizer.encode("Hi", True)


def test_http_token_endpoints_need_the_key(router):
    base = http_url(router).removesuffix("/v1")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        got, answer = post(base + path, json.dumps(body).encode(), "wrong-key")
        assert got == 401 and answer["error"]["type"] == "authentication_error"


def test_sdk_retrieves_a_model_and_a_missing_one_is_404(client):
    [listed] = client.models.list().data
    assert client.models.retrieve(listed.id).id == listed.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no/such-model")
