"""Edges of structured output's compile step (common/structured.py, router/validation.py) found by
review on 2026-12-04, each a request refused as INVALID_ARGUMENT naming its field (or compiled),
never a router INTERNAL or a refusal by the worker after admission:
- a json_schema nested just deep enough that the router's parse succeeds but re-encoding it one
  frame deeper raised RecursionError (INTERNAL "internal error: RecursionError");
- a Lark grammar with "::=" in a literal or a comment was taken for GBNF and refused;
- a regex at the router's size bound grows ~6x in llguidance's JSON form (control characters as
  \\u escapes), past the worker's bound: the router admitted it and the worker refused it."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from common.structured import MAX_GRAMMAR_BYTES, compile_executor, grammar_for  # noqa: E402
from protos.llm.v1 import generation_pb2 as pb  # noqa: E402
from router.errors import ValidationError  # noqa: E402
from router.validation import _grammar, validate  # noqa: E402
from tests.test_router_validation import LIMITS, MODELS  # noqa: E402
from worker.grammar import Grammars  # noqa: E402


def _nested(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def test_every_depth_of_a_json_schema_is_a_validation_error_not_a_recursion_error():
    def scan() -> dict[int, str]:
        escaped = {}
        for depth in range(900, 1100):  # the window sits near the recursion limit (1000)
            _grammar.cache_clear()
            schema = pb.ResponseFormat(json_schema=_nested(depth))
            try:
                validate(pb.GenerateRequest(prompt="hi", response_format=schema), LIMITS, MODELS)
            except ValidationError:
                pass  # refused naming its field: the answer wanted at every depth
            except Exception as exc:  # noqa: BLE001 - what the interceptor would answer INTERNAL for
                escaped[depth] = f"{type(exc).__name__}: {exc}"
        return escaped

    escaped = compile_executor().submit(scan).result()  # as router/service.py runs validate
    assert not escaped, escaped


@pytest.mark.parametrize(
    "lark",
    ['start: "x ::= y"\n', 'start: "a" | "b"  // GBNF would say: root ::= "a" | "b"\n'],
    ids=["literal", "comment"],
)
def test_a_lark_grammar_mentioning_gbnf_syntax_compiles_as_lark(lark):
    assert grammar_for({"type": "grammar", "grammar": lark})


def test_gbnf_is_still_told_by_its_rules():
    assert grammar_for({"type": "grammar", "grammar": 'root ::= "yes" | "no"\n'})


def test_what_the_router_admits_the_worker_compiles():
    regex = "\x01" * MAX_GRAMMAR_BYTES  # at the router's bound
    try:
        grammar = _grammar("regex", regex)
    except ValueError as exc:  # refused by the router, naming the compiled size: fine
        assert "once compiled" in str(exc)
        return
    Grammars.for_model(None, (2, 0)).matcher(grammar)  # else the worker must take it
