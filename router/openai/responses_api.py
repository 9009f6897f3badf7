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
  response.function_call_arguments.delta..., then its done events (response.output_text.done +
  response.content_part.done, or response.function_call_arguments.done) and
  response.output_item.done before the next item is added; then response.completed
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
- The request side (checks, the chat body, error names) is router/openai/responses_input.py;
  this module builds the answer (`ResponseBuilder`).
- state: none. proven by: tests/test_openai_responses_e2e.py (the openai SDK's
  `client.responses.create`, whole and streamed, with tools, against a real router and worker).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from protos.llm.v1 import generation_pb2 as pb
from router.errors import RouterError
from router.openai.reasoning import Reasoning, ReasoningStream, split
from router.openai.requests import Parsed
from router.openai.responses import Chunk, Done
from router.openai.responses_input import parse_responses  # noqa: F401 - the route's entry, with the builder
from router.openai.tools import ToolStream, extract


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
        output = [self.item(text or "", "completed")] if text or not calls else []
        output += [self.call_item(call, "completed") for call in calls]
        output[-1]["status"] = status  # the finish is the last item's; those before it completed, as streamed
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
        then each function call (its arguments as they are generated, or whole). Each item is
        closed before the next is added (content never follows a call: router/openai/tools.py)."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        think = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        tools = ToolStream(self.parsed.tools) if self.parsed.tools is not None else None
        items: list[dict] = []  # in output order: the message {"text"} or a call {"item"}
        opened: dict | None = None  # the item whose done events are still to come
        calls: dict[int, dict] = {}
        done = None
        status = "completed"  # until the finish says otherwise

        def add(entry: dict) -> list[bytes]:
            entry["index"] = len(items)
            items.append(entry)
            out = close()
            nonlocal opened
            opened = entry
            if "text" in entry:  # the message
                out.append(
                    self.event(
                        "response.output_item.added",
                        output_index=entry["index"],
                        item=self.item(None, "in_progress"),
                    )
                )
                out.append(
                    self.event("response.content_part.added", **self._where(entry), part=self.part(""))
                )
            else:
                out.append(
                    self.event("response.output_item.added", output_index=entry["index"], item=entry["item"])
                )
            return out

        def close() -> list[bytes]:
            nonlocal opened
            entry, opened = opened, None
            if entry is None:
                return []
            if "text" in entry:
                text = entry["text"]
                out = [
                    self.event("response.output_text.done", **self._where(entry), text=text, logprobs=[]),
                    self.event("response.content_part.done", **self._where(entry), part=self.part(text)),
                ]
                entry["done"] = self.item(text, status)
            else:
                item = entry["done"] = {**entry["item"], "status": status}
                where = {"item_id": item["id"], "output_index": entry["index"]}
                done_args = {"name": item["name"], "arguments": item["arguments"]}
                out = [self.event("response.function_call_arguments.done", **where, **done_args)]
            return out + [
                self.event("response.output_item.done", output_index=entry["index"], item=entry["done"])
            ]

        message: dict | None = None
        if tools is None:
            message = {"text": ""}
            for data in add(message):
                yield data
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
                        message = {"text": ""}
                        for data in add(message):
                            yield data
                    message["text"] += delta["content"]
                    yield self.event(
                        "response.output_text.delta",
                        **self._where(message),
                        delta=delta["content"],
                        logprobs=[],
                    )
                for call in delta.get("tool_calls", ()):
                    entry = calls.get(call["index"])
                    if entry is None:
                        first = {**call, "function": {**call["function"], "arguments": ""}}
                        entry = calls[call["index"]] = {"item": self.call_item(first, "in_progress")}
                        for data in add(entry):
                            yield data
                    arguments = call["function"].get("arguments", "")
                    if arguments:
                        entry["item"]["arguments"] += arguments
                        where = {"item_id": entry["item"]["id"], "output_index": entry["index"]}
                        yield self.event("response.function_call_arguments.delta", **where, delta=arguments)
        if done is None:
            raise RouterError("the generation stream ended without a finish")
        status = self.item_status(done)
        if not items:  # nothing but whitespace with tools: an empty message, as `whole` gives
            message = {"text": ""}
            for data in add(message):
                yield data
        for data in close():
            yield data
        final = self.response("completed", [entry["done"] for entry in items], done)
        yield self.event(f"response.{final['status']}", response=final)

    def _where(self, message: dict) -> dict:
        return {"item_id": self.item_id, "output_index": message["index"], "content_index": 0}
