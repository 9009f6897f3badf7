"""POST /v1/responses (router/openai/responses_api.py) through the official openai SDK's
`client.responses.create`, against a real router and the session's worker: the text equals the
chat endpoint's for the same greedy request (the same pipeline), a stream's deltas add up to the
whole response and its events come in the Responses order, instructions and message lists reach
the template, `max_output_tokens` cuts to an incomplete response, `text.format` constrains it, and
what this server does not do is a 400 naming the parameter."""

from __future__ import annotations

import json

import openai
import pytest

from tests.openai_helpers import (  # noqa: F401 - client, router, worker: the shared stack's fixtures
    FRANCE,
    KEY,
    client,
    http_url,
    post,
    router,
    worker,
)


def test_a_response_is_the_chat_answer(client):
    chat = client.chat.completions.create(model="", messages=FRANCE, max_tokens=16, temperature=0)
    response = client.responses.create(
        model="", input=FRANCE[0]["content"], max_output_tokens=16, temperature=0
    )
    assert response.object == "response" and response.output_text == chat.choices[0].message.content
    assert response.status == "completed" and response.output[0].role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    listed = client.responses.create(
        model="",
        instructions="You are a geography teacher.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": FRANCE[0]["content"]}]}],
        max_output_tokens=16,
        temperature=0,
    )
    with_system = client.chat.completions.create(
        model="",
        messages=[{"role": "system", "content": "You are a geography teacher."}, *FRANCE],
        max_tokens=16,
        temperature=0,
    )
    assert listed.output_text == with_system.choices[0].message.content


def test_a_stream_adds_up_to_the_response(client):
    whole = client.responses.create(
        model="", input="Name three colours.", max_output_tokens=24, temperature=0
    )
    kinds, text, final = [], "", None
    with client.responses.create(
        model="", input="Name three colours.", max_output_tokens=24, temperature=0, stream=True
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{final.status}",
    ]
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_output_tokens_and_text_format(client):
    cut = client.responses.create(model="", input="Tell me a long story.", max_output_tokens=4, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    shaped = client.responses.create(
        model="",
        input=FRANCE[0]["content"],
        max_output_tokens=32,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    assert set(json.loads(shaped.output_text)) == {"capital"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "background": True}, "background"),
        ({}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "instructions": 3}, "instructions"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": "abc"}, "text"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
        # checked by the service after parsing (protobuf field names mapped back to this API's)
        ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),
        ({"input": ""}, "input"),
        ({"input": "word " * 9000}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 1}}}}, "text.format"),
    ],
)
def test_what_this_server_does_not_do_is_a_400_naming_it(router, body, param):
    status, reply = post(f"{http_url(router)}/responses", json.dumps(body).encode(), KEY)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(f"{param}: ")


def test_a_bad_key_is_401(router):
    with openai.OpenAI(base_url=http_url(router), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model="", input="x")


def _builder():
    from router.openai.responses_api import ResponseBuilder, parse_responses

    return ResponseBuilder(parse_responses({"input": "x"}, "r1"), "m", None)


