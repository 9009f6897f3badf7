"""Tool calling without servers: the prompt a chat with tools renders to, and the request checks
of tools, tool_choice and tool messages (reading the answers: tests/test_tool_answers.py).

- A tool-aware template (Qwen2.5's, tests/tiny_models.py) renders the router's validated messages and tools to
  exactly transformers' text for the same OpenAI conversation (tool calls, tool results).
- A template without tools (ChatML, SmolLM2's) gets the Hermes tool prompt in its system message
  and the calls / results as text, written out literally here.
"""

from __future__ import annotations

import json

import pytest

from common.chat_tools import TOOL_SYSTEM_PROMPT, TemplateFeatures, template_call_id
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.chat_validation import validate_chat
from router.config import Limits
from router.errors import ValidationError
from router.openai.requests import ApiError, param_of, parse
from router.openai.tools import ToolMode
from tests.tiny_models import CHATML_TEMPLATE, QWEN25_TEMPLATE, write_tokenizer_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
AUTO = ToolMode("auto", ("get_weather", "get_time"))  # the mode of a request offering both
CONVERSATION = [  # OpenAI's form: arguments as JSON text
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "4 C, rain"},
]
LIMITS = Limits(max_chat_messages=16, max_prompt_chars=10_000)


def _validated(body: dict) -> dict:
    """The OpenAI body through the front's parser and the router's validation, as the service
    renders it."""
    parsed = parse(body, chat=True, request_id="r")
    return validate_chat(parsed.request.chat, LIMITS)


