"""OpenAI JSON -> GenerateRequest (pure): what each parameter becomes, each bad one named in a 400;
the validator's protobuf field names mapped back to OpenAI's; the router's HTTP flags and their
public-bind rule; the error mapping of domain errors to HTTP statuses; the HTTP call context (API
key, trace parent, peer) the gRPC pipeline reads."""

from __future__ import annotations

import dataclasses

import pytest

from protos.llm.v1 import generation_pb2 as pb
from router.config import RouterConfig, parse_args
from router.errors import AuthError, Overloaded, Unavailable, ValidationError
from router.openai.app import api_error
from router.openai.requests import ApiError, param_of, parse
from router.openai.responses import Responder

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_becomes_the_protobuf():
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        ],
        "model": "m",
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "END",
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 4,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"12": -100, "7": 2.5},
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "top_k": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": 2,
        "user": "ignored",
    }
    p = parse(body, chat=True, request_id="r1")
    r = p.request
    assert [(m.role, m.content) for m in r.chat.messages] == [("system", "be brief"), ("user", "hello")]
    assert (r.request_id, r.model, r.priority) == ("r1", "m", 2)
    s = r.sampling
    assert (s.temperature, s.seed, s.logprobs, s.top_logprobs, s.top_k) == (0.5, 3, 1, 4, 20)
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert s.repetition_penalty == pytest.approx(1.2)
    assert dict(s.logit_bias) == {12: -100.0, 7: 2.5}
    assert (list(r.stopping.stop), r.stopping.max_tokens) == (["END"], 7)
    assert (p.stream, p.include_usage, p.logprobs, p.top_logprobs) == (True, True, True, 4)
    assert p.max_tokens_param == "max_completion_tokens"


def test_completion_prompts_and_defaults():
    text = parse({"prompt": "abc"}, chat=False, request_id="r")
    assert text.request.prompt == "abc" and not text.request.sampling.HasField("temperature")
    assert not text.request.stopping.HasField("max_tokens") and not text.logprobs
    ids = parse({"prompt": [[5, 6, 7]], "logprobs": 0, "ignore_eos": True}, chat=False, request_id="r")
    assert list(ids.request.token_ids.ids) == [5, 6, 7] and ids.request.stopping.ignore_eos
    assert (ids.logprobs, ids.top_logprobs, ids.request.sampling.logprobs) == (True, 0, 1)
    assert parse({"prompt": ["one"]}, chat=False, request_id="r").request.prompt == "one"
    assert parse({"prompt": "x", "top_k": -1}, chat=False, request_id="r").request.sampling.top_k == 0


def test_choices_share_their_prompts_protobuf_prompt_major_with_seed_plus_j():
    one = parse({"prompt": "a", "seed": 5}, chat=False, request_id="r")
    assert [c.request_id for c in one.choices] == ["r"] and one.request is one.prompt_requests[0]
    batch = parse({"prompt": ["a", [7, 8]], "n": 2, "seed": 2**64 - 1}, chat=False, request_id="r")
    assert [c.request_id for c in batch.choices] == ["r-0", "r-1", "r-2", "r-3"] and batch.n == 2
    assert [(c.prompt, c.seed_offset) for c in batch.choices] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(batch.prompt_requests) == 2  # one protobuf per prompt, never one per choice
    assert batch.request_of(1) is batch.request_of(0) and batch.request_of(0).prompt == "a"
    assert [list(batch.request_of(i).token_ids.ids) for i in (2, 3)] == [[7, 8], [7, 8]]
    assert all(r.sampling.seed == 2**64 - 1 for r in batch.prompt_requests)  # + j: service.ChoiceOf
    chat = parse({**CHAT, "n": 3, "temperature": 0.5}, chat=True, request_id="c")
    assert len(chat.choices) == 3 and chat.prompt_requests == [chat.request]
    assert chat.request.sampling.temperature == 0.5
    assert not chat.request.sampling.HasField("seed")  # unseeded: the worker draws


def test_a_choice_takes_its_own_request_id_and_seed_plus_j_wrapping():
    from router.config import Limits
    from router.fanout import ChoiceOf, Fanout
    from router.validation import ModelSpec, ValidRequest

    req = ValidRequest(request_id="r", model=ModelSpec("m", 64, 100), prompt="a", seed=2**64 - 1)
    fanout = Fanout()
    assert ChoiceOf(fanout, "r-1", 1).applied(req, Limits()).seed == 0  # wraps
    assert ChoiceOf(fanout, "r-0", 0).applied(req, Limits()).request_id == "r-0"
    unseeded = dataclasses.replace(req, seed=None)
    assert ChoiceOf(fanout, "r-2", 2).applied(unseeded, Limits()).seed is None
    with pytest.raises(ValidationError, match="request_id"):
        ChoiceOf(fanout, "r" * 130, 1).applied(req, Limits())


