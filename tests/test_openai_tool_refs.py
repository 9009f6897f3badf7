"""tool_choice "required" keeps the meaning of every `$ref` in the tools' parameters schemas.

Found by review on 2026-12-04: "required" embeds each tool's parameters in one array-of-calls
schema and rewrote every "#..." `$ref` to a pointer under "#/items/anyOf/<i>/properties/arguments"
(router/openai/tools.py). Two valid schemas that compile with tool_choice naming the function were
then refused (400 "Pointer ... does not exist"): parameters with their own `$id` (their
"#/$defs/..." refs are relative to it) and refs to a plain-name fragment ("#address", `$anchor`).

Proven here, without servers: with "required", such parameters (and the plain "#/$defs/..." and
"#" refs pydantic writes) compile with llguidance; llguidance's matcher (over a tiny tokenizer)
accepts an array of calls whose arguments are valid and refuses invalid ones; `extract` reads the
accepted answer back as the same tool calls; and two tools that use the same anchor, `$defs` name
or relative `$id` for different types each get their own, in llguidance and in jsonschema.
"""

from __future__ import annotations

import json

import pytest

from router.openai.requests import parse
from router.openai.tools import extract

pytest.importorskip("llguidance")
from common.structured import grammar_for  # noqa: E402

ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WITH_ID = {  # its refs resolve against its own `$id`
    "$id": "https://example.com/schemas/ship.json",
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Address"}},
    "$defs": {"Address": ADDRESS},
    "required": ["to"],
}
WITH_ANCHOR = {
    "type": "object",
    "properties": {"to": {"$ref": "#address"}},
    "$defs": {"Address": {"$anchor": "address", **ADDRESS}},
    "required": ["to"],
}
WITH_DEFS = {  # pydantic's nested models
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Address"}},
    "$defs": {"Address": ADDRESS},
    "required": ["to"],
}
WITH_RELATIVE_ID = {  # an embedded resource, its `$id` relative to the enclosing one's
    "type": "object",
    "properties": {"to": {"$ref": "address.json"}},
    "$defs": {"Address": {"$id": "address.json", **ADDRESS}},
    "required": ["to"],
}
TREE = {  # "#": the root of the tool's own arguments, not of the call array
    "type": "object",
    "properties": {"to": ADDRESS},
    "required": ["to"],
    "anyOf": [{"properties": {"via": {"$ref": "#"}}}],
}
GOOD = {"to": {"city": "Oslo"}}
BAD = {"to": {"town": "Oslo"}}
SCHEMAS = {
    "own-$id": WITH_ID,
    "$anchor-ref": WITH_ANCHOR,
    "$defs-ref": WITH_DEFS,
    "relative-$id": WITH_RELATIVE_ID,
    "root-ref": TREE,
}


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _parsed(tools: list[dict], tool_choice):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": tool_choice}
    return parse(body, chat=True, request_id="r")


def _grammar(parsed) -> str:
    schema = json.loads(parsed.request.response_format.json_schema)
    return grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})


@pytest.fixture(scope="module")
def accepts():
    """`accepts(grammar, text)`: whether llguidance's matcher takes `text` whole (the worker's)."""
    from tests.tiny_models import build_tokenizer
    from worker.grammar import Grammars

    tok = build_tokenizer("qwen2")
    grammars = Grammars(tok.to_str, (tok.token_to_id("<|im_end|>"),))

    def run(grammar: str, text: str) -> bool:
        matcher = grammars.matcher(grammar)
        return all(matcher.consume_token(t) for t in tok.encode(text).ids) and matcher.is_accepting()

    return run


def _answer(*calls: tuple[str, dict]) -> str:
    # compact, as the format's x-guidance asks of the model
    return json.dumps([{"name": n, "arguments": a} for n, a in calls], separators=(",", ":"))


@pytest.mark.parametrize("parameters", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_required_constrains_to_the_parameters_as_named_does(parameters, accepts):
    named = _grammar(_parsed([_tool("ship", parameters)], {"type": "function", "function": {"name": "ship"}}))
    assert accepts(named, json.dumps(GOOD, separators=(",", ":")))  # the reference: the schema alone
    assert not accepts(named, json.dumps(BAD, separators=(",", ":")))
    parsed = _parsed([_tool("other", {"type": "object"}), _tool("ship", parameters)], "required")
    grammar = _grammar(parsed)
    answer = _answer(("ship", GOOD), ("other", {}))
    assert accepts(grammar, answer)
    assert not accepts(grammar, _answer(("ship", BAD)))
    content, calls = extract(answer, parsed.tools)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("ship", GOOD),
        ("other", {}),
    ]


def test_required_resolves_the_root_ref_to_the_tools_own_arguments(accepts):
    grammar = _grammar(_parsed([_tool("ship", TREE)], "required"))
    assert accepts(grammar, _answer(("ship", {**GOOD, "via": GOOD})))
    # the root of the call array would take a list of calls here
    assert not accepts(grammar, _answer(("ship", {**GOOD, "via": [{"name": "ship", "arguments": GOOD}]})))


def _other_type(parameters: dict) -> dict:
    """`parameters` with its Address's city an integer instead of a string."""
    changed = json.loads(json.dumps(parameters))
    changed["$defs"]["Address"]["properties"]["city"] = {"type": "integer"}
    return changed


@pytest.mark.parametrize(
    "parameters", [WITH_ANCHOR, WITH_DEFS, WITH_RELATIVE_ID], ids=["$anchor", "$defs", "relative-$id"]
)
def test_two_tools_with_the_same_names_for_different_schemas_each_get_their_own(parameters, accepts):
    """Same anchor / `$defs` name / relative `$id`, different types: neither tool's refs resolve to
    the other's schema (in one shared resource the last would win for both)."""
    jsonschema = pytest.importorskip("jsonschema")
    parsed = _parsed([_tool("ship", parameters), _tool("count", _other_type(parameters))], "required")
    grammar = _grammar(parsed)
    schema = json.loads(parsed.request.response_format.json_schema)
    good = [("ship", {"to": {"city": "Oslo"}}), ("count", {"to": {"city": 3}})]
    bad = [[("ship", {"to": {"city": 3}})], [("count", {"to": {"city": "Oslo"}})]]
    assert accepts(grammar, _answer(*good))
    jsonschema.validate(json.loads(_answer(*good)), schema)
    for calls in bad:
        assert not accepts(grammar, _answer(*calls)), calls
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(_answer(*calls)), schema)
