"""Tool calling in /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out.

Contract
- input (request): `tools` (`[{"type": "function", "function": {"name", "description",
  "parameters"}}]`), `tool_choice` ("none", "auto", "required", or `{"type": "function",
  "function": {"name"}}`; "auto" by default with tools), `parallel_tool_calls` (default true).
  `parse_tools` puts the tools on the `pb.Chat` (the template shows them to the model) and, for
  "required" or a named function, a JSON Schema on `response_format` that constrains the output:
  the named function's arguments object, or an array of 1 (or, with parallel calls, more) `{"name",
  "arguments"}` objects of the listed functions. "none" leaves the tools out of the prompt.
- input (answer): the choice's generated text. `extract(text, mode) -> (content, calls)`:
  named -> one call with the text as its arguments; required -> the array's calls (of an array
  cut by max_tokens, the complete ones: finish_reason stays length); auto -> each
  `<tool_call>{"name", "arguments"}</tool_call>` block (Hermes / Qwen2.5, what the system prompt
  of a template without tools asks for; an unclosed last block counts) of a known function, or the
  whole text as one JSON call object or list of them (`"parameters"` for `"arguments"`, Llama 3.1's
  form, optionally after `<|python_tag|>`); text outside the calls is the content (null when only
  whitespace). A block that is not valid JSON or names an unknown function stays content. Without
  parallel calls only the first is kept.
- output (stream): `ToolStream.feed(text) -> [delta, ...]` and `.finish() -> [delta, ...]`, the
  chat chunk deltas whose concatenation equals `extract` of the whole text: content as it comes
  except a possible call's start (held back), a named call's arguments as they come, the other
  calls whole at the end.
- state: `ToolStream` holds one choice's text since the first held-back character.
- failure modes: `ToolsError` (a 400) naming the parameter: tools that are not a list of function
  objects, a tool_choice other than the four forms, a named function that is not listed, a
  tool_choice other than none without tools, "required" or a named function together with
  `response_format`; the function names and schemas themselves are checked by
  router/chat_validation.py and the schema's compilation (router/validation.py).
- proven by: tests/test_tool_answers.py (parsing, streaming = whole), tests/test_chat_tools.py
  (request errors), tests/test_openai_tool_refs.py ("required" keeps each schema's refs' meaning),
  tests/test_openai_tools_e2e.py (the openai SDK against a real router and worker).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from protos.llm.v1 import generation_pb2 as pb

CALL_OPEN, CALL_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "auto", "required" or "named" ("none" needs no mode)
    names: tuple[str, ...]  # the listed functions
    name: str = ""  # named: the function
    parallel: bool = True


class ToolsError(ValueError):
    """A 400 naming `param` (router/openai/requests.py turns it into the OpenAI error)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param, self.problem = param, problem


_bad = ToolsError