def test_bounds_are_checked_on_the_json_before_any_protobuf():
    from router.config import Limits

    bias = {"logit_bias": {str(i): 1.0 for i in range(301)}}
    with pytest.raises(ApiError, match="logit_bias: at most 300 entries, got 301"):
        parse({**CHAT, **bias}, chat=True, request_id="r")
    with pytest.raises(ApiError, match="stop: at most 8 stop strings, got 9"):
        parse({"prompt": "a", "stop": ["x"] * 9}, chat=False, request_id="r")
    with pytest.raises(ApiError, match="messages: at most 2 messages, got 3"):
        parse({"messages": [{"role": "user", "content": "x"}] * 3}, True, "r", Limits(max_chat_messages=2))
    with pytest.raises(ApiError, match="stop_token_ids: at most 64"):
        parse({"prompt": "a", "stop_token_ids": list(range(65))}, chat=False, request_id="r")


def test_usage_counts_each_prompt_once_and_offsets_are_per_choice():
    parsed = parse({"prompt": ["a", "b"], "n": 2, "logprobs": 0}, chat=False, request_id="r")
    responder = Responder(parsed, "m", lambda token_id: "xy")
    dones = [
        pb.Finished(usage=pb.Usage(prompt_tokens=p, completion_tokens=c, cached_prompt_tokens=k))
        for p, c, k in ((3, 1, 0), (3, 2, 3), (5, 4, 0), (5, 8, 5))
    ]
    chunk = pb.TokenChunk(token_ids=[1, 2], text="xyxy", logprobs=[-1.0, -2.0])
    body = responder.complete([([chunk], d) for d in dones])
    assert body["usage"]["prompt_tokens"] == 8 and body["usage"]["completion_tokens"] == 15
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["logprobs"]["text_offset"] == [0, 2] for c in body["choices"])


def test_echo_of_a_choice_ended_before_its_prompt_was_scored_is_an_error():
    """A worker that ends a choice before its first token sends no prompt logprobs: a 503 (or the
    stream's error event), never a 200 whose prompt logprobs are missing."""
    parsed = parse({"prompt": "ab", "echo": True, "logprobs": 1}, chat=False, request_id="r")
    done = pb.Finished(reason=pb.FINISH_REASON_CANCELLED)
    with pytest.raises(Unavailable, match="before its prompt was scored"):
        Responder(parsed, "m", lambda ids: "x").complete([([], done)])
    with pytest.raises(Unavailable):
        Responder(parsed, "m", lambda ids: "x").finish_choice(done, 0)
    plain = parse({"prompt": "ab", "echo": True}, chat=False, request_id="r")  # no logprobs: the text
    assert Responder(plain, "m", str).complete([([], done)])["choices"][0]["text"] == "ab"


