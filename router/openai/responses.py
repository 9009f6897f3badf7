"""Relay events -> OpenAI response JSON: whole responses, SSE chunks, usage and logprobs.

Contract
- input: the `Parsed` request, the model name, and per choice (index) the service's `TokenChunk`s
  and `Finished` (the same protobuf messages the gRPC API streams); `decode(ids) -> str` under the
  model's tokenizer (token texts for logprobs, a token-id prompt's text for echo).
- output: `chat.completion` / `text_completion` objects and their streamed `chunk` forms (one
  choice per chunk, each with its `index`; `system_fingerprint` null); usage summed over the
  choices, each prompt counted once (as OpenAI counts `n`), with
  `prompt_tokens_details.cached_tokens`; finish_reason stop | length | abort (the worker ended it)
  and `stop_reason`, the stop string or stop token id that matched (vLLM's field; null for EOS or
  length); logprobs in the chat form (`content: [{token, logprob, bytes, top_logprobs}]`) or the
  completions form (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). Completions with
  `echo`: the choice's first chunk (or its last, if none came before) starts with the prompt's
  text, and with logprobs its tokens' entries (the first token's logprob and top_logprobs null: it
  has no context; the rest from the first `TokenChunk.prompt_logprobs`); with `max_tokens` 0
  (`Parsed.echo_only`) the generated token is left out of text, logprobs and usage, and
  finish_reason is length.
- state: per response (id, created time, each choice's text offset for the logprobs).
- failure modes: an echo with logprobs whose choice ended before its prompt was scored (the
  worker ended it before its first token) -> `Unavailable` (503, or the stream's error event),
  never a 200 with the prompt's logprobs missing.
- proven by: tests/test_openai_e2e.py (the openai SDK parses every shape).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from protos.llm.v1 import generation_pb2 as pb
from router.errors import Unavailable
from router.openai.reasoning import Reasoning, ReasoningStream, split
from router.openai.requests import Parsed
from router.openai.tools import ToolStream, extract

Chunk, Done = pb.TokenChunk, pb.Finished
FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "abort",
}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def usage(dones: list[Done], n: int = 1, completions: bool = True) -> dict:
    """Usage of every choice's `Finished` (index order, `n` choices per prompt): completion tokens
    summed (none when `completions` is False: echo only), the prompt (and its cached tokens)
    counted once per prompt."""
    prompt = sum(d.usage.prompt_tokens for d in dones[::n])
    completion = sum(d.usage.completion_tokens for d in dones) if completions else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.usage.cached_prompt_tokens for d in dones[::n])},
    }


def stop_reason(done: Done) -> str | int | None:
    kind = done.WhichOneof("stop_reason")
    return None if kind is None else getattr(done, kind)


class Responder:
    def __init__(
        self,
        parsed: Parsed,
        model: str,
        decode: Callable[[list[int]], str],
        reasoning: Reasoning | None = None,
    ):
        self.parsed, self.model, self._decode = parsed, model, decode
        # a reasoning model's chat answers split at </think>, constrained ones too (the service runs
        # their grammar after the think block: common.structured.after_thinking)
        self._reasoning = reasoning if parsed.chat else None
        rid = parsed.request_id or parsed.request.request_id
        self.id = f"chatcmpl-{rid}" if parsed.chat else f"cmpl-{rid}"
        self.object = "chat.completion" if parsed.chat else "text_completion"
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice index -> text offset (completions logprobs)
        # choices whose prompt is still to be echoed (completions with echo)
        self._echo_pending = set(range(len(parsed.choices))) if parsed.echo else set()
        self._texts: dict[int, str] = {}  # token id -> its text (a scored prompt repeats many)
        # streaming chat with tools or reasoning: each choice's readers (reasoning first, then tools)
        self._readers: dict[int, tuple[ReasoningStream | None, ToolStream | None]] = {}

    # -- logprobs ---------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs(self, chunks: list[Chunk], index: int = 0) -> dict | None:
        if not self.parsed.logprobs:
            return None
        pairs = [
            (token, lp, c.top_logprobs[i] if i < len(c.top_logprobs) else None)
            for c in chunks
            for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs))
        ]
        if self.parsed.chat:
            content = []
            for token, lp, top in pairs:
                entry = self._entry(token, lp)
                entry["top_logprobs"] = (
                    [self._entry(t, v) for t, v in zip(top.token_ids, top.logprobs)] if top else []
                )
                content.append(entry)
            return {"content": content}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for token, lp, top in pairs:
            text = self._token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(
                {self._token_text(t): v for t, v in zip(top.token_ids, top.logprobs)} if top else {}
            )
            out["text_offset"].append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return out

    def _echo(self, index: int, chunks: list[Chunk]) -> tuple[str, dict | None]:
        """Choice `index`'s prompt text and, with logprobs, its tokens' completions-form entries
        (from the chunk that carries `prompt_logprobs`); ("", None) once echoed."""
        if index not in self._echo_pending:
            return "", None
        self._echo_pending.discard(index)
        req = self.parsed.request_of(index)
        text = req.prompt if req.WhichOneof("input") == "prompt" else self._decode(list(req.token_ids.ids))
        if not self.parsed.logprobs:
            return text, None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        scored = next((c.prompt_logprobs for c in chunks if c.HasField("prompt_logprobs")), None)
        if scored is None:
            raise Unavailable(f"choice {index} ended before its prompt was scored (the worker ended it)")
        offset = 0
        tops = scored.top_logprobs
        for k, token in enumerate(scored.token_ids):
            piece = self._token_text(token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(scored.logprobs[k - 1] if k else None)
            top = None  # the first token has no context
            if k:
                pairs = zip(tops[k - 1].token_ids, tops[k - 1].logprobs) if tops else ()
                top = {self._token_text(t): v for t, v in pairs}
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(piece)
        self._offsets[index] = offset
        return text, out

    # -- whole response ---------------------------------------------------------------------
    def _choice(
        self, index: int, text: str | None, chunks: list[Chunk], done: Done | None, delta: bool
    ) -> dict:
        choice: dict = {"index": index}
        called = False  # the answer is tool calls (finish_reason tool_calls)
        if self.parsed.chat:
            body = {} if text is None else {"content": text}
            if delta:
                choice["delta"] = body
                tools = self._readers.get(index, (None, None))[1]
                called = tools is not None and tools.calls > 0
            else:
                message = {"role": "assistant", "content": text or ""}
                if self._reasoning is not None:
                    message["reasoning_content"], message["content"] = split(text or "", self._reasoning)
                if self.parsed.tools is not None:
                    message["content"], calls = extract(message["content"] or "", self.parsed.tools)
                    if calls:
                        message["tool_calls"], called = calls, True
                choice["message"] = message
            choice["logprobs"] = self.logprobs(chunks, index)  # {"content": []} for no tokens, as OpenAI
        else:
            echoed, prompt_lp = self._echo(index, chunks) if self.parsed.echo else ("", None)
            generated = [] if self.parsed.echo_only else chunks
            choice["text"] = echoed + ("" if self.parsed.echo_only else text or "")
            logprobs = self.logprobs(generated, index) if generated else None
            if prompt_lp is not None:
                logprobs = {k: v + (logprobs or {}).get(k, []) for k, v in prompt_lp.items()}
            choice["logprobs"] = logprobs
        finish = FINISH.get(done.reason, "abort") if done else None
        if done and self.parsed.echo_only and finish != "abort":
            finish = "length"  # max_tokens 0: the prompt is all there is
        if finish == "stop" and called and self.parsed.tools.choice != "named":
            finish = "tool_calls"  # (OpenAI says stop for a function the request named)
        choice["finish_reason"] = finish
        choice["stop_reason"] = stop_reason(done) if done and not self.parsed.echo_only else None
        return choice

    def _envelope(self, choices: list[dict], chunked: bool) -> dict:
        obj = self.object + (".chunk" if chunked and self.parsed.chat else "")
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,  # OpenAI's field; no backend fingerprint is promised
            "choices": choices,
        }

    def complete(self, choices: list[tuple[list[Chunk], Done]]) -> dict:
        """The whole answer from each choice's (chunks, Finished), in index order."""
        out = self._envelope(
            [
                self._choice(i, "".join(c.text for c in chunks), chunks, done, delta=False)
                for i, (chunks, done) in enumerate(choices)
            ],
            chunked=False,
        )
        out["usage"] = usage([done for _, done in choices], self.parsed.n, not self.parsed.echo_only)
        return out

    # -- streaming --------------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> bytes:
        out = self._envelope(choices, chunked=True)
        if self.parsed.include_usage:
            out["usage"] = None
        return sse(out)

    def start(self) -> bytes:
        """Chat streams open with the assistant's role, one chunk per choice (as OpenAI does)."""
        if not self.parsed.chat:
            return b""
        # (OpenAI's content is null where the answer may be tool calls alone)
        role = {"role": "assistant", "content": None if self.parsed.tools else ""}
        return b"".join(
            self._chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
            for i in range(len(self.parsed.choices) or 1)
        )

    def delta(self, chunk: Chunk, index: int = 0) -> bytes:
        if self.parsed.tools is not None or self._reasoning is not None:
            return self._read_deltas(self._read(index, chunk.text), chunk, index)
        if index not in self._echo_pending:  # (an echo is always sent)
            if self.parsed.echo_only:
                return b""  # max_tokens 0: the generated token is left out
            if not chunk.text and not (self.parsed.logprobs and chunk.token_ids):
                return b""  # text held back (a partial character or a possible stop string)
        return self._chunk([self._choice(index, chunk.text, [chunk], None, delta=True)])

    def _read(self, index: int, text: str | None) -> list[dict]:
        """A piece of choice `index`'s text (None: its end) through its readers: reasoning splits
        off `reasoning_content`, the tool reader turns the rest into content and calls."""
        if index not in self._readers:
            think = ReasoningStream(self._reasoning) if self._reasoning is not None else None
            tools = ToolStream(self.parsed.tools) if self.parsed.tools is not None else None
            self._readers[index] = (think, tools)
        think, tools = self._readers[index]
        if think is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = think.feed(text) if text is not None else think.finish()
        out = []
        for d in deltas:
            out += tools.feed(d["content"]) if tools is not None and "content" in d else [d]
        if text is None and tools is not None:
            out += tools.finish()
        return out

    def _read_deltas(self, deltas: list[dict], chunk: Chunk | None, index: int) -> bytes:
        """Chunks of a read choice's deltas; the chunk's logprobs on the first (a chunk of its own
        when its text is held back)."""
        logprobs = self.logprobs([chunk], index) if chunk is not None and chunk.token_ids else None
        if logprobs is not None and not deltas:
            deltas = [{}]
        return b"".join(
            self._chunk(
                [{"index": index, "delta": d, "logprobs": logprobs if not k else None, "finish_reason": None}]
            )
            for k, d in enumerate(deltas)
        )

    def finish_choice(self, done: Done, index: int = 0) -> bytes:
        """One choice's last chunk: its finish_reason and stop_reason (after what its readers held
        back: content, reasoning, calls)."""
        out = b""
        if self.parsed.tools is not None or self._reasoning is not None:
            out = self._read_deltas(self._read(index, None), None, index)
        return out + self._chunk(
            [self._choice(index, None if self.parsed.chat else "", [], done, delta=True)]
        )

    def end(self, dones: list[Done]) -> bytes:
        """After every choice finished: the usage chunk (with include_usage), then [DONE]."""
        out = b""
        if self.parsed.include_usage:
            last = self._envelope([], chunked=True)
            last["usage"] = usage(dones, self.parsed.n, not self.parsed.echo_only)
            out += sse(last)
        return out + sse("[DONE]")

    def error(self, status: int, body: dict) -> bytes:
        """An error after the stream began: an `error` event (the status line is already sent)."""
        return sse({**body, "status_code": status}) + sse("[DONE]")
