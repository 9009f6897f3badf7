"""Bounds that real clients can live with (issue 45, found by llama.cpp's server tests against the
OpenAI front): a prompt the context cannot hold is OpenAI's `context_length_exceeded` with its
wording ("This model's maximum context length is N tokens. However, ...") on chat, completions,
embeddings and the Responses API, for prompt + max_tokens too (gRPC: INVALID_ARGUMENT, the same
message); a 301-message agent history and a max_tokens that fits the context beyond the old 4096
cap are served; llama.cpp's `{"type": "json_object", "schema": {...}}` is that schema; chat and
completions objects and chunks carry `system_fingerprint`. Unit checks first, then one router per
module over the session's worker (tests/openai_helpers.py)."""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits, parse_args
from router.errors import ContextLengthExceeded, ValidationError, context_exceeded, status_of
from router.openai.app import api_error
from router.openai.requests import parse
from router.validation import ModelSpec, fit_to_context, validate
from tests import procs
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    KEY,
    TENANTS,
    client,
    http_url,
    post,
    router,
    stub,
    worker,
)

MAXIMUM = "maximum context length"
MODEL = ModelSpec("m", max_model_len=8192, vocab_size=49152)
MODELS = {"m": MODEL}
# KV room for SmolLM2's whole context (8,192 tokens, ~45 KB each in float32): the shared test
# worker's pool (tests/procs.py TEST_KV_CACHE_MB) holds 1,088, under the old 4,096 max_tokens cap
LONG_KV_MB = 400
# llama.cpp's documented form; a constant the model would never write unconstrained
SCHEMA = {
    "type": "object",
    "properties": {"zq_code": {"const": "XJ-42"}},
    "required": ["zq_code"],
    "additionalProperties": False,
}


# -- units ---------------------------------------------------------------------------------------
def test_context_errors_carry_openais_code_and_wording_and_stay_invalid_argument():
    alone = context_exceeded("chat.messages", 8192, 10031)
    assert isinstance(alone, ValidationError) and alone.field == "chat.messages"
    assert alone.message == (
        "chat.messages: This model's maximum context length is 8192 tokens. However, your messages "
        "resulted in 10031 tokens. Please reduce the length of the messages."
    )
    both = context_exceeded("stopping.max_tokens", 8192, 9000, 1031, noun="messages")
    assert both.message == (
        "stopping.max_tokens: This model's maximum context length is 8192 tokens. However, you "
        "requested 10031 tokens (9000 in the messages, 1031 in the completion). Please reduce the "
        "length of the messages or completion."
    )
    assert (
        "your prompt resulted in 8192 tokens, leaving no room"
        in context_exceeded("prompt", 8192, 8192).message
    )
    early = context_exceeded("stopping.max_tokens", 8192, max_tokens=9000)
    assert (
        "you requested at least 9001 tokens (9000 in the completion, at least 1 in the input)"
        in early.message
    )
    chars = context_exceeded("prompt", 100, chars=9000, chars_per_token=81)
    assert MAXIMUM in chars.message and "9000 characters of prompt cannot fit in 100 tokens" in chars.message
    code, message, _ = status_of(alone)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message == alone.message
    err = api_error(alone, parse({"messages": [{"role": "user", "content": "x"}]}, True, "r"))
    assert (err.status, err.code, err.param, err.type) == (
        400,
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )
    assert err.message.startswith("messages: This model's maximum context length is 8192 tokens.")
    assert api_error(ValidationError("stopping.stop", "too many"), None).code is None  # others: no code


def test_validation_raises_the_context_error_for_each_overflow():
    limits = Limits()
    chat = validate(
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")])), limits, MODELS
    )
    with pytest.raises(
        ContextLengthExceeded, match="^chat.messages: This model's maximum context length is 8192"
    ):
        fit_to_context(chat, 8192, limits)
    asked = validate(
        pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_tokens=6000)), limits, MODELS
    )
    assert fit_to_context(asked, 2192, limits) == 6000  # the whole context, not 4096
    with pytest.raises(ContextLengthExceeded, match=r"requested 8193 tokens \(2193 in the prompt, 6000"):
        fit_to_context(asked, 2193, limits)
    with pytest.raises(ContextLengthExceeded, match="^stopping.max_tokens: .* at least 8193 tokens"):
        validate(
            pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_tokens=8192)), limits, MODELS
        )
    with pytest.raises(ContextLengthExceeded, match="^token_ids.ids: .*your prompt resulted in 8192 tokens"):
        validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 8192)), limits, MODELS)