def test_a_server_cancel_is_a_failed_response_and_a_stream_failure_ends_failed():
    import asyncio

    from protos.llm.v1 import generation_pb2 as pb
    from router.errors import Unavailable
    from router.openai.requests import ApiError

    cancelled = pb.Finished(reason=pb.FINISH_REASON_CANCELLED)
    whole = _builder().whole([pb.TokenChunk(text="Hal")], cancelled)
    assert whole["status"] == "failed" and whole["output"][0]["status"] == "incomplete"

    async def events():
        yield 0, pb.TokenChunk(text="Hel")
        raise Unavailable("the worker was lost")

    async def collect() -> list[dict]:
        error_of = lambda exc: ApiError(503, str(exc), type_="service_unavailable")  # noqa: E731
        return [
            json.loads(data.decode().split("data: ", 1)[1])
            async for data in _builder().stream(events(), error_of)
        ]

    got = asyncio.run(collect())
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert got[-1]["response"]["status"] == "failed" and "lost" in got[-1]["response"]["error"]["message"]


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_function_tools_whole_streamed_and_in_the_history(client):
    """Responses' flat function tools: a required call comes back as a function_call item (whole and
    streamed: the item, its arguments, done), and a history with the call and its output renders as
    the chat endpoint's tool_calls and tool messages do (the same greedy answer)."""
    ask = "What is the weather in Paris?"
    whole = client.responses.create(
        model="", input=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0
    )
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Berlin")
    kinds, arguments, final = [], "", None
    with client.responses.create(
        model="",
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        stream=True,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
            if event.type == "response.completed":
                final = event.response
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    [streamed] = final.output
    assert streamed.arguments == arguments == call.arguments and streamed.name == call.name
    history = [
        {"role": "user", "content": ask},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"},
    ]
    answered = client.responses.create(
        model="", input=history, tools=[WEATHER], max_output_tokens=24, temperature=0
    )
    chat = client.chat.completions.create(
        model="",
        messages=[
            {"role": "user", "content": ask},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        max_tokens=24,
        temperature=0,
    )
    assert answered.output_text == (chat.choices[0].message.content or "")


def _events_of(body: dict, pieces: list[str], reason=None) -> tuple[list[dict], dict]:
    """(the stream's events, `whole()`'s response) for `pieces` of generated text."""
    import asyncio

    from protos.llm.v1 import generation_pb2 as pb
    from router.openai.responses_api import ResponseBuilder, parse_responses

    parsed = parse_responses({"input": "x", **body}, "r")
    done = pb.Finished(reason=reason or pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3))

    async def events():
        for piece in pieces:
            yield 0, pb.TokenChunk(text=piece)
        yield 0, done

    async def collect():
        builder = ResponseBuilder(parsed, "m", None)
        return [json.loads(d.decode().split("data: ", 1)[1]) async for d in builder.stream(events(), str)]

    whole = ResponseBuilder(parsed, "m", None).whole([pb.TokenChunk(text="".join(pieces))], done)
    return asyncio.run(collect()), whole


@pytest.mark.parametrize(
    "pieces",
    [
        [
            "Let me check. ",
            '<tool_call>{"name": "get_weather", ',
            '"arguments": {"city": "Paris"}}</tool_call>',
        ],
        ["  ", "\n"],
        ["Just text."],
    ],
    ids=["text-then-call", "whitespace", "text"],
)
def test_streamed_items_equal_whole_and_close_in_order(pieces):
    from openai.types.responses import Response

    got, whole = _events_of({"tools": [WEATHER]}, pieces)
    final = got[-1]["response"]
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final["output"]) == strip(whole["output"])
    Response.model_validate(final)
    open_items = 0
    for event in got:  # an item is closed before the next one is added
        if event["type"] == "response.output_item.added":
            assert open_items == 0
            open_items += 1
        elif event["type"] == "response.output_item.done":
            open_items -= 1
    assert open_items == 0


def test_input_items_and_the_names_of_their_errors(router):
    from router.openai.responses_input import parse_responses

    turn = parse_responses(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "Let me check."},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [WEATHER],
            "tool_choice": "auto",
        },
        "r",
    )
    messages = turn.request.chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]  # one assistant turn: text + calls
    assert messages[1].content == "Let me check." and [c.id for c in messages[1].tool_calls] == ["c1", "c2"]
    assert parse_responses({"input": "q", "tool_choice": "auto"}, "r").tools is None  # no tools: fine
    url = f"{http_url(router)}/responses"
    for body, param in (
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        ({"input": "q", "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
        (
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "[1]"},
                ],
                "instructions": "be brief",
                "tools": [WEATHER],
            },
            "input[1].arguments",
        ),
    ):
        status, reply = post(url, json.dumps(body).encode(), KEY)
        assert status == 400 and reply["error"]["param"] == param, reply
