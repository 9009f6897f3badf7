"""Reading answers in /v1/chat/completions, without servers: the tool calls of an answer (whole and
streamed), a reasoning model's reasoning_content, and the tool benchmark's scoring.

- `extract` on a table of answers; a stream of the same answers cut at every point gives deltas
  whose concatenation equals `extract`'s content and calls.
- `split` and `ReasoningStream` alike; the Responder's whole and streamed answer of a reasoning
  model, with and without tools; reasoning detected from a real tokenizer's added tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from common.tokenizer import Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from router.openai.reasoning import Reasoning, ReasoningStream, reasoning_of, split
from router.openai.requests import parse
from router.openai.tools import ToolMode, ToolStream, extract
from tests.test_chat_tools import AUTO, WEATHER
from tests.tiny_models import CHATML_TEMPLATE, write_tokenizer_dir

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
    mode = reasoning_of(Tokenizer.from_pretrained_dir(tmp_path))
    assert mode is not None and not mode.opened  # ChatML opens none
    vocab = backend.get_vocab()
    assert (mode.open_id, mode.close_id) == (vocab["<think>"], vocab["</think>"])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = CHATML_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert reasoning_of(Tokenizer.from_pretrained_dir(tmp_path)).opened


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


def test_a_constrained_answer_of_a_reasoning_model_is_split_and_read_after_thinking():
    """The grammar runs after the think block (common.structured.after_thinking): the calls are read
    from the content, the thinking is reasoning_content."""
    from router.openai.responses import Responder

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}
    parsed = parse(body, chat=True, request_id="r")
    done = pb.Finished(reason=pb.FINISH_REASON_STOP)
    text = f"The weather, then.</think>\n[{CALL}]"
    [choice] = Responder(parsed, "m", str, OPENED).complete([([pb.TokenChunk(text=text)], done)])["choices"]
    assert choice["message"]["reasoning_content"] == "The weather, then."
    assert _calls(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
