"""POST /v1/responses: OpenAI's Responses API over the chat pipeline: text, structured output and
function tools.

Contract
- input: `{"input": str | [item], "instructions"?, "model"?, "max_output_tokens"?,
  "temperature"?, "top_p"?, "seed"?, "text"?: {"format": {"type": "text" | "json_object" |
  "json_schema", "name", "schema", "strict"}}, "tools"?: [{"type": "function", "name",
  "description", "parameters"}], "tool_choice"?, "parallel_tool_calls"?, "stream"?}`; an item is a
  message `{"role": "user" | "assistant" | "system" | "developer", "content": str | [{"type":
  "input_text" | "output_text", "text"}]}` (`"type": "message"` optional), an earlier call
  `{"type": "function_call", "call_id", "name", "arguments"}` or its result `{"type":
  "function_call_output", "call_id", "output"}`. `store`, `metadata`, `user`, `truncation`,
  `reasoning` and unknown keys are ignored (nothing is stored).
- output: a `response` object (`object: "response"`; `status` completed, incomplete with
  `incomplete_details.reason` "max_output_tokens", or failed when the server cancelled it;
  `output`: an assistant message with one `output_text` part when there is text, then one
  `function_call` item per call; `usage`), or with `stream: true` the Responses event stream:
  response.created, response.in_progress, per item response.output_item.added, its
  response.content_part.added + response.output_text.delta... or
  response.function_call_arguments.delta..., and at the end each item's done events
  (response.output_text.done + response.content_part.done, or
  response.function_call_arguments.done) and response.output_item.done, then response.completed
  (or .incomplete / .failed); each `event:` + `data:` with a `sequence_number`. A reasoning model's
  thinking is left out of the text (split at `</think>` as for chat).
- How: the request becomes a chat completion request (router/openai/requests.py `parse`; tools and
  calls in the chat form), so keys, validation, admission, queueing, cancellation, the chat
  template and the reading of tool calls (router/openai/tools.py) are the chat endpoint's; errors
  name the Responses parameter (`input`, `max_output_tokens`, `text.format`, `tools[i]...`).
- failure modes: 400 naming the parameter for what this server does not do: tools other than
  functions, `top_logprobs` and logprobs in `include` (use /v1/chat/completions),
  `previous_response_id` and `conversation` (it keeps no responses), `background`, other input
  items, content parts other than text. A failure after a stream began is an `error` event, then
  `response.failed`.
- state: none. proven by: tests/test_openai_responses_e2e.py (the openai SDK's
  `client.responses.create`, whole and streamed, with tools, against a real router and worker).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from protos.llm.v1 import generation_pb2 as pb
from router.errors import RouterError
from router.openai.reasoning import Reasoning, ReasoningStream, split
from router.openai.requests import ApiError, Parsed, parse
from router.openai.responses import Chunk, Done
from router.openai.tools import ToolStream, extract

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


def _messages(body: dict) -> list[dict]:
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
        if kind == "function_call":  # an earlier call: consecutive ones make one assistant turn
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":  # its result
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
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
    chat = {"messages": _messages(body), "model": body.get("model"), "stream": body.get("stream")}
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
        param = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", param or "")
        if param != err.param:
            raise _bad(param, err.message.split(": ", 1)[-1]) from None
        raise
    # the service's own checks name protobuf fields: these map them to this API's parameters
    parsed.max_tokens_param = "max_output_tokens"
    parsed.params["chat.messages"] = "input"
    for kind in ("json_object", "json_schema"):
        parsed.params[f"response_format.{kind}"] = "text.format"
    return parsed


class ResponseBuilder:
    """The `response` object and its events, for one request's single choice."""

    def __init__(self, parsed: Parsed, model: str, reasoning: Reasoning | None):
        self.parsed, self.model, self.reasoning = parsed, model, reasoning
        self.id = f"resp_{parsed.request_id or uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0

    def _text(self, text: str) -> str:
        return (split(text, self.reasoning)[1] or "") if self.reasoning is not None else text

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self, status: str, output: list[dict], done: Done | None = None) -> dict:
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        if done is not None:
            prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": done.usage.cached_prompt_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
            if done.reason == pb.FINISH_REASON_LENGTH:
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            elif done.reason == pb.FINISH_REASON_CANCELLED:  # aborted by the server: not a whole answer
                out["status"] = "failed"
                out["error"] = {
                    "code": "server_error",
                    "message": "the generation was cancelled by the server",
                }
        return out

    @staticmethod
    def item_status(done: Done) -> str:
        return "completed" if done.reason == pb.FINISH_REASON_STOP else "incomplete"

    def call_item(self, call: dict, status: str) -> dict:
        """A `function_call` output item from a chat tool call (router/openai/tools.py's form)."""
        return {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"].get("arguments", ""),
        }

    def whole(self, chunks: list[Chunk], done: Done) -> dict:
        text = self._text("".join(c.text for c in chunks))
        status = self.item_status(done)
        calls = []
        if self.parsed.tools is not None:
            text, calls = extract(text, self.parsed.tools)
        output = [self.item(text or "", status)] if text or not calls else []
        output += [self.call_item(call, "completed") for call in calls]
        return self.response("completed", output, done)

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    async def stream(self, events: AsyncIterator[tuple[int, Chunk | Done]], error_of) -> AsyncIterator[bytes]:
        """The event stream; a failure after it began is an `error` event (`error_of(exc)`: its
        ApiError), and the stream ends."""
        try:
            async for data in self._events(events):
                yield data
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report it in the stream
            err = error_of(exc)
            yield self.event("error", code=err.code or err.type, message=err.message, param=err.param)
            failed = self.response("failed", [])
            failed["error"] = {"code": "server_error", "message": err.message}
            yield self.event("response.failed", response=failed)

    async def _events(self, events: AsyncIterator[tuple[int, Chunk | Done]]) -> AsyncIterator[bytes]:
        """Items as they come: the message (at once without tools; with tools when content does),
        then each function call (its arguments as they are generated, or whole)."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        think = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        tools = ToolStream(self.parsed.tools) if self.parsed.tools is not None else None
        items: list[dict] = []  # in output order: {"item", "text"} (message) or {"item", "call"}
        message: dict | None = None
        calls: dict[int, dict] = {}

        def open_message() -> list[bytes]:
            nonlocal message
            message = {"item": self.item(None, "in_progress"), "text": "", "index": len(items)}
            items.append(message)
            where = {"item_id": self.item_id, "output_index": message["index"], "content_index": 0}
            return [
                self.event("response.output_item.added", output_index=message["index"], item=message["item"]),
                self.event("response.content_part.added", **where, part=self.part("")),
            ]

        if tools is None:
            for data in open_message():
                yield data
        done = None
        async for _, event in events:
            if isinstance(event, Done):
                done = event
                pieces = [d.get("content") for d in think.finish()] if think is not None else []
            else:
                pieces = [d.get("content") for d in think.feed(event.text)] if think else [event.text]
            deltas = []
            for piece in pieces:
                if piece:
                    deltas += tools.feed(piece) if tools is not None else [{"content": piece}]
            if done is not None and tools is not None:
                deltas += tools.finish()
            for delta in deltas:
                if delta.get("content"):
                    if message is None:
                        for data in open_message():
                            yield data
                    message["text"] += delta["content"]
                    where = {"item_id": self.item_id, "output_index": message["index"], "content_index": 0}
                    yield self.event(
                        "response.output_text.delta", **where, delta=delta["content"], logprobs=[]
                    )
                for call in delta.get("tool_calls", ()):
                    entry = calls.get(call["index"])
                    if entry is None:
                        item = self.call_item(
                            {**call, "function": {**call["function"], "arguments": ""}}, "in_progress"
                        )
                        entry = calls[call["index"]] = {"item": item, "index": len(items)}
                        items.append(entry)
                        yield self.event("response.output_item.added", output_index=entry["index"], item=item)
                    arguments = call["function"].get("arguments", "")
                    if arguments:
                        entry["item"]["arguments"] += arguments
                        where = {"item_id": entry["item"]["id"], "output_index": entry["index"]}
                        yield self.event("response.function_call_arguments.delta", **where, delta=arguments)
        if done is None:
            raise RouterError("the generation stream ended without a finish")
        status = self.item_status(done)
        output = []
        for entry in items:
            if entry is message:
                text = message["text"]
                where = {"item_id": self.item_id, "output_index": entry["index"], "content_index": 0}
                yield self.event("response.output_text.done", **where, text=text, logprobs=[])
                yield self.event("response.content_part.done", **where, part=self.part(text))
                item = self.item(text, status)
            else:
                item = {**entry["item"], "status": "completed"}
                where = {"item_id": item["id"], "output_index": entry["index"]}
                yield self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            output.append(item)
            yield self.event("response.output_item.done", output_index=entry["index"], item=item)
        final = self.response("completed", output, done)
        yield self.event(f"response.{final['status']}", response=final)
