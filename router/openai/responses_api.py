"""POST /v1/responses: OpenAI's Responses API, text in and text out, over the chat pipeline.

Contract
- input: `{"input": str | [message], "instructions"?, "model"?, "max_output_tokens"?,
  "temperature"?, "top_p"?, "seed"?, "text"?: {"format": {"type": "text" | "json_object" |
  "json_schema", "name", "schema", "strict"}}, "stream"?}`; a message is `{"role": "user" |
  "assistant" | "system" | "developer", "content": str | [{"type": "input_text" | "output_text",
  "text"}]}` (`"type": "message"` optional). `store`, `include`, `metadata`, `user`,
  `truncation`, `reasoning`, `parallel_tool_calls` and unknown keys are ignored (nothing is stored).
- output: a `response` object (`object: "response"`, `status` completed, or incomplete with
  `incomplete_details.reason` "max_output_tokens"; `output`: one assistant message with one
  `output_text` part; `usage` with input/output/total tokens), or with `stream: true` the
  Responses event stream: response.created, response.in_progress, response.output_item.added,
  response.content_part.added, response.output_text.delta..., response.output_text.done,
  response.content_part.done, response.output_item.done, response.completed (or
  response.incomplete), each `event:` + `data:` with a `sequence_number`. A reasoning model's
  thinking is left out of the text (split at `</think>` as for chat).
- How: the request becomes a chat completion request (router/openai/requests.py `parse`), so
  keys, validation, admission, queueing, cancellation and the chat template are the chat
  endpoint's; errors name the Responses parameter (`input`, `max_output_tokens`, `text.format`).
- failure modes: 400 naming the parameter for what this server does not do: `tools` and
  `tool_choice` other than none/auto (use /v1/chat/completions), `top_logprobs` and logprobs in
  `include`, `previous_response_id` and `conversation` (it keeps no responses), `background`,
  input items other than messages, content parts other than text. A generation the server
  cancels is a `failed` response; a failure after a stream began an `error` event, then
  `response.failed`.
- state: none. proven by: tests/test_openai_responses_e2e.py (the openai SDK's
  `client.responses.create`, whole and streamed, against a real router and worker).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from protos.llm.v1 import generation_pb2 as pb
from router.errors import RouterError
from router.openai.reasoning import Reasoning, ReasoningStream, split
from router.openai.requests import ApiError, Parsed, parse
from router.openai.responses import Chunk, Done

ROLES = ("user", "assistant", "system", "developer")
REFUSED = {
    "tools": "not supported on /v1/responses: use /v1/chat/completions for tool calling",
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
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise _bad("input", f"{where}: only messages are supported, got {kind!r}")
        if item.get("role") not in ROLES:
            raise _bad("input", f"{where}.role must be one of {', '.join(ROLES)}")
        messages.append({"role": item["role"], "content": _content(item.get("content"), where)})
    return messages


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
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "there are no tools to call (tools are not supported here)")
    limit = body.get("max_output_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < 1:
        raise _bad("max_output_tokens", f"must be >= 1, got {limit}")


def parse_responses(body: object, request_id: str) -> Parsed:
    """The Responses request as a chat completion request (one choice)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refused(body)
    chat = {"messages": _messages(body), "model": body.get("model"), "stream": body.get("stream")}
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

    def whole(self, chunks: list[Chunk], done: Done) -> dict:
        text = self._text("".join(c.text for c in chunks))
        return self.response("completed", [self.item(text, self.item_status(done))], done)

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
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        yield self.event("response.output_item.added", output_index=0, item=self.item(None, "in_progress"))
        yield self.event("response.content_part.added", **where, part=self.part(""))
        think = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        text, done = "", None
        async for _, event in events:
            if isinstance(event, Done):
                done = event
                pieces = [d.get("content") for d in think.finish()] if think is not None else []
            else:
                pieces = [d.get("content") for d in think.feed(event.text)] if think else [event.text]
            for piece in pieces:
                if piece:
                    text += piece
                    yield self.event("response.output_text.delta", **where, delta=piece, logprobs=[])
        if done is None:
            raise RouterError("the generation stream ended without a finish")
        status = self.item_status(done)
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self.part(text))
        item = self.item(text, status)
        yield self.event("response.output_item.done", output_index=0, item=item)
        final = self.response("completed", [item], done)
        yield self.event(f"response.{final['status']}", response=final)
