"""The OpenAI-compatible HTTP front's errors, end to end (split from tests/test_openai_e2e.py; the
same stack, tests/openai_helpers.py): the official `openai` SDK's error classes for 400 (naming
the parameter, no traceback), 401 (the key not echoed) and 429 (with Retry-After), raw bodies
that are not JSON or a batch with a prompt of the wrong type, unknown routes and methods as
OpenAI error objects, and the router's per-protocol request counter."""

from __future__ import annotations

import json

import openai
import pytest

from protos.llm.v1 import generation_pb2 as pb
from tests import procs
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    FRANCE,
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


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(top_p=5), "top_p"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(max_tokens=100_000), "max_tokens"),
        (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(n=17), "n"),
        (dict(extra_body={"min_p": 2}), "min_p"),
        (dict(stop=["ok"] * 9), "stop"),
    ],
)
def test_invalid_requests_are_400_naming_the_parameter(client, kwargs, param):
    args = dict(model="", messages=FRANCE, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    assert info.value.param == param and info.value.body["message"].startswith(f"{param}: ")
    assert "Traceback" not in info.value.body["message"]


def test_an_unknown_model_is_404_model_not_found(client):
    """As OpenAI and vLLM answer (the client raises NotFoundError), and GET /v1/models/{id} here."""
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=FRANCE, max_tokens=4)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert info.value.param == "model" and info.value.body["message"].startswith("model: unknown model")


def test_bad_body_and_bad_prompt_in_a_batch_are_400(router):
    url = http_url(router)
    bad_status, bad = post(f"{url}/completions", b"{not json", KEY)
    batch_status, batch = post(f"{url}/completions", json.dumps({"prompt": ["a", {"b": 1}]}).encode(), KEY)
    assert (bad_status, batch_status) == (400, 400)
    assert "not valid JSON" in bad["error"]["message"] and batch["error"]["param"] == "prompt"
    missing_status, missing = post(f"{url}/assistants", b"{}", KEY)  # not served: an OpenAI error too
    method_status, method = post(f"{url}/models", b"{}", KEY)
    assert (missing_status, method_status) == (404, 405)
    assert missing["error"]["message"].startswith("POST /v1/assistants") and "message" in method["error"]


def test_bad_key_is_401_and_a_refusal_is_429_with_retry_after(router):
    url = http_url(router)
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model="", prompt="hi", max_tokens=1)
        assert info.value.status_code == 401 and "wrong" not in info.value.message
    with openai.OpenAI(base_url=url, api_key=LIMITED_KEY, max_retries=0) as limited:
        limited.completions.create(model="", prompt="hi", max_tokens=1)  # the bucket's one request
        with pytest.raises(openai.RateLimitError) as info:
            limited.completions.create(model="", prompt="hi", max_tokens=1, stream=True)
    headers = info.value.response.headers
    assert info.value.status_code == 429 and int(headers["retry-after"]) >= 1
    assert int(headers["retry-after-ms"]) > 0


def test_requests_are_counted_by_protocol(client, stub, router):
    client.completions.create(model="", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt="hi", top_p=5)
    grpc_generate(stub, AUTH, prompt="hi", stopping=pb.StoppingCriteria(max_tokens=1))
    samples = procs.scrape(router)
    by = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "llm_router_requests_by_protocol_total"
    }
    http = sum(v for labels, v in by.items() if ("protocol", "http") in labels)
    grpc_count = sum(v for labels, v in by.items() if ("protocol", "grpc") in labels)
    assert http >= 1 and grpc_count >= 1
    assert by[(("protocol", "http"), ("status", "invalid_argument"))] >= 1
