"""Client for OpenAI-compatible servers (llama.cpp `llama-server`, vLLM, TGI, and this router's own
HTTP API, docs/openai.md): streaming `POST /v1/completions` with server-sent events, over asyncio
streams (stdlib only). Against our router it gets the same per-request counts as the gRPC client
(tests/test_openai_e2e.py::test_load_tester_openai_target_counts_equal_the_grpc_target).

Contract
- `OpenAIClient(base_url, options, clock_ns)`; base URL `http(s)://host:port[/prefix]` (`/v1` is
  appended unless the prefix ends with it). One connection per request (`Connection: close`), so
  TTFT includes the TCP connect (tens of microseconds on loopback).
- `await send(...)` fills the `RequestRecord` like the gRPC client: each SSE event whose choice
  carries text counts as one token-carrying chunk of one token (these APIs do not say how many
  tokens a chunk holds); `usage` (asked for with `stream_options.include_usage`) gives the
  server's prompt and completion counts. Status: "OK", `HTTP_<code>`, `DEADLINE_EXCEEDED`,
  `CONNECTION_ERROR`, `PROTOCOL_ERROR` or `SERVER_ERROR` (an `error` object in the stream).
- Sends `seed`, and `ignore_eos` unless the run lets EOS end outputs (vLLM and llama.cpp honour
  it; a server that rejects unknown fields needs `--no-ignore-eos`).
- `await server_info(api_key)`: `GET /v1/models`; fills in the model name when none was given.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable

from loadtest.grpc_client import SendOptions
from loadtest.record import RequestRecord
from loadtest.workload import RequestSpec

MAX_ERROR_BODY_BYTES = 4096


class ProtocolError(Exception):
    """The server's HTTP/SSE stream broke the protocol (bad status line, chunk size, event)."""


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode("latin-1")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {status_line!r}")
    headers = {}
    while line := (await reader.readline()).decode("latin-1").strip():
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: chunked, Content-Length or until the server closes."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()).strip():
                    pass  # skip trailer lines up to the blank one
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(65536, remaining))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


def sse_data(buffer: bytearray) -> list[str]:
    """Removes each complete event from `buffer` and returns its `data` field."""
    text = bytes(buffer).replace(b"\r\n", b"\n")
    *events, rest = text.split(b"\n\n")
    buffer[:] = rest
    out = []
    for event in events:
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines).decode("utf-8"))
    return out


class OpenAIClient:
    api = "openai"

    def __init__(self, base_url: str, options: SendOptions, clock_ns: Callable[[], int]):
        parts = urllib.parse.urlsplit(base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        prefix = parts.path.rstrip("/")
        self._prefix = prefix if prefix.endswith("/v1") else prefix + "/v1"
        self._options = options
        self._model = options.model
        self._clock_ns = clock_ns

    async def _open(self, method: str, path: str, body: bytes | None, api_key: str):
        reader, writer = await asyncio.open_connection(
            self._host, self._port, ssl=ssl.create_default_context() if self._https else None
        )
        head = [
            f"{method} {self._prefix}{path} HTTP/1.1",
            f"Host: {self._host}:{self._port}",
            "Connection: close",
            "Accept: text/event-stream, application/json",
        ]
        if api_key:
            head.append(f"Authorization: Bearer {api_key}")
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b""))
        await writer.drain()
        return reader, writer

    def build_body(self, spec: RequestSpec) -> dict:
        o = self._options
        prompt = list(spec.prompt_ids) if o.prompt_format == "tokens" and spec.prompt_ids else spec.prompt
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": o.temperature,
            "seed": spec.seed,
        }
        if o.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(
        self, spec: RequestSpec, record: RequestRecord, request_id: str, api_key: str = "", priority: int = 0
    ) -> None:
        body = json.dumps(self.build_body(spec)).encode()
        record.sent_ns = self._clock_ns()
        writer = None
        try:
            async with asyncio.timeout(self._options.timeout_s):
                reader, writer = await self._open("POST", "/completions", body, api_key)
                status, headers = await read_head(reader)
                if status != 200:
                    detail = b""
                    async for data in read_body(reader, headers):
                        detail += data
                        if len(detail) > MAX_ERROR_BODY_BYTES:
                            break
                    record.status = f"HTTP_{status}"
                    record.error = detail[:MAX_ERROR_BODY_BYTES].decode("utf-8", "replace")
                else:
                    await self._read_stream(reader, headers, record)
        except TimeoutError:
            record.status, record.error = "DEADLINE_EXCEEDED", f"no reply within {self._options.timeout_s} s"
        except (ProtocolError, ValueError, asyncio.IncompleteReadError) as exc:
            record.status, record.error = "PROTOCOL_ERROR", str(exc)
        except OSError as exc:
            record.status, record.error = "CONNECTION_ERROR", str(exc)
        finally:
            record.end_ns = self._clock_ns()
            if writer is not None:
                writer.close()

    async def _read_stream(self, reader, headers, record: RequestRecord) -> None:
        buffer = bytearray()
        async for data in read_body(reader, headers):
            now = self._clock_ns()
            buffer += data
            for item in sse_data(buffer):
                if item.strip() == "[DONE]":
                    return
                event = json.loads(item)
                if "error" in event:
                    record.status, record.error = "SERVER_ERROR", json.dumps(event["error"])[:500]
                    return
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        record.chunk_ns.append(now)
                        record.chunk_tokens.append(1)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_prompt_tokens = details.get("cached_tokens")
        if not record.finish_reason:
            raise ProtocolError("stream ended before a finish_reason or [DONE]")

    async def server_info(self, api_key: str = "") -> dict:
        try:
            async with asyncio.timeout(10.0):
                reader, writer = await self._open("GET", "/models", None, api_key)
                try:
                    status, headers = await read_head(reader)
                    body = b"".join([d async for d in read_body(reader, headers)])
                finally:
                    writer.close()
            if status != 200:
                return {"api": "openai", "error": f"HTTP_{status}"}
            models = [m.get("id", "") for m in json.loads(body).get("data", [])]
        except (OSError, TimeoutError, ProtocolError, ValueError) as exc:
            return {"api": "openai", "error": str(exc)}
        if not self._model and models:
            self._model = models[0]
        return {"api": "openai", "models": [{"id": m} for m in models], "model_used": self._model}

    async def close(self) -> None:
        return None