def test_default_limits_bound_cost_not_counts():
    limits = Limits()
    assert limits.max_tokens_limit is None and limits.max_chat_messages >= 10_000
    history = [pb.ChatMessage(role=("user", "assistant")[i % 2], content=f"turn {i}") for i in range(301)]
    valid = validate(pb.GenerateRequest(chat=pb.Chat(messages=history)), limits, MODELS)
    assert len(valid.chat) == 301
    # an operator's explicit cap still holds, and 0 on the command line means the context
    capped = Limits(max_tokens_limit=512)
    with pytest.raises(ValidationError, match="^stopping.max_tokens: must be <= 512, got 513") as err:
        validate(pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_tokens=513)), capped, MODELS)
    assert not isinstance(err.value, ContextLengthExceeded)
    assert parse_args(["--max-tokens-limit", "0"]).limits.max_tokens_limit is None
    assert parse_args(["--max-tokens-limit", "300"]).limits.max_tokens_limit == 300
    with pytest.raises(ValueError, match="default_max_tokens"):
        Limits(default_max_tokens=200, max_tokens_limit=100)


def test_json_object_with_a_schema_is_that_schema():
    llama = parse({"prompt": "x", "response_format": {"type": "json_object", "schema": SCHEMA}}, False, "r")
    assert llama.request.response_format.WhichOneof("kind") == "json_schema"
    assert json.loads(llama.request.response_format.json_schema) == SCHEMA
    openai_form = parse(
        {
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        },
        False,
        "r",
    )
    pytest.importorskip("llguidance")
    grammar = validate(llama.request, Limits(), {"": MODEL}).grammar
    assert grammar == validate(openai_form.request, Limits(), {"": MODEL}).grammar
    plain = parse({"prompt": "x", "response_format": {"type": "json_object"}}, False, "r")
    assert (
        plain.request.response_format.json_object
        and grammar != validate(plain.request, Limits(), {"": MODEL}).grammar
    )
    empty = parse({"prompt": "x", "response_format": {"type": "json_object", "schema": {}}}, False, "r")
    assert empty.request.response_format.json_object  # no schema given: any object, as before
    from router.openai.requests import ApiError

    with pytest.raises(ApiError, match="response_format: schema: must be a JSON Schema object"):
        parse({"prompt": "x", "response_format": {"type": "json_object", "schema": "[]"}}, False, "r")


# -- end to end ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def context(client) -> int:
    [card] = client.models.list().data
    return card.model_extra["max_model_len"]


def overflow(status: int, body: dict, param: str) -> None:
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error", error
    assert error["param"] == param and MAXIMUM in error["message"], error


def test_a_prompt_over_the_context_is_context_length_exceeded_everywhere(router, context):
    url = http_url(router)
    long_text = "hello " * (context + 100)  # ~1 token a word: over the context, far under the text bound
    ids = [1] * context
    chat = {"model": "", "messages": [{"role": "user", "content": long_text}], "max_tokens": 1}
    for body, path, param in [
        (chat, "/chat/completions", "messages"),
        ({**chat, "stream": True}, "/chat/completions", "messages"),  # a status, not an event
        ({"model": "", "prompt": long_text, "max_tokens": 1}, "/completions", "prompt"),
        ({"model": "", "prompt": ids, "max_tokens": 1}, "/completions", "prompt"),
        ({"model": "", "input": long_text}, "/embeddings", "input"),
        ({"model": "", "input": [ids]}, "/embeddings", "input"),
        ({"model": "", "input": long_text, "max_output_tokens": 16}, "/responses", "input"),
    ]:
        status, answer = post(url + path, json.dumps(body).encode(), KEY)
        overflow(status, answer, param)
    status, answer = post(url + "/chat/completions", json.dumps(chat).encode(), KEY)
    assert "However, your messages resulted in" in answer["error"]["message"]


def test_a_text_no_tokenization_fits_is_context_length_exceeded(router, context):
    """Refused before tokenizing (router/service.py _refuse_hopeless_text): a context overflow too."""
    url = http_url(router)
    huge = "y" * (context * 100)  # SmolLM2's longest token is 81 characters
    chat = {"model": "", "messages": [{"role": "user", "content": huge}], "max_tokens": 1}
    status, answer = post(url + "/chat/completions", json.dumps(chat).encode(), KEY)
    overflow(status, answer, "messages")
    assert f"{len(huge)} characters of messages cannot fit in {context} tokens" in answer["error"]["message"]
    status, answer = post(url + "/completions", json.dumps({"prompt": huge, "max_tokens": 1}).encode(), KEY)
    overflow(status, answer, "prompt")