def _tool(tool: object, i: int) -> pb.Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(where, "must be {'type': 'function', 'function': {...}}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(f"{where}.function", "must be an object with a string name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise _bad(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters", "must be a JSON Schema object")
    text = "" if parameters is None else json.dumps(parameters, ensure_ascii=False)
    return pb.Tool(name=function["name"], description=description, parameters=text)


def _call_schema(tool: pb.Tool, i: int) -> dict:
    """Tool `i`'s entry of the call array's `items.anyOf`.

    The tool's parameters keep their refs as written: each entry is its own schema resource (JSON
    Schema's bundling), so "#/$defs/...", "#" and "#anchor" resolve inside that tool's arguments,
    as they do when the schema stands alone (tool_choice naming it). Rewriting the refs to a
    pointer into the array broke the refs of parameters with their own `$id` (relative to it) and
    anchor refs, and could not keep two tools' equal anchors or relative `$id`s apart."""
    arguments = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    if "$id" not in arguments:  # one with its own `$id` is a resource already (relative to ours)
        arguments = {"$id": "arguments", **arguments}
    return {
        # a base URI per tool (.invalid: never a real one, nothing fetches it) for the relative ids
        "$id": f"https://tool-calls.invalid/{i}/",
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tools(body: dict, chat: pb.Chat, req: pb.GenerateRequest) -> ToolMode | None:
    """The request's tools onto `chat`, the constraint of its tool_choice onto `req`; its mode."""
    try:
        return _parse_tools(body, chat, req)
    except RecursionError:  # a parameters schema nested (almost) as deep as the body parser allows
        raise _bad("tools", "a parameters schema is nested too deeply") from None


def _parse_tools(body: dict, chat: pb.Chat, req: pb.GenerateRequest) -> ToolMode | None:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {'type': 'function', 'function': {...}}")
    choice = body.get("tool_choice")
    choice = ("auto" if tools else "none") if choice is None else choice
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"must be a boolean, got {parallel!r}")
    listed = [_tool(tool, i) for i, tool in enumerate(tools)]  # checked even when not shown
    if choice == "none":
        return None  # the model answers in text: the tools stay out of its prompt
    if not tools:
        raise _bad("tool_choice", f"{choice!r} needs tools")
    names = tuple(t.name for t in listed)
    name = ""
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad(
                "tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name'}}"
            )
        if name not in names:
            raise _bad("tool_choice", f"names the function {name!r}, which tools does not list")
        choice = "named"
    elif choice not in ("auto", "required"):
        raise _bad("tool_choice", f"must be none, auto, required or a function, got {choice!r}")
    chat.tools.extend(listed)
    if choice == "auto":
        return ToolMode("auto", names, parallel=parallel)
    if req.HasField("response_format"):
        raise _bad(
            "response_format", f"not with tool_choice {choice!r}: the tool call's schema is the format"
        )
    if choice == "named":
        tool = listed[names.index(name)]
        schema = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    else:
        calls = [_call_schema(t, i) for i, t in enumerate(listed)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
    # compact JSON (llguidance's option): a small model otherwise spends its tokens on blank lines
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
    req.response_format.json_schema = json.dumps(schema, ensure_ascii=False)
    return ToolMode(choice, names, name, parallel)


# -- the answer -----------------------------------------------------------------------------------
def _call(name: str, arguments: str) -> dict:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _as_call(value: object, names: tuple[str, ...]) -> dict | None:
    """A `{"name", "arguments"}` (or `"parameters"`) object of a listed function -> a tool call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        return _call(value["name"], json.dumps(arguments, ensure_ascii=False))
    except (ValueError, RecursionError):  # nested too deep to write back
        return None


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _complete_items(text: str) -> list:
    """The items of a JSON array, or of as much of one as is complete (an answer cut by max_tokens:
    its calls before the cut)."""
    decoder, text = json.JSONDecoder(), text.strip()
    if not text.startswith("["):
        return []
    items, at = [], 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return items
        items.append(item)


def _whole_calls(text: str, names: tuple[str, ...]) -> list[dict] | None:
    """The text as one call object or a list of them, else None."""
    value = _json(text.strip().removeprefix(PYTHON_TAG))
    values = value if isinstance(value, list) and value else [value]
    calls = [_as_call(v, names) for v in values]
    return None if None in calls else calls


def extract(text: str, mode: ToolMode) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole generated text (see the module docstring)."""
    if mode.choice == "named":
        return None, [_call(mode.name, text)]
    if mode.choice == "required":
        calls = [_as_call(v, mode.names) for v in _complete_items(text)]
        return (text or None, []) if not calls or None in calls else (None, calls)
    rest, calls = _auto(text, mode)
    return (rest if rest.strip() else None), calls


def _auto(text: str, mode: ToolMode) -> tuple[str, list[dict]]:
    """The text outside the calls (as it is), and the calls."""
    calls, content, at = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _as_call(_json(block.group(1).strip()), mode.names)
        if call is not None:
            content.append(text[at : block.start()])
            calls.append(call)
            at = block.end()
    content.append(text[at:])
    if not calls:
        whole = _whole_calls(text, mode.names)
        calls, content = (whole, []) if whole else ([], content)
    return "".join(content), calls if mode.parallel else calls[:1]


def _call_deltas(calls: list[dict], first: int) -> list[dict]:
    return [{"tool_calls": [{"index": first + k, **call}]} for k, call in enumerate(calls)]


class ToolStream:
    """One streamed choice's deltas (see the module docstring). Linear in the answer's length:
    while content streams only a possible call's start is held (a few characters), and once a
    call or a whole-text call may have begun the pieces are only collected."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.calls = 0  # tool calls sent so far
        self._held: list[str] = []  # text not sent yet
        self._to_end = mode.choice == "required"  # hold everything until finish
        self._blank = True  # nothing but whitespace is held (and nothing was sent)
        self._sent = False  # content went out

    def feed(self, text: str) -> list[dict]:
        if self.mode.choice == "named":
            if self.calls:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
            self.calls = 1
            return _call_deltas([_call(self.mode.name, text)], 0)
        self._held.append(text)
        if self._to_end or (self._blank and not text.strip()):
            return []  # (leading whitespace is content only if content follows)
        self._blank = False
        held = "".join(self._held)
        self._held = [held]
        if CALL_OPEN in held:
            self._to_end = True
            return []
        if not self._sent:
            start = held.lstrip()
            if start[0] in "{[" or start.startswith(PYTHON_TAG):
                self._to_end = True  # possibly the whole text as one call: read at the end
                return []
            if PYTHON_TAG.startswith(start):
                return []
        keep = next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if held.endswith(CALL_OPEN[:k])), 0)
        out = held[: len(held) - keep]
        if not out.strip() and not self._sent:
            return []  # whitespace, then a possible call's start: content only if content follows
        self._held = [held[len(out) :]] if keep else []
        self._sent = True
        return [{"content": out}]

    def finish(self) -> list[dict]:
        if self.mode.choice == "named":
            return [] if self.calls else self.feed("")
        held, self._held = "".join(self._held), []
        if not held:
            return []
        if self._sent:  # `held` starts at a <tool_call> (or a piece of one); its text is content
            content, calls = _auto(held, self.mode)
        else:
            content, calls = extract(held, self.mode)
        out = [{"content": content}] if content else []
        out += _call_deltas(calls, self.calls)
        self.calls += len(calls)
        return out
