"""Structured output parameters of an OpenAI request -> `GenerateRequest.response_format`.

Contract
- input: the request body: OpenAI's `response_format` (`text`, `json_object`, `json_schema`;
  llama.cpp's `{"type": "json_object", "schema": {...}}` is that schema's json_schema), or
  one of the other servers' parameters for the same (FORMAT_PARAMS: vLLM's `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`, llama.cpp's
  `json_schema` and `grammar` (GBNF), SGLang's `regex` and `ebnf`).
- output: `req.response_format` set (json_object, json_schema, regex, choice or grammar), and
  `params["response_format.<kind>"]` naming the parameter used, for error messages. The grammar
  itself is compiled by the service (router/validation.py, common/structured.py).
- failure modes: `FormatError(param, problem)`: a wrong type, an empty value, more than one format.
- state: none (pure).
- proven by: tests/test_openai_formats_e2e.py (each parameter through the SDK), tests/test_openai_requests.py.
"""

from __future__ import annotations

import json

from common.structured import MAX_GRAMMAR_BYTES
from protos.llm.v1 import generation_pb2 as pb


class FormatError(Exception):
    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param, self.problem = param, problem


def _bad(param: str, problem: str) -> FormatError:
    return FormatError(param, problem)


# Other servers' parameters for structured output, each -> the ResponseFormat kind it sets: vLLM's
# guided_* and structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}),
# llama.cpp's json_schema and grammar (GBNF), SGLang's regex and ebnf.
FORMAT_PARAMS = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("structured_outputs", None),
    ("json_schema", "json_schema"),
    ("grammar", "grammar"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
)
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def _format_param(name: str, value, req: pb.GenerateRequest, params: dict[str, str]) -> None:
    kind = dict(FORMAT_PARAMS)[name]
    if kind is None:  # structured_outputs: an object with one of STRUCTURED_OUTPUTS' keys
        keys = [k for k in STRUCTURED_OUTPUTS if isinstance(value, dict) and value.get(k) is not None]
        if len(keys) != 1:
            raise _bad(name, f"must be an object with one of {', '.join(STRUCTURED_OUTPUTS)}")
        kind, value, name = STRUCTURED_OUTPUTS[keys[0]], value[keys[0]], f"{name}.{keys[0]}"
    params[f"response_format.{kind}"] = name
    fmt = req.response_format
    if kind == "json_object":
        if value is not True:
            raise _bad(name, "must be true")
        fmt.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):
            fmt.json_schema = value  # JSON text; the service parses it
        elif isinstance(value, dict):
            fmt.json_schema = json.dumps(value)
        else:
            raise _bad(name, "must be a JSON Schema object")
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise _bad(name, "must be a non-empty list of non-empty strings")
        size = sum(len(v) for v in value)
        if size > MAX_GRAMMAR_BYTES:  # checked here too: the protobuf copy would be made per choice
            raise _bad(name, f"{size} characters of choices, more than {MAX_GRAMMAR_BYTES}")
        fmt.choice.options.extend(value)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise _bad(name, "must be a non-empty string")
        setattr(fmt, kind, value)


def parse_format(body: dict, req: pb.GenerateRequest, params: dict[str, str]) -> None:
    """`{"type": "text"}` (or none), `{"type": "json_object"}` (with llama.cpp's `"schema"`: that
    schema, as json_schema), or `{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: structured output; or one of
    the other servers' parameters for it (FORMAT_PARAMS)."""
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("response_format", f"must be an object, got {type(fmt).__name__}")
    kind = (fmt or {}).get("type", "text")
    given = [name for name, _ in FORMAT_PARAMS if body.get(name) is not None]
    if given and kind != "text" or len(given) > 1:
        names = (["response_format"] if kind != "text" else []) + given
        raise _bad(given[-1], f"one output format per request, got {' and '.join(names)}")
    if given:
        _format_param(given[0], body[given[0]], req, params)
        return
    if kind == "text":
        return
    if kind == "json_object":
        # llama.cpp's documented form {"type": "json_object", "schema": {...}}: the schema's
        # grammar, never a silently looser "any object"
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise _bad("response_format", "schema: must be a JSON Schema object")
        if schema:
            req.response_format.json_schema = json.dumps(schema)
        else:
            req.response_format.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format", "json_schema.schema: required, a JSON Schema object")
        req.response_format.json_schema = json.dumps(schema)
    else:
        raise _bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