@pytest.mark.parametrize(
    "body, chat, param",
    [
        ([], False, None),
        ({"prompt": ["a", 5]}, False, "prompt"),
        ({"prompt": ["a", [1, -2]]}, False, "prompt"),
        ({"prompt": 5}, False, "prompt"),
        ({"prompt": [1, -2]}, False, "prompt"),
        ({}, True, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "messages[0].content[0]",
        ),
        ({**CHAT, "temperature": "hot"}, True, "temperature"),
        ({**CHAT, "temperature": True}, True, "temperature"),
        ({**CHAT, "max_tokens": 0}, True, "max_tokens"),
        ({**CHAT, "max_tokens": 1.5}, True, "max_tokens"),
        ({**CHAT, "seed": -(2**63) - 1}, True, "seed"),  # below int64 (-1 is vLLM's any int64)
        ({**CHAT, "continue_final_message": True}, True, "continue_final_message"),
        ({**CHAT, "add_generation_prompt": False}, True, "add_generation_prompt"),
        ({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, True, "chat_template_kwargs"),
        ({**CHAT, "stop": [1]}, True, "stop"),
        ({**CHAT, "logit_bias": {"a": 1}}, True, "logit_bias"),
        ({**CHAT, "logit_bias": {"1": "x"}}, True, "logit_bias"),
        ({**CHAT, "top_logprobs": 3}, True, "top_logprobs"),
        ({"prompt": "x", "logprobs": 21}, False, "logprobs"),
        ({**CHAT, "n": 0}, True, "n"),
        ({**CHAT, "n": 17}, True, "n"),
        ({"prompt": ["a"] * 5, "n": 4}, False, "n"),
        ({**CHAT, "tools": [{"type": "function"}]}, True, "tools[0].function"),
        ({**CHAT, "functions": [{"name": "f"}]}, True, "functions"),
        ({**CHAT, "response_format": {"type": "grammar"}}, True, "response_format"),
        (
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            True,
            "response_format",
        ),
        ({**CHAT, "response_format": "json"}, True, "response_format"),
        ({"prompt": "x", "echo": "yes"}, False, "echo"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),  # 0 only with echo
        ({"prompt": "x", "best_of": 2}, False, "best_of"),
        ({**CHAT, "stream_options": {"include_usage": True}}, True, "stream_options"),
        ({**CHAT, "stop_token_ids": [-1]}, True, "stop_token_ids"),
        ({**CHAT, "presence_penalty": float("inf")}, True, "presence_penalty"),
        ({**CHAT, "priority": 2**40}, True, "priority"),
        ({**CHAT, "top_k": 2**40}, True, "top_k"),
        ({**CHAT, "max_tokens": 2**40}, True, "max_tokens"),
        ({**CHAT, "seed": 2**64}, True, "seed"),
        ({"prompt": [1, 2**40]}, False, "prompt"),
        ({**CHAT, "stop_token_ids": [2**33]}, True, "stop_token_ids"),
        ({**CHAT, "logit_bias": {str(2**40): 1}}, True, "logit_bias"),
    ],
)
def test_bad_parameters_are_named(body, chat, param):
    with pytest.raises(ApiError) as info:
        parse(body, chat=chat, request_id="r")
    assert info.value.status == 400 and info.value.param == param
    if param:
        assert info.value.message.startswith(f"{param}: ")


def test_echo_scores_the_prompt_with_logprobs():
    plain = parse({"prompt": "x", "echo": True}, chat=False, request_id="r")
    assert plain.echo and not plain.echo_only and not plain.request.sampling.HasField("prompt_logprobs")
    scored = parse({"prompt": [1, 2], "echo": True, "logprobs": 3}, chat=False, request_id="r")
    assert scored.request.sampling.prompt_logprobs == 3 and scored.request.sampling.top_logprobs == 3
    assert param_of("sampling.prompt_logprobs", scored) == "logprobs"
    # lm-evaluation-harness's loglikelihood: max_tokens 0 -> one token asked for, left out of the answer
    only = parse({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0}, chat=False, request_id="r")
    assert only.echo_only and only.request.stopping.max_tokens == 1
    chat = parse({**CHAT, "echo": True, "logprobs": True}, chat=True, request_id="r")
    assert not chat.echo and not chat.request.sampling.HasField("prompt_logprobs")  # completions only


@pytest.mark.parametrize(
    "field, chat, body, param",
    [
        ("sampling.top_p", True, CHAT, "top_p"),
        ("sampling.top_logprobs", True, CHAT, "top_logprobs"),
        ("sampling.top_logprobs", False, {"prompt": "x"}, "logprobs"),
        ("stopping.max_tokens", True, {**CHAT, "max_completion_tokens": 5}, "max_completion_tokens"),
        ("stopping.max_tokens", False, {"prompt": "x", "max_tokens": 5}, "max_tokens"),
        ("stopping.stop[1]", True, CHAT, "stop[1]"),
        ("chat.messages[2].role", True, CHAT, "messages[2].role"),
        ("chat.messages", True, CHAT, "messages"),
        ("token_ids.ids", False, {"prompt": [1]}, "prompt"),
        ("model", True, CHAT, "model"),
    ],
)
def test_validator_fields_map_to_openai_parameters(field, chat, body, param):
    assert param_of(field, parse(body, chat=chat, request_id="r")) == param


def test_domain_errors_become_http_statuses():
    parsed = parse({**CHAT, "max_completion_tokens": 9}, chat=True, request_id="r")
    bad = api_error(ValidationError("stopping.max_tokens", "must be <= 4"), parsed)
    assert (bad.status, bad.param, bad.message) == (
        400,
        "max_completion_tokens",
        "max_completion_tokens: must be <= 4",
    )
    auth = api_error(AuthError("invalid API key"), None)
    assert (auth.status, auth.code) == (401, "invalid_api_key")
    busy = api_error(Overloaded("tenant t: rate", retry_after_ms=1500), None)
    assert busy.status == 429 and busy.headers == {"Retry-After": "2", "retry-after-ms": "1500"}
    assert api_error(Unavailable("no healthy worker"), None).status == 503
    lost = api_error(Unavailable("worker 10.0.0.5:50061 was lost mid-stream after 3 tokens"), None)
    assert lost.status == 503 and "10.0.0.5" not in lost.message and "<worker>" in lost.message
    internal = api_error(KeyError("secret detail"), None)
    assert internal.status == 500 and "secret" not in internal.message
    assert set(internal.body()["error"]) == {"message", "type", "param", "code"}


def test_http_flags_and_the_public_bind_rule():
    assert (RouterConfig().http_host, RouterConfig().http_port) == ("127.0.0.1", None)
    assert parse_args(["--http-port", "-1"]).http_port == -1
    assert parse_args(["--http-port", "0"]).http_port == 0
    with pytest.raises(SystemExit):
        parse_args(["--http-port", "70000"])
    public = RouterConfig(http_host="0.0.0.0")
    assert "0.0.0.0" in public.public_bind_refusal() and "--tenants" in public.public_bind_refusal()
    assert RouterConfig(http_host="0.0.0.0", http_port=-1).public_bind_refusal() is None
    assert RouterConfig(http_host="0.0.0.0", allow_insecure_public=True).public_bind_refusal() is None


@pytest.mark.parametrize(
    "client, peer, loopback",
    [
        (("127.0.0.1", 5000), "ipv4:127.0.0.1:5000", True),
        (("::1", 5001), "ipv6:[::1]:5001", True),
        (("10.1.2.3", 80), "ipv4:10.1.2.3:80", False),
    ],
)
def test_http_call_context_carries_what_the_pipeline_reads(client, peer, loopback):
    from starlette.requests import Request

    from router.openai.app import HttpCallContext
    from router.tenants import is_loopback_peer

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", b"Bearer k1"), (b"traceparent", parent.encode()), (b"x-other", b"1")],
        "client": client,
    }
    ctx = HttpCallContext(Request(scope))
    assert ctx.invocation_metadata() == (("authorization", "Bearer k1"), ("traceparent", parent))
    assert ctx.peer() == peer and is_loopback_peer(ctx.peer()) is loopback
    assert ctx.time_remaining() is None


