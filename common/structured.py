"""Structured outputs, the torch-free half (the router's, and the worker's import): an OpenAI
`response_format` -> an llguidance grammar, validated before admission.

Contract
- input: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": {...}}}`,
  or this server's `{"type": "regex", "regex": "..."}`.
- output: `grammar_for(...)` -> the llguidance grammar (JSON text) the worker runs
  (worker/grammar.py); ValueError naming the problem (a schema llguidance cannot compile, an
  unknown type, more than MAX_GRAMMAR_BYTES).
- state: none. failure modes: ValueError as above; `available()` says why not where llguidance is
  not installed.
- proven by: tests/test_structured_output.py.
"""

from __future__ import annotations

import json

try:
    import llguidance
except ImportError:  # the GPU machine's image, say: constrained requests are refused with a reason
    llguidance = None

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema larger than this is refused before any compile work


def available() -> str | None:
    """None when constrained decoding can run here, else why not."""
    return None if llguidance is not None else "the llguidance package is not installed"


def grammar_for(response_format: dict) -> str:
    """An OpenAI `response_format` (`{"type": "json_object"}`, `{"type": "json_schema",
    "json_schema": {"schema": {...}}}`, or this server's `{"type": "regex", "regex": "..."}`) as an
    llguidance grammar, validated (ValueError with the reason otherwise)."""
    if llguidance is None:
        raise ValueError(f"constrained decoding is unavailable: {available()}")
    kind = response_format.get("type")
    if kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema: required, a JSON Schema object")
        text = json.dumps(schema)
        if len(text) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"json_schema.schema: {len(text)} bytes, more than {MAX_GRAMMAR_BYTES}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    elif kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not regex or len(regex) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"regex: required, a non-empty string of at most {MAX_GRAMMAR_BYTES} bytes")
        grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    else:
        raise ValueError(f"type: must be text, json_object, json_schema or regex, got {kind!r}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(problem)
    return grammar
