"""Tool calling without servers: the prompt a chat with tools renders to, the calls read out of an
answer (whole and streamed), and the request checks of tools and tool_choice.

- A tool-aware template (Qwen2.5's, below) renders the router's validated messages and tools to
  exactly transformers' text for the same OpenAI conversation (tool calls, tool results).
- A template without tools (ChatML, SmolLM2's) gets the Hermes tool prompt in its system message
  and the calls / results as text, written out literally here.
- `extract` on a table of answers; a stream of the same answers cut at every point gives deltas
  whose concatenation equals `extract`'s content and calls.
"""

from __future__ import annotations

import json
import random

import pytest

from common.chat_tools import TOOL_SYSTEM_PROMPT, TemplateFeatures
from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.chat_validation import validate_chat
from router.config import Limits
from router.errors import ValidationError
from router.openai.reasoning import Reasoning, ReasoningStream, reasoning_of, split
from router.openai.requests import ApiError, param_of, parse
from router.openai.tools import ToolMode, ToolStream, extract
from tests.tiny_models import CHATML_TEMPLATE, write_tokenizer_dir

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are \
provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

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


AUTO = ToolMode("auto", ("get_weather", "get_time"))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWERS = [  # (text, mode, content, [(name, arguments)])
    ("It is sunny.", AUTO, "It is sunny.", []),
    (f"<tool_call>\n{CALL}\n</tool_call>", AUTO, None, [("get_weather", {"city": "Paris"})]),
    (
        f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n",
        AUTO,
        "Let me look.\n\n",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        f'<tool_call>{CALL}</tool_call><tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>',
        AUTO,
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        f'<tool_call>{CALL}</tool_call><tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>',
        ToolMode("auto", AUTO.names, parallel=False),
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (f"<tool_call>\n{CALL}", AUTO, None, [("get_weather", {"city": "Paris"})]),  # unclosed, at the end
    ("<tool_call>{not json}</tool_call>", AUTO, "<tool_call>{not json}</tool_call>", []),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        AUTO,
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        AUTO,
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', AUTO, None, [("get_time", {})]),
    ('[{"name": "get_time", "arguments": "{}"}]', AUTO, None, [("get_time", {})]),
    ('{"city": "Paris"}', AUTO, '{"city": "Paris"}', []),  # JSON, but not a call
    ("Use <tool_call> tags.", AUTO, "Use <tool_call> tags.", []),
    ("a <tool", AUTO, "a <tool", []),
    ("  \n", AUTO, None, []),
    (f"\n<tool_call>\n{CALL}\n</tool_call>", AUTO, None, [("get_weather", {"city": "Paris"})]),
    (f"  <tool_call>{CALL}", AUTO, None, [("get_weather", {"city": "Paris"})]),
    ("\n\n<tool", AUTO, "\n\n<tool", []),
    (  # arguments nested too deep to read: content, not an error
        '<tool_call>{"name": "get_time", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}</tool_call>',
        AUTO,
        '<tool_call>{"name": "get_time", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}</tool_call>',
        [],
    ),
    (
        '{"city": "Oslo"}',
        ToolMode("named", AUTO.names, "get_weather"),
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        f'[{CALL}, {{"name": "get_time", "arguments": {{}}}}]',
        ToolMode("required", AUTO.names),
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ('[{"name": "get_wea', ToolMode("required", AUTO.names), '[{"name": "get_wea', []),  # cut by max_tokens
    (
        f'[\n{CALL},\n{{"name": "get_ti',
        ToolMode("required", AUTO.names),
        None,
        [("get_weather", {"city": "Paris"})],
    ),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,mode,content,calls", ANSWERS)
def test_extract_reads_calls_and_content(text, mode, content, calls):
    got_content, got_calls = extract(text, mode)
    assert got_content == content and _calls(got_calls) == calls


def _streamed(pieces: list[str], mode: ToolMode) -> tuple[str | None, list[dict]]:
    """Deltas merged as the openai SDK's stream accumulator does: content appended, each call's
    fields by index (arguments appended)."""
    stream, deltas = ToolStream(mode), []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    content, calls = None, {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"} and delta
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            merged = calls.setdefault(
                call["index"],
                {"id": call.get("id"), "type": call.get("type"), "function": {"name": "", "arguments": ""}},
            )
            merged["function"]["name"] += call.get("function", {}).get("name", "")
            merged["function"]["arguments"] += call.get("function", {}).get("arguments", "")
    assert sorted(calls) == list(range(len(calls))) and stream.calls == len(calls)
    return content, [calls[i] for i in sorted(calls)]


def _cuts(text: str) -> list[list[str]]:
    """`text` whole, a character at a time, and cut at 20 seeded random sets of three points."""
    rng = random.Random(7)
    return [[text], list(text)] + [
        [text[a:b] for a, b in zip([0, *sorted(pts)], [*sorted(pts), len(text)])]
        for pts in (rng.sample(range(len(text) + 1), min(3, len(text) + 1)) for _ in range(20))
    ]


@pytest.mark.parametrize("text,mode,content,calls", ANSWERS)
def test_a_stream_cut_anywhere_gives_the_whole_answer(text, mode, content, calls):
    for pieces in _cuts(text):
        got_content, got_calls = _streamed(pieces, mode)
        assert (got_content, _calls(got_calls)) == (content, calls), pieces


def test_content_streams_before_the_call_and_a_named_call_streams_its_arguments():
    stream = ToolStream(AUTO)
    assert stream.feed("Let me") == [{"content": "Let me"}]
    assert stream.feed(" look. <tool") == [{"content": " look. "}]  # "<tool" may open a call
    assert stream.feed("_call>{") == [] and stream.feed(CALL[1:] + "</tool_call>") == []
    [delta] = stream.finish()
    assert _calls(delta["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    named = ToolStream(ToolMode("named", AUTO.names, "get_weather"))
    [first] = named.feed('{"ci')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert named.feed('ty": "Oslo"}') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}
    ]
    assert named.finish() == []


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


def test_the_tool_benchmark_scores_what_an_agent_needs():
    """benchmarks/tool_calls.py's `score`: a call, valid under the tool's schema, of the right
    function with the expected value."""
    pytest.importorskip("jsonschema")
    from benchmarks.tool_calls import score

    def message(name, arguments):
        return {"content": None, "tool_calls": [{"function": {"name": name, "arguments": arguments}}]}

    right = score(message("get_time", '{"city": "New York"}'), "get_time", "city", "new york")
    assert right == {"called": True, "valid": True, "right_function": True, "right_argument": True}
    assert (
        score(message("get_time", '{"city": "Paris"}'), "get_time", "city", "tokyo")["right_argument"]
        is False
    )
    assert (
        score(message("get_weather", '{"city": "Tokyo"}'), "get_time", "city", "tokyo")["right_function"]
        is False
    )
    assert score(message("get_time", '{"town": "Tokyo"}'), "get_time", "city", "tokyo")["valid"] is False
    assert score(message("nope", "{}"), "get_time", "city", "tokyo")["valid"] is False
    assert score(message("get_time", '{"city": "To'), "get_time", "city", "tokyo")["valid"] is False
    assert score({"content": "It is noon."}, "get_time", "city", "tokyo")["called"] is False


OPENED, PLAIN = Reasoning(opened=True), Reasoning(opened=False)
REASONED = [  # (text, mode, reasoning, content)
    ("Let me think.\n</think>\n\nParis.", OPENED, "Let me think.\n", "Paris."),
    ("no end tag, cut by max_tokens", OPENED, "no end tag, cut by max_tokens", None),
    ("</think>Paris.", OPENED, None, "Paris."),
    ("Hmm </thin", OPENED, "Hmm </thin", None),
    ("<think>\nhm\n</think>\n\nParis.", PLAIN, "\nhm\n", "Paris."),
    ("  <think>hm</think>", PLAIN, "hm", None),
    ("Paris. <think>later</think>", PLAIN, None, "Paris. <think>later</think>"),
    ("<thin", PLAIN, None, "<thin"),
    ("  ", PLAIN, None, "  "),
    ("x</think>   ", OPENED, "x", None),
    ("<think>\nhm\n</think>\n\nok", OPENED, "\nhm\n", "ok"),  # the tag written again
    ("  ", OPENED, "  ", None),
    ("<thi", OPENED, "<thi", None),
]


@pytest.mark.parametrize("text,mode,reasoning,content", REASONED)
def test_reasoning_splits_whole_and_streamed_alike(text, mode, reasoning, content):
    assert split(text, mode) == (reasoning, content)
    for pieces in _cuts(text):
        stream, got = ReasoningStream(mode), {"reasoning_content": None, "content": None}
        for delta in [d for piece in pieces for d in stream.feed(piece)] + stream.finish():
            [(key, value)] = delta.items()
            assert value, delta
            got[key] = (got[key] or "") + value
        assert (got["reasoning_content"], got["content"]) == (reasoning, content), pieces


def test_reasoning_is_found_by_the_vocabulary_and_the_template(tmp_path):
    """A vocabulary with <think> and </think> as added tokens (not special: R1's distills decode
    them) makes a reasoning model; its template opening the block makes the answers start inside."""
    import tokenizers

    write_tokenizer_dir("qwen2", tmp_path)
    assert reasoning_of(Tokenizer.from_pretrained_dir(tmp_path)) is None  # no <think> tokens
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.add_tokens(
        [tokenizers.AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    assert reasoning_of(Tokenizer.from_pretrained_dir(tmp_path)) == PLAIN  # ChatML opens none
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = CHATML_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert reasoning_of(Tokenizer.from_pretrained_dir(tmp_path)) == OPENED


def _sse_merged(data: bytes) -> tuple[dict, str]:
    """A streamed chat answer's events merged as the SDK does: the message and the finish."""
    message, finish = {"content": None, "reasoning_content": None, "tool_calls": {}}, None
    for event in data.decode().split("\n\n"):
        if not event.startswith("data: {"):
            continue
        [choice] = json.loads(event.removeprefix("data: "))["choices"]
        for key in ("content", "reasoning_content"):
            if choice["delta"].get(key):
                message[key] = (message[key] or "") + choice["delta"][key]
        for call in choice["delta"].get("tool_calls", []):
            merged = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            merged["name"] += call.get("function", {}).get("name", "")
            merged["arguments"] += call.get("function", {}).get("arguments", "")
        finish = choice["finish_reason"] or finish
    return message, finish


@pytest.mark.parametrize("tools", [False, True])
def test_a_reasoning_models_answer_streams_as_it_comes_whole(tools):
    from router.openai.responses import Responder

    text = f"I need the weather.\n</think>\n\nChecking. <tool_call>{CALL}</tool_call>"
    body = {"messages": [{"role": "user", "content": "hi"}], **({"tools": [WEATHER]} if tools else {})}
    parsed = parse(body, chat=True, request_id="r")
    done = pb.Finished(reason=pb.FINISH_REASON_STOP)
    whole = Responder(parsed, "m", str, OPENED).complete([([pb.TokenChunk(text=text)], done)])
    [choice] = whole["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "I need the weather.\n"
    if tools:
        assert message["content"] == "Checking. " and choice["finish_reason"] == "tool_calls"
        assert _calls(message["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    else:
        assert (
            message["content"] == f"Checking. <tool_call>{CALL}</tool_call>" and "tool_calls" not in message
        )
    for pieces in _cuts(text)[:8]:
        responder = Responder(parsed, "m", str, OPENED)
        data = responder.start() + b"".join(responder.delta(pb.TokenChunk(text=p)) for p in pieces)
        streamed, finish = _sse_merged(data + responder.finish_choice(done))
        assert finish == choice["finish_reason"]
        assert (streamed["content"], streamed["reasoning_content"]) == (
            message["content"],
            message["reasoning_content"],
        )
        calls = [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()]
        assert calls == (_calls(message["tool_calls"]) if tools else [])


def test_a_constrained_answer_of_a_reasoning_model_is_not_split():
    from router.openai.responses import Responder

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}
    parsed = parse(body, chat=True, request_id="r")
    done = pb.Finished(reason=pb.FINISH_REASON_STOP)
    text = f"[{CALL}]"  # the grammar's output: no </think>, yet a call, not reasoning
    [choice] = Responder(parsed, "m", str, OPENED).complete([([pb.TokenChunk(text=text)], done)])["choices"]
    assert "reasoning_content" not in choice["message"] and _calls(choice["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_rendered_chat_longer_than_the_bound_is_refused_before_tokenizing(tmp_path):
    write_tokenizer_dir("qwen2", tmp_path)
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    rendered = len(tokenizer.apply_chat_template(messages))
    assert tokenizer.encode_chat(messages, max_chars=rendered) == tokenizer.encode_chat(messages)
    with pytest.raises(ValueError, match=f"renders {rendered} characters, more than {rendered - 1}"):
        tokenizer.encode_chat(messages, max_chars=rendered - 1)