def test_prompt_plus_max_tokens_over_the_context(router, stub, context):
    url = http_url(router)
    short = [{"role": "user", "content": "Say yes."}]
    body = {"model": "", "messages": short, "max_tokens": context - 3}
    status, answer = post(url + "/chat/completions", json.dumps(body).encode(), KEY)
    overflow(status, answer, "max_tokens")
    assert f"in the messages, {context - 3} in the completion" in answer["error"]["message"]
    body = {"model": "", "messages": short, "max_completion_tokens": context}  # not even one prompt token
    status, answer = post(url + "/chat/completions", json.dumps(body).encode(), KEY)
    overflow(status, answer, "max_completion_tokens")
    body = {"model": "", "input": "Say yes.", "max_output_tokens": context - 3}
    overflow(*post(url + "/responses", json.dumps(body).encode(), KEY), "max_output_tokens")
    with pytest.raises(grpc.RpcError) as err:  # gRPC: the same refusal, INVALID_ARGUMENT
        list(
            stub.Generate(
                pb.GenerateRequest(prompt="Say yes.", stopping=pb.StoppingCriteria(max_tokens=context - 1)),
                metadata=AUTH,
                timeout=60,
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and MAXIMUM in err.value.details()


@pytest.fixture(scope="module")
def long_client(logs):
    """A worker whose KV pool holds the model's whole context, and a router over it."""
    long_worker = procs.start_worker(logs, kv_cache_mb=LONG_KV_MB)
    try:
        procs.ready(long_worker)
        with procs.running_router(
            logs, [long_worker.address], "--http-port", "0", tenants=TENANTS, metadata=AUTH
        ) as long_router:
            with openai.OpenAI(base_url=http_url(long_router), api_key=KEY, max_retries=0, timeout=120) as c:
                yield c
    finally:
        long_worker.stop()


def test_a_301_message_history_and_a_max_tokens_over_4096_are_served(long_client):
    [card] = long_client.models.list().data
    context = card.model_extra["max_model_len"]
    assert context == 8192  # SmolLM2's context, whole
    # short turns (~6 tokens each with the template's markers): the prefill is what this test costs
    history = [{"role": ("user", "assistant")[i % 2], "content": "k"} for i in range(300)]
    history.append({"role": "user", "content": "Done?"})
    reply = long_client.chat.completions.create(model="", messages=history, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens > 301 * 4 and reply.choices[0].finish_reason == "length"
    # the answer is one word either way (guided_choice): 6,000 is only the bound asked for
    question = [{"role": "user", "content": "Yes or no?"}]
    choice = {"guided_choice": ["yes", "no"]}
    reply = long_client.chat.completions.create(
        model="", messages=question, max_tokens=6000, temperature=0, extra_body=choice
    )
    assert reply.choices[0].message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:  # what does not fit the context still does not
        long_client.chat.completions.create(
            model="", messages=question, max_tokens=context - 3, temperature=0, extra_body=choice
        )
    assert err.value.code == "context_length_exceeded" and MAXIMUM in err.value.message


def test_json_object_with_a_schema_constrains_to_the_schema(client):
    pytest.importorskip("llguidance")
    reply = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object", "schema": SCHEMA},
    )
    assert json.loads(reply.choices[0].message.content) == {"zq_code": "XJ-42"}


def test_chat_and_completions_objects_and_chunks_carry_system_fingerprint(router):
    url = http_url(router)
    chat = {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    text = {"model": "", "prompt": "Hi", "max_tokens": 2}
    for path, body in (("/chat/completions", chat), ("/completions", text)):
        status, whole = post(url + path, json.dumps(body).encode(), KEY)
        assert status == 200 and "system_fingerprint" in whole
        request = urllib.request.Request(
            url + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            lines = reply.read().decode().splitlines()
        events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
        assert events and all("system_fingerprint" in event for event in events)


def test_tokenize_with_pieces_gives_each_tokens_bytes(router, stub):
    base = http_url(router).removesuffix("/v1")
    text = "Hello 😀 world"  # the emoji: 4 bytes over two tokens, neither of them UTF-8 alone
    status, plain = post(f"{base}/tokenize", json.dumps({"content": text}).encode(), KEY)
    status2, answer = post(
        f"{base}/tokenize", json.dumps({"content": text, "with_pieces": True}).encode(), KEY
    )
    assert status == status2 == 200 and answer["count"] == plain["count"]
    tokens = answer["tokens"]
    assert [t["id"] for t in tokens] == plain["tokens"] and tokens[0] == {
        "id": plain["tokens"][0],
        "piece": "Hello",
    }
    split = [t["piece"] for t in tokens if isinstance(t["piece"], list)]
    assert split and all(all(0 <= b < 256 for b in piece) for piece in split)
    joined = b"".join(
        bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode() for t in tokens
    )
    assert joined.decode() == text
    body = {"messages": [{"role": "user", "content": "Hi"}], "with_pieces": True}  # a chat too
    status, chat = post(f"{base}/tokenize", json.dumps(body).encode(), KEY)
    assert status == 200 and chat["tokens"][0]["piece"] == "<|im_start|>"
    status, bad = post(f"{base}/tokenize", json.dumps({"content": text, "with_pieces": "yes"}).encode(), KEY)
    assert status == 400 and bad["error"]["param"] == "with_pieces"
    reply = stub.Tokenize(pb.TokenizeRequest(prompt=text, with_pieces=True), metadata=AUTH)  # gRPC too
    assert b"".join(reply.pieces).decode() == text and len(reply.pieces) == len(reply.token_ids)
    assert not stub.Tokenize(pb.TokenizeRequest(prompt=text), metadata=AUTH).pieces