def test_unreadable_bodies_are_400():
    import asyncio

    from starlette.requests import Request

    from router.openai.http import read_json as _read_json

    def read(body: bytes, limit: int = 1 << 20):
        parts = [body[i : i + 1000] for i in range(0, len(body), 1000)] or [b""]
        messages = [
            {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
        ]

        async def receive():
            return messages.pop(0)

        return asyncio.run(_read_json(Request({"type": "http", "headers": []}, receive), limit))

    assert read(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for body in (b"{nope", b"\xff\xfe", b"[" * 100_000):  # the last one nests deeper than the parser goes
        with pytest.raises(ApiError) as info:
            read(body)
        assert info.value.status == 400 and "not valid JSON" in info.value.message
    with pytest.raises(ApiError) as info:
        read(b" " * 5000, limit=4096)
    assert info.value.status == 413


def test_overhead_benchmark_runs():
    from benchmarks.openai_overhead import main

    figures = main(["--n", "20"])
    assert set(figures) == {"parse_us", "sse_chunk_us", "sse_chunk_top5_us", "whole_64_us"}
    assert all(us > 0 for us in figures.values())


def test_choices_end_when_a_pipeline_cancels_itself_and_close_every_call():
    """A choice whose pipeline raises CancelledError of its own (a worker call cancelled under it)
    fails the request with 503 instead of leaving the reader of the other choices waiting."""
    import asyncio

    from router.errors import Unavailable
    from router.openai.choices import Choices

    closed = []

    async def call(i: int, cancel: bool):
        try:
            yield pb.TokenChunk(token_ids=[i], text=str(i))
            if cancel:
                raise asyncio.CancelledError()
            await asyncio.sleep(3600)  # never ends by itself: aclose must cancel it
        finally:
            closed.append(i)

    async def main():
        choices = Choices([call(0, False), call(1, True)])
        await choices.start()
        seen = []
        with pytest.raises(Unavailable, match="cancelled"):
            async for event in choices.events():
                seen.append(event)
        await choices.aclose()
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 10))
    assert sorted(i for i, _ in seen) == [0, 1] and sorted(closed) == [0, 1]
