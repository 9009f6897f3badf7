"""Tool calling end to end: the official openai SDK against a real router and worker (the embedded
SmolLM2, whose ChatML template has no place for tools: the router writes them into the system
message).

Checked: tool_choice "required" and a named function constrain the answer to calls of the listed
functions whose arguments are instances of their schemas (finish_reason tool_calls / stop); a
streamed answer merged as the SDK's accumulator does equals the whole answer (required, named,
auto); the router's span counts the tools; a conversation with the assistant's calls and the
tools' results renders to the prompt the router's tokenizer gives (usage.prompt_tokens), the same
over gRPC; bad tools are 400s naming the parameter.
"""

from __future__ import annotations

import json

import openai
import pytest

from common.model_files import default_model_path
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.chat_validation import validate_chat
from router.config import Limits
from router.openai.requests import parse
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    client,
    grpc_generate,
    router,
    stub,
    worker,
)
from tests.test_chat_tools import CONVERSATION, TIME, WEATHER

pytest.importorskip("llguidance")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = {"get_weather", "get_time"}


def _merged(stream) -> tuple[str | None, list[dict], str]:
    """A streamed chat answer merged as the SDK's accumulator does: (content, calls, finish)."""
    content, calls, finish = None, {}, None
    stream = iter(stream)
    opening = next(stream).choices[0].delta
    assert opening.role == "assistant" and opening.content is None  # (OpenAI's opening for tools)
    for chunk in stream:
        [choice] = chunk.choices
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            merged = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            merged["name"] += call.function.name or ""
            merged["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _whole(message) -> tuple[str | None, list[dict]]:
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    return message.content, calls


def _same(whole: list[dict], streamed: list[dict]) -> bool:
    """The same calls (ids are drawn for each answer)."""
    return [(c["name"], c["arguments"]) for c in whole] == [(c["name"], c["arguments"]) for c in streamed]


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert isinstance(args.get("city"), str) and set(args) <= {"city", "unit"}, args
    assert args.get("unit", "C") in ("C", "F")


def test_required_calls_listed_functions_with_schema_arguments_streamed_or_not(client, sink):
    request = dict(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96)
    reply = client.chat.completions.create(**request, extra_headers={"X-Request-Id": "tools-required-1"})
    [choice] = reply.choices
    content, calls = _whole(choice.message)
    assert choice.finish_reason == "tool_calls" and content is None and calls
    for call in calls:
        assert call["name"] in NAMES and call["id"].startswith("call_")
        if call["name"] == "get_weather":
            _check_weather(call["arguments"])
        else:
            assert isinstance(json.loads(call["arguments"]), dict)
    s_content, s_calls, s_finish = _merged(client.chat.completions.create(**request, stream=True))
    assert (s_content, s_finish) == (None, "tool_calls") and _same(calls, s_calls)

    def mine(spans):
        return [
            s
            for s in spans
            if s.attributes.get("llm.request_id") == "tools-required-1" and not s.parent_span_id
        ]

    [span] = mine(sink.wait_for(lambda spans: bool(mine(spans)), timeout_s=30))
    assert span.attributes["llm.tools"] == 2 and span.attributes["llm.response_format"] == "json_schema"


def test_a_named_function_is_called_and_its_arguments_stream(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64)
    reply = client.chat.completions.create(**request)
    content, [call] = _whole(reply.choices[0].message)
    assert content is None and call["name"] == "get_weather" and reply.choices[0].finish_reason == "stop"
    _check_weather(call["arguments"])
    chunks = list(client.chat.completions.create(**request, stream=True))
    pieces = [
        c.choices[0].delta.tool_calls[0].function.arguments for c in chunks if c.choices[0].delta.tool_calls
    ]
    assert len(pieces) > 2 and "".join(pieces) == call["arguments"]  # the arguments came as generated
    assert _merged(chunks)[1][0]["name"] == "get_weather"


def test_auto_answers_stream_as_they_come_whole(client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        request = dict(model="", messages=messages, tools=[WEATHER, TIME], max_tokens=48)
        reply = client.chat.completions.create(**request)
        content, calls = _whole(reply.choices[0].message)
        assert reply.choices[0].finish_reason == ("tool_calls" if calls else reply.choices[0].finish_reason)
        assert all(c["name"] in NAMES for c in calls) and (content or calls)
        s_content, s_calls, s_finish = _merged(client.chat.completions.create(**request, stream=True))
        assert (s_content, s_finish) == (content, reply.choices[0].finish_reason) and _same(calls, s_calls)


def test_a_conversation_with_tool_results_renders_as_the_tokenizer_says(client, stub):
    reply = client.chat.completions.create(model="", messages=CONVERSATION, tools=[WEATHER], max_tokens=8)
    chat = parse({"messages": CONVERSATION, "tools": [WEATHER]}, chat=True, request_id="r").request.chat
    valid = validate_chat(chat, Limits())
    prompt = Tokenizer.from_model(default_model_path()).encode_chat(valid["chat"], tools=valid["tools"])
    assert reply.usage.prompt_tokens == len(prompt)
    _, finished = grpc_generate(stub, AUTH, chat=chat, stopping=pb.StoppingCriteria(max_tokens=1))
    assert finished.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_parameter(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "", "messages": ASK, "max_tokens": 4, **extra})
    assert info.value.param == param and info.value.body["message"].startswith(param)
