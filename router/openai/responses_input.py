"""The Responses API's request (POST /v1/responses) as a chat completion request: router/openai/
responses_api.py's docstring gives the parameters; this module checks them and builds the chat
body, and maps the chat pipeline's error names back to this API's.

Contract
- `parse_responses(body, request_id) -> Parsed` (router/openai/requests.py's, one choice), or
  `ApiError(400)` naming the Responses parameter.
- state: none (pure). proven by: tests/test_openai_responses_e2e.py.
"""

from __future__ import annotations

import re

from router.openai.requests import ApiError, Parsed, parse

ROLES = ("user", "assistant", "system", "developer")
REFUSED = {
    "top_logprobs": "not supported on /v1/responses: use /v1/chat/completions for logprobs",
    "previous_response_id": "not supported: this server keeps no responses (send the whole input)",
    "conversation": "not supported: this server keeps no conversations (send the whole input)",
    "background": "not supported: responses run in the foreground",
}
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _bad(param: str, problem: str) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param)


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise _bad("input", f"{where}.content[{j}]: only input_text and output_text parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict, origin: dict[int, int]) -> list[dict]:
    """The chat messages of `instructions` and `input`; `origin`: chat message index -> the input
    item it came from (a function call's, for the service's errors)."""
    value = body.get("input")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return messages + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "required: a string or a non-empty list of messages")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind in ("function_call", "function_call_output") and not isinstance(item.get("call_id"), str):
            raise _bad("input", f"{where}.call_id: required, a string")
        if kind == "function_call":  # an earlier call: part of the assistant turn before it, if any
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            origin.setdefault(len(messages) - 1, i)  # the turn's first call
        elif kind == "function_call_output":  # its result
            output = item.get("output")
            if output is None:
                raise _bad("input", f"{where}.output: required, a string or a list of text parts")
            content = output if isinstance(output, str) else _content(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "message":
            if item.get("role") not in ROLES:
                raise _bad("input", f"{where}.role must be one of {', '.join(ROLES)}")
            messages.append({"role": item["role"], "content": _content(item.get("content"), where)})
        else:
            raise _bad("input", f"{where}: messages, function_call and function_call_output, got {kind!r}")
    return messages


def _tools(body: dict, chat: dict) -> None:
    """Responses' flat function tools and tool_choice in the chat form."""
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise _bad("tools", f"tools[{i}]: only function tools are supported, got {kind!r}")
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice == "auto" and not tools:
        choice = None  # what clients send by default, tools or not
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad("tool_choice", "a function ({type: function, name}), auto, none or required")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format", "type must be text, json_object or json_schema")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format", "schema: required, a JSON Schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    return {"type": fmt["type"]}


def _refused(body: dict) -> None:
    for name, problem in REFUSED.items():
        if body.get(name):
            raise _bad(name, problem)
    include = body.get("include")
    if isinstance(include, list) and any("logprobs" in str(i) for i in include):
        raise _bad("include", REFUSED["top_logprobs"])
    limit = body.get("max_output_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < 1:
        raise _bad("max_output_tokens", f"must be >= 1, got {limit}")


def parse_responses(body: object, request_id: str) -> Parsed:
    """The Responses request as a chat completion request (one choice)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refused(body)
    origin: dict[int, int] = {}
    chat = {"messages": _messages(body, origin), "model": body.get("model"), "stream": body.get("stream")}
    _tools(body, chat)
    for name in ("temperature", "top_p", "seed"):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        parsed = parse(chat, chat=True, request_id=request_id)
    except ApiError as err:
        param = next((v for k, v in PARAMS.items() if (err.param or "").startswith(k)), err.param)
        param = re.sub(r"^(tools\[\d+\])\.function(\.|$)", r"\1\2", param or "")
        if param != err.param:
            raise _bad(param, err.message.split(": ", 1)[-1]) from None
        raise
    # the service's own checks name protobuf fields: these map them to this API's parameters
    parsed.max_tokens_param = "max_output_tokens"
    parsed.params["chat.messages"] = "input"
    for i in range(len(chat.get("tools", ()))):
        for field in ("name", "parameters"):
            parsed.params[f"chat.tools[{i}].{field}"] = f"tools[{i}].{field}"
    for m, i in origin.items():
        for j in range(len(chat["messages"][m]["tool_calls"])):
            for field in ("name", "arguments"):
                parsed.params[f"chat.messages[{m}].tool_calls[{j}].{field}"] = f"input[{i + j}].{field}"
    for kind in ("json_object", "json_schema"):
        parsed.params[f"response_format.{kind}"] = "text.format"
    return parsed
