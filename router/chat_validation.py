"""Chat input validation: `pb.Chat` (messages, tool calls, tool results, tool definitions) -> the
dicts the chat template is rendered with (common/chat_tools.py), or `ValidationError`.

Contract
- input: a `pb.Chat` and the router's `Limits`.
- output: `{"chat": (message dicts...), "tools": (tool dicts...), "chat_chars"}` for
  `ValidRequest`. Each message is `{"role", "content"}`, an assistant's calls as `tool_calls:
  [{"id", "type": "function", "function": {"name", "arguments": dict}}]` (arguments parsed:
  transformers' templates write them with `tojson`; content None when empty), a tool result with
  its `tool_call_id` (and `name`, the function's, when an earlier assistant call has that id); each
  tool `{"type": "function", "function": {"name", "description"?, "parameters"?}}` (parameters
  parsed); `chat_chars` is the characters the chat renders from (the early too-long refusal).
- state: none (pure).
- failure modes: `ValidationError` naming the field, e.g. `chat.tools[1].name: ...`: an unknown
  role, calls on a message that is not the assistant's, arguments or parameters that are not a JSON
  object (or one nested deeper than MAX_JSON_DEPTH), a tool name outside [A-Za-z0-9_-]{1,64} or
  given twice, more than MAX_TOOLS tools, more
  than `max_chat_messages` messages (default 10,000: a bound on this module's per-message work,
  which runs on the router's event loop) or `max_prompt_chars` characters in all.
- proven by: tests/test_router_validation.py (table), tests/test_openai_tools_e2e.py,
  tests/test_openai_limits_e2e.py (a 301-message history).
"""

from __future__ import annotations

import json
import re

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.errors import ValidationError

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# Tool parameters and call arguments: real schemas nest a few levels; templates pretty-print them
# (Llama 3.1's `tojson(indent=4)`), which grows with the square of the depth.
MAX_JSON_DEPTH = 64


def _check(ok: bool, field: str, problem: str) -> None:
    if not ok:
        raise ValidationError(field, problem)


def _depth(value: object) -> int:
    """How deep objects and lists nest in a JSON value (iterative: no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ValidationError(field, "is not valid JSON") from None
    _check(isinstance(value, dict), field, f"must be a JSON object, got {type(value).__name__}")
    _check(_depth(value) <= MAX_JSON_DEPTH, field, f"nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _message(m: pb.ChatMessage, i: int, called: dict[str, str]) -> dict:
    """One message's dict. Each protobuf field is read once and messages are formatted only for a
    refusal: a long agent history is thousands of these on the router's event loop."""
    role, content, tool_call_id = m.role, m.content, m.tool_call_id
    if role not in CHAT_ROLES:
        raise ValidationError(
            f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
        )
    out: dict = {"role": role, "content": content}
    if m.tool_calls:
        where = f"chat.messages[{i}]"
        _check(role == "assistant", f"{where}.tool_calls", f"only on assistant messages, not {role!r}")
        calls = []
        for j, call in enumerate(m.tool_calls):
            _check(bool(call.name), f"{where}.tool_calls[{j}].name", "must not be empty")
            arguments = _json_object(call.arguments or "{}", f"{where}.tool_calls[{j}].arguments")
            function = {"name": call.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
        called.update((call.id, call.name) for call in m.tool_calls if call.id)
        if not content:
            out["content"] = None  # as transformers and vLLM pass it (DeepSeek's template tests for none)
    if tool_call_id and role != "tool":
        raise ValidationError(f"chat.messages[{i}].tool_call_id", f"only on tool messages, not {role!r}")
    if role == "tool":
        out["tool_call_id"] = tool_call_id
        if tool_call_id in called:  # the function's name: Hermes' template writes it
            out["name"] = called[tool_call_id]
    return out


def _tool(tool: pb.Tool, i: int) -> dict:
    where = f"chat.tools[{i}]"
    _check(
        TOOL_NAME.fullmatch(tool.name) is not None,
        f"{where}.name",
        f"must be 1-64 letters, digits, '_' or '-', got {tool.name[:80]!r}",
    )
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = _json_object(tool.parameters, f"{where}.parameters")
    return {"type": "function", "function": function}


def chat_chars(chat: pb.Chat) -> int:
    """The characters a chat renders from: contents, calls, tool definitions (one pass)."""
    total = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    for m in chat.messages:
        total += len(m.content) + len(m.tool_call_id)
        for c in m.tool_calls:
            total += len(c.id) + len(c.name) + len(c.arguments)
    return total


def validate_chat(chat: pb.Chat, limits: Limits) -> dict:
    messages = chat.messages
    _check(len(messages) > 0, "chat.messages", "must not be empty")
    _check(
        len(messages) <= limits.max_chat_messages,
        "chat.messages",
        f"more than {limits.max_chat_messages} messages",
    )
    _check(len(chat.tools) <= MAX_TOOLS, "chat.tools", f"more than {MAX_TOOLS} tools")
    chars = chat_chars(chat)
    _check(
        chars <= limits.max_prompt_chars,
        "chat.messages",
        f"longer than {limits.max_prompt_chars} characters in total",
    )
    called: dict[str, str] = {}  # call id -> function name, from the assistant messages so far
    out = tuple(_message(m, i, called) for i, m in enumerate(messages))
    _check(any(m["content"] or "tool_calls" in m for m in out), "chat.messages", "all messages are empty")
    tools = tuple(_tool(t, i) for i, t in enumerate(chat.tools))
    seen: set[str] = set()
    for i, tool in enumerate(chat.tools):
        _check(tool.name not in seen, f"chat.tools[{i}].name", f"{tool.name!r} is given twice")
        seen.add(tool.name)
    return {"chat": out, "tools": tools, "chat_chars": chars}
