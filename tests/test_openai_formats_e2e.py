"""Structured output under other servers' parameter names (router/openai/formats.py), and the
choice and grammar formats, against a real router and worker: vLLM's `guided_choice`,
`guided_regex`, `guided_json`, `guided_grammar` and `structured_outputs`, llama.cpp's `grammar`
(GBNF) and `json_schema`, SGLang's `regex` and `ebnf`, each through the openai SDK's `extra_body`,
constrain the answer; gRPC's `ResponseFormat.choice` and `.grammar` too. Two formats in one request,
a wrong type and a grammar that does not compile are 400s naming the parameter."""

from __future__ import annotations

import json
import re

import openai
import pytest

from protos.llm.v1 import generation_pb2 as pb
from tests.openai_helpers import (  # noqa: F401 - client, router, stub, worker: the shared stack's fixtures
    AUTH,
    client,
    grpc_generate,
    router,
    stub,
    worker,
)

pytest.importorskip("llguidance")

ASK = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
NUMBER = "[0-9]{2,3}"
GBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
LARK = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def answer(client, **extra) -> str:
    reply = client.chat.completions.create(model="", messages=ASK, max_tokens=24, extra_body=extra)
    assert reply.choices[0].finish_reason == "stop", reply
    return reply.choices[0].message.content


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["maybe", "never"]}}, lambda t: t in ("maybe", "never")),
        ({"guided_regex": NUMBER}, lambda t: re.fullmatch(NUMBER, t)),
        ({"regex": NUMBER}, lambda t: re.fullmatch(NUMBER, t)),
        ({"structured_outputs": {"regex": NUMBER}}, lambda t: re.fullmatch(NUMBER, t)),
        ({"grammar": GBNF}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"ebnf": GBNF}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"guided_grammar": LARK}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"guided_json": SCHEMA}, lambda t: isinstance(json.loads(t)["answer"], bool)),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: isinstance(json.loads(t)["answer"], bool)),
        ({"json_schema": SCHEMA}, lambda t: isinstance(json.loads(t)["answer"], bool)),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: isinstance(json.loads(t)["answer"], bool)),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_other_servers_format_parameters_constrain_the_answer(client, extra, check):
    text = answer(client, **extra)
    assert check(text), text


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "got guided_regex and"),
        (
            {"response_format": {"type": "json_object"}, "grammar": GBNF},
            "grammar",
            "one output format per request, got response_format and grammar",
        ),
        ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list of non-empty strings"),
        ({"guided_regex": ""}, "guided_regex", "must be a non-empty string"),
        (
            {"guided_json": {"type": "object"}, "tools": [TOOL], "tool_choice": "required"},
            "guided_json",
            "not with tool_choice 'required'",
        ),
        ({"guided_choice": ["x" * 40_000, "y" * 40_000]}, "guided_choice", "80000 characters of choices"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "must be an object with one of"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "must be true"),
        ({"grammar": "root ::= ("}, "grammar", "GBNF:"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", 'unknown name: "nowhere"'),
        ({"guided_json": {"type": "nope"}}, "guided_json", "nope"),
        ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
        ({"guided_regex": "(unclosed"}, "guided_regex", ""),
    ],
)
def test_bad_format_parameters_are_400_naming_them(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK, max_tokens=4, extra_body=extra)
    text = info.value.body["message"]
    assert info.value.param == param and text.startswith(f"{param}: ") and message in text, info.value.body


def test_grpc_choice_and_grammar(stub):
    for fmt, pattern in (
        (pb.ResponseFormat(choice=pb.Choice(options=["red", "green", "blue"])), "red|green|blue"),
        (pb.ResponseFormat(grammar=GBNF), r"The answer is (yes|no)\."),
    ):
        text, finished = grpc_generate(
            stub,
            AUTH,
            prompt="My favourite colour is",
            response_format=fmt,
            sampling=pb.SamplingParams(temperature=0.8, seed=3),
            stopping=pb.StoppingCriteria(max_tokens=16),
        )
        assert re.fullmatch(pattern, text) and finished.reason == pb.FINISH_REASON_STOP, text


DEEP = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3500)) + 'r3500: "z"\n'  # 43 KB


def test_a_deep_grammar_is_served_not_a_crash(client, router, worker):
    """A chain of 3,500 rules (within the 64 KiB limit) makes llguidance recurse past a default 8 MB
    stack (SIGSEGV); the router compiles it and the worker runs it on deep-stack threads
    (common/structured.py), so it is an answer, and both processes live on."""
    reply = client.completions.create(model="", prompt="Say z:", max_tokens=4, extra_body={"grammar": DEEP})
    assert reply.choices[0].text == "z" and reply.choices[0].finish_reason == "stop"
    assert router.popen.poll() is None and worker.popen.poll() is None


@pytest.mark.parametrize(
    "gbnf, problem",
    [
        ('x ::= "a"', "No 'root' rule found"),
        ("root ::= foo", "Rule 'foo' not found"),
        ('root ::= "\\', "GBNF:"),
        ("root ::= " + "(" * 3000, "GBNF:"),
        ("".join(f'r{i} ::= "x"\n' for i in range(501)), "501 rules, more than 500"),
    ],
    ids=["no-root", "unknown-rule", "cut-string", "deep-parens", "too-many-rules"],
)
def test_gbnf_that_does_not_convert_is_a_400(client, gbnf, problem):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="x", max_tokens=2, extra_body={"grammar": gbnf})
    assert info.value.param == "grammar" and problem in info.value.body["message"], info.value.body
