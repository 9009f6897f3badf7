"""Tools in chat prompts: what a chat template is given when a conversation has tool definitions,
assistant tool calls or tool results (the torch-free half of tool calling; the router renders).

Contract
- input: messages as validated dicts, `{"role", "content"}` plus, on an assistant message,
  `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments": dict}}]`, the
  arguments already parsed, as transformers' templates expect) and, on a "tool" message,
  `tool_call_id`; tools in transformers' form (`[{"type": "function", "function": {"name",
  "description", "parameters"}}]`); what the model's template can take (`TemplateFeatures`).
- output: `template_inputs(...) -> (messages, tools)` for `template.render(messages=..., tools=...)`.
  A template that reads `tools` (Llama 3.1, Qwen2.5, Hermes, Mistral v3) gets them as they are; one
  that does not (SmolLM2's ChatML) gets none and the tools are written into the system message
  instead (TOOL_SYSTEM_PROMPT, the Hermes / Qwen2.5 wording, which asks for `<tool_call>` JSON:
  the format the OpenAI front parses), or into the first message for a template that refuses a
  system role (Gemma). A template that does not read `tool_calls` gets each assistant call as
  `<tool_call>` text in the content and the tool results in `<tool_response>` tags in the user
  turn next to them (what Qwen2.5's template writes). A template that accepts call ids of one
  length only (Mistral v0.3's: 9 alphanumerics) gets every call id, on the calls and on the
  results, mapped to one of that length (`template_call_id`: kept if it fits, else a hash prefix;
  ids the API hands out are `call_<24 hex>`).
  Strings are carried as they are (f-strings, `json.dumps(ensure_ascii=False)`), so the
  sentinels common/tokenizer.py puts in place of control-token text come out unchanged, except in
  a call id mapped by `template_call_id` (hashed: the tokenizer then checks the prompt's own
  control tokens instead, common/tokenizer.py).
- state: none (pure).
- failure modes: none of its own; the template may still refuse the messages (TemplateError).
- proven by: tests/test_chat_tools.py (against transformers' rendering of a tool-aware template).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.meta

TOOL_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


# A template that refuses call ids of any other length (Mistral v0.3's: `tool_call.id|length != 9`).
_ID_LENGTH_CHECK = re.compile(r"(?:\.id|tool_call_id)\s*\|\s*length\s*!=\s*(\d+)")


@dataclass(frozen=True)
class TemplateFeatures:
    tools: bool  # the template reads a `tools` variable
    tool_calls: bool  # the template writes assistant tool calls (and so, tool results) itself
    call_id_length: int | None = None  # the only call id length the template accepts, if it checks

    @classmethod
    def of(cls, source: str) -> TemplateFeatures:
        env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])  # parsed only, never rendered
        variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        length = _ID_LENGTH_CHECK.search(source)
        return cls(
            tools="tools" in variables,
            tool_calls="tool_calls" in source,
            call_id_length=int(length.group(1)) if length and 0 < int(length.group(1)) <= 64 else None,
        )


def template_call_id(call_id: str, length: int) -> str:
    """`call_id` as a template that takes only alphanumeric ids of `length` characters sees it:
    itself when it is one, else the first characters of its SHA-256 (hex): stable, so a call and
    the result that names it still match."""
    if len(call_id) == length and call_id.isalnum() and call_id.isascii():
        return call_id
    return hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:length]


def _with_call_ids(messages: list[dict], length: int) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "id": template_call_id(c.get("id") or "", length)} for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        elif m["role"] == "tool" and "tool_call_id" in m:
            m = {**m, "tool_call_id": template_call_id(m["tool_call_id"] or "", length)}
        out.append(m)
    return out


def call_text(call: dict) -> str:
    """One call as the Hermes format writes it (what TOOL_SYSTEM_PROMPT asks the model for)."""
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _as_text(message: dict) -> dict:
    """A message with tool calls or a tool result, for a template that writes neither."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = "\n".join(call_text(call) for call in message["tool_calls"])
    content = f"{message['content']}\n{calls}" if message["content"] else calls
    return {"role": message["role"], "content": content}


def _written_out(messages: list[dict]) -> list[dict]:
    """Calls and results as text; a tool result joins the user turn next to it (one turn for
    several results, as Qwen2.5's template writes them; templates that need user and assistant to
    alternate accept it)."""
    out: list[dict] = []
    for m in messages:
        result = m["role"] == "tool"
        m = _as_text(m) if result or m.get("tool_calls") else {"role": m["role"], "content": m["content"]}
        joins = (
            out and out[-1]["role"] == "user" and m["role"] == "user" and (result or out[-1].get("_result"))
        )
        if joins:
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{m['content']}", "_result": True}
        else:
            out.append({**m, "_result": True} if result else m)
    return [{k: v for k, v in m.items() if k != "_result"} for m in out]


def template_inputs(
    messages: list[dict], tools: list[dict] | None, features: TemplateFeatures, system_role: bool = True
) -> tuple[list[dict], list[dict] | None]:
    """The `messages` and `tools` to render a template with (see the module docstring). Without
    `system_role` (a template that refuses one), the tool prompt opens the first message instead."""
    if not features.tool_calls:
        messages = _written_out(messages)
    elif features.call_id_length:
        messages = _with_call_ids(messages, features.call_id_length)
    if not tools or features.tools:
        return messages, tools or None
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = TOOL_SYSTEM_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": content}, *messages[1:]], None
    if messages and not system_role:
        first = messages[0]
        content = f"{prompt}\n\n{first['content']}" if first["content"] else prompt
        return [{**first, "content": content}, *messages[1:]], None
    return [{"role": "system", "content": prompt}, *messages], None