def _ours(template: str, tmp_path, valid: dict) -> str:
    write_tokenizer_dir("qwen2", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_pretrained_dir(tmp_path).apply_chat_template(valid["chat"], tools=valid["tools"])


def test_a_tool_aware_template_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    valid = _validated({"messages": CONVERSATION, "tools": [WEATHER, TIME]})
    ours = _ours(QWEN25_TEMPLATE, tmp_path, valid)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    history = [  # transformers takes the arguments as objects (as vLLM passes them)
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in CONVERSATION
    ]
    expected = theirs.apply_chat_template(
        history, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True
    )
    assert ours == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in ours
    assert TemplateFeatures.of(QWEN25_TEMPLATE) == TemplateFeatures(tools=True, tool_calls=True)


def test_a_template_without_tools_gets_them_in_the_system_message(tmp_path):
    valid = _validated({"messages": CONVERSATION, "tools": [WEATHER]})
    ours = _ours(CHATML_TEMPLATE, tmp_path, valid)
    tools = json.dumps(WEATHER, ensure_ascii=False)
    assert TemplateFeatures.of(CHATML_TEMPLATE) == TemplateFeatures(tools=False, tool_calls=False)
    assert ours == (
        f"<|im_start|>system\nYou are terse.\n\n{TOOL_SYSTEM_PROMPT.format(tools=tools)}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n4 C, rain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no system message: one is added in front; no tools: the conversation as before
    alone = _validated({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    assert _ours(CHATML_TEMPLATE, tmp_path, alone).startswith("<|im_start|>system\n# Tools\n")
    plain = _validated({"messages": [{"role": "user", "content": "hi"}]})
    assert plain["tools"] == () and _ours(CHATML_TEMPLATE, tmp_path, plain) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# Checks call ids as Mistral v0.3's template does (9 alphanumerics, else raise_exception) and
# writes them next to each call and result.
NINE_CHAR_IDS_TEMPLATE = (
    "{%- if tools %}[TOOLS {{ tools|length }}]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls is defined and message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[CALL {{ tool_call.function.name }} {{ tool_call.id }}]"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id|length != 9 %}{{- raise_exception('bad id') }}{%- endif %}"
    "[RESULT {{ message.tool_call_id }} {{ message.content }}]"
    "{%- else %}[{{ message.role }} {{ message.content }}]{%- endif %}"
    "{%- endfor %}"
)


def test_call_ids_mapped_for_a_template_that_takes_nine_characters(tmp_path):
    """Our `call_<24 hex>` ids and a client's short ones, sent back in a later turn, are given to
    a 9-character template as 9 alphanumerics, the same on a call and on its result."""
    ours = "call_" + "ab12" * 6
    conversation = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": ours, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": ours, "content": "18 C"},
        {"role": "tool", "tool_call_id": "Ab3dE6gH9", "content": "noon"},
    ]
    features = TemplateFeatures.of(NINE_CHAR_IDS_TEMPLATE)
    assert features.call_id_length == 9 and TemplateFeatures.of(QWEN25_TEMPLATE).call_id_length is None
    text = _ours(
        NINE_CHAR_IDS_TEMPLATE, tmp_path, _validated({"messages": conversation, "tools": [WEATHER, TIME]})
    )
    mapped = template_call_id(ours, 9)
    assert len(mapped) == 9 and mapped.isalnum() and mapped == template_call_id(ours, 9)
    assert template_call_id("Ab3dE6gH9", 9) == "Ab3dE6gH9"  # one that fits is kept
    assert text == (
        "[TOOLS 2][user Weather in Paris and Oslo?]"
        f"[CALL get_weather {mapped}][CALL get_time Ab3dE6gH9]"
        f"[RESULT {mapped} 18 C][RESULT Ab3dE6gH9 noon]"
    )


def test_tool_choice_puts_the_call_schema_on_the_request():
    messages = [{"role": "user", "content": "hi"}]
    auto = parse({"messages": messages, "tools": [WEATHER, TIME]}, chat=True, request_id="r")
    assert auto.tools == AUTO and [t.name for t in auto.request.chat.tools] == ["get_weather", "get_time"]
    assert not auto.request.HasField("response_format")
    assert json.loads(auto.request.chat.tools[0].parameters) == WEATHER["function"]["parameters"]
    none = parse({"messages": messages, "tools": [WEATHER], "tool_choice": "none"}, chat=True, request_id="r")
    assert none.tools is None and not none.request.chat.tools
    named = parse(
        {
            "messages": messages,
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        chat=True,
        request_id="r",
    )
    assert named.tools == ToolMode("named", AUTO.names, "get_weather")
    schema = json.loads(named.request.response_format.json_schema)
    assert schema.pop("x-guidance") == {"whitespace_flexible": False}  # compact JSON
    assert schema == WEATHER["function"]["parameters"]
    required = parse(
        {
            "messages": messages,
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        chat=True,
        request_id="r",
    )
    schema = json.loads(required.request.response_format.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and schema["x-guidance"] == {"whitespace_flexible": False}
    assert all(item["additionalProperties"] is False for item in schema["items"]["anyOf"])
    assert param_of("response_format.json_schema", required) == "tools"


BAD_REQUESTS = [
    ({"tools": {"x": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
        "tools[0].function.parameters",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [1], "tool_choice": "none"}, "tools[0]"),  # checked even when not shown
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
        "messages[0].tool_calls[0].function.arguments",
    ),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_tool_requests_are_400_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as err:
        parse({"messages": [{"role": "user", "content": "hi"}], **body}, chat=True, request_id="r")
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_completions_refuse_tools():
    with pytest.raises(ApiError) as err:
        parse({"prompt": "hi", "tools": [WEATHER]}, chat=False, request_id="r")
    assert err.value.param == "tools"


def _chat(*messages: pb.ChatMessage, tools=()) -> pb.Chat:
    return pb.Chat(messages=list(messages), tools=list(tools))


USER = pb.ChatMessage(role="user", content="hi")
BAD_CHATS = [
    (_chat(USER, tools=[pb.Tool(name="get weather")]), "chat.tools[0].name", "tools[0].function.name"),
    (
        _chat(USER, tools=[pb.Tool(name="f"), pb.Tool(name="f")]),
        "chat.tools[1].name",
        "tools[1].function.name",
    ),
    (
        _chat(USER, tools=[pb.Tool(name="f", parameters="[1]")]),
        "chat.tools[0].parameters",
        "tools[0].function.parameters",
    ),
    (_chat(USER, tools=[pb.Tool(name=f"f{i}") for i in range(129)]), "chat.tools", "tools"),
    (
        _chat(pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f", arguments="{}")])),
        "chat.messages[0].tool_calls",
        "messages[0].tool_calls",
    ),
    (
        _chat(pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="{")])),
        "chat.messages[0].tool_calls[0].arguments",
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        _chat(pb.ChatMessage(role="user", content="x", tool_call_id="c1")),
        "chat.messages[0].tool_call_id",
        "messages[0].tool_call_id",
    ),
    (_chat(USER, tools=[pb.Tool(name="f", description="x" * 10_000)]), "chat.messages", "messages"),
    (  # nested deeper than a schema needs: a pretty-printing template would write it quadratically
        _chat(USER, tools=[pb.Tool(name="f", parameters='{"a": ' * 65 + "1" + "}" * 65)]),
        "chat.tools[0].parameters",
        "tools[0].function.parameters",
    ),
]


@pytest.mark.parametrize("chat,field,param", BAD_CHATS)
def test_bad_chats_name_their_field(chat, field, param):
    with pytest.raises(ValidationError) as err:
        validate_chat(chat, LIMITS)
    assert err.value.field == field and param_of(field, None) == param


def test_an_assistant_message_of_calls_alone_is_not_empty():
    call = pb.ToolCall(id="c1", name="f", arguments='{"a": [1]}')
    valid = validate_chat(_chat(pb.ChatMessage(role="assistant", tool_calls=[call])), LIMITS)
    assert valid["chat"][0]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}
    ]


GEMMA_LIKE = (  # refuses a system role and turns that do not alternate, as Gemma-2's template does
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_turn(tmp_path):
    valid = _validated({"messages": CONVERSATION[1:], "tools": [WEATHER]})
    ours = _ours(GEMMA_LIKE, tmp_path, valid)
    tools = json.dumps(WEATHER, ensure_ascii=False)
    assert ours.startswith(
        f"<start_of_turn>user\n{TOOL_SYSTEM_PROMPT.format(tools=tools)}\n\nWeather in Paris"
    )
    # the two results are one user turn: the roles alternate
    assert ours.endswith(
        "<start_of_turn>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n4 C, rain\n"
        "</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_tool_use_template_is_chosen_for_requests_with_tools(tmp_path):
    write_tokenizer_dir("qwen2", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    named = [
        {"name": "default", "template": CHATML_TEMPLATE},
        {"name": "tool_use", "template": QWEN25_TEMPLATE},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path)
    valid = _validated({"messages": CONVERSATION, "tools": [WEATHER]})
    assert "You are Qwen" not in tokenizer.apply_chat_template(valid["chat"])  # no tools: the default
    assert tokenizer.apply_chat_template(valid["chat"], tools=valid["tools"]).startswith(
        "<|im_start|>system\nYou are terse.\n\n# Tools\n"
    )


def test_tool_results_carry_the_called_functions_name():
    valid = _validated({"messages": CONVERSATION})
    assert [m.get("name") for m in valid["chat"]] == [None, None, None, "get_weather", "get_weather"]
    assert valid["chat"][2]["content"] is None  # calls alone: content None, as transformers passes it


def test_required_keeps_each_tools_defs_and_refs():
    """pydantic's nested models ($defs, $ref) inside the call array's schema still resolve there."""
    jsonschema = pytest.importorskip("jsonschema")
    params = {
        "$defs": {
            "Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        },
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"],
    }
    ship = {"type": "function", "function": {"name": "ship", "parameters": params}}
    parsed = parse(
        {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, ship], "tool_choice": "required"},
        chat=True,
        request_id="r",
    )
    schema = json.loads(parsed.request.response_format.json_schema)
    jsonschema.validate([{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ship", "arguments": {"to": {"town": "Oslo"}}}], schema)
    pytest.importorskip("llguidance")
    from common.structured import grammar_for

    assert grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})


def test_a_rendered_chat_longer_than_the_bound_is_refused_before_tokenizing(tmp_path):
    write_tokenizer_dir("qwen2", tmp_path)
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    rendered = len(tokenizer.apply_chat_template(messages))
    assert tokenizer.encode_chat(messages, max_chars=rendered) == tokenizer.encode_chat(messages)
    with pytest.raises(ValueError, match=f"renders {rendered} characters, more than {rendered - 1}"):
        tokenizer.encode_chat(messages, max_chars=rendered - 1)
