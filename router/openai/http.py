"""The HTTP front's plumbing under every endpoint: reading a bounded JSON body, noticing a client
that left, and a server-sent-events response that stops with its client.

Contract
- `read_json(request, limit)` -> the decoded body, `ApiError` 413 past `limit` bytes, 400 when it is
  not JSON (or nested too deep).
- `until_disconnected(request, awaitable)` -> its result, or `ClientGone` once the client
  disconnects (the awaitable is cancelled).
- `EventStream(body, headers, source, idle_timeout_s)`: SSE from an async iterator of bytes, closed
  (with `source`, the worker calls under it) when the client disconnects or stops reading; a
  stalled reader's connection is then dropped at once (the scope's `ABORT_CONNECTION` extension,
  which router/openai/server.py provides): closing it gracefully waits for the unsent output to
  be read, so it stayed open as long as the client kept it, and uvicorn logged an ERROR.
- state: none. proven by: tests/test_openai_event_stream.py, tests/test_openai_requests.py, the
  e2e modules (disconnects, idle streams).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.openai.requests import ApiError

log = logging.getLogger(__name__)

# scope["extensions"][ABORT_CONNECTION](): drops the request's connection, unsent data and all
ABORT_CONNECTION = "llm.abort_connection"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read: only http.disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass  # another body part would be a protocol error of the server; keep waiting


async def until_disconnected(request: Request, awaitable: Awaitable):
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled and
    `ClientGone` raised."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (watcher, task):
            if not t.done():
                t.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await t


class EventStream(Response):
    """Server-sent events from an async iterator of bytes, cancelled when the client disconnects or
    takes nothing for `idle_timeout_s` (a stalled reader: a write blocked that long; 0 = never).
    The iterator is closed in every case, which closes the worker call."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: dict[str, str],
        source: AsyncIterator,
        idle_timeout_s: float,
        on_end: Callable[[], None] | None = None,
    ):
        super().__init__(content=None, headers={"cache-control": "no-cache", **headers})
        self._on_end = on_end  # called once the stream ended, however it ended (Outbound.open_stream)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._body, self._source = body, source  # source: what `body` reads, closed even if never started
        self._idle_s = idle_timeout_s or None

    async def __call__(self, scope, receive, send) -> None:
        gone = False  # the client disconnected: no write goes out any more

        async def write(message: dict) -> None:
            if gone:  # uvicorn's send to a lost connection returns quietly: stop here instead
                raise ConnectionResetError("the client disconnected")
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a send
                # that finished in the loop turn its task was cancelled in, and drops the
                # cancellation (CPython gh-86296). uvicorn's connection_lost does exactly that: it
                # completes a send blocked on a full buffer and wakes watch() together; the pump
                # then ran on, with no client, until the generation ended.
                async with asyncio.timeout(self._idle_s):
                    await send(message)
            except TimeoutError:
                log.info("closing a stream whose client took nothing for %.1f s", self._idle_s)
                raise

        async def pump() -> None:
            await write({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self._body:
                if data:
                    await write({"type": "http.response.body", "body": data, "more_body": True})
            await write({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass  # no request body part is expected once the response started
            gone = True

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(watch())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            failure = tasks[0].exception() if tasks[0] in done and not tasks[0].cancelled() else None
            if isinstance(failure, TimeoutError):  # a stalled reader: no graceful close can finish
                abort = scope.get("extensions", {}).get(ABORT_CONNECTION)
                if abort is not None:
                    abort()
            elif failure is not None and not isinstance(failure, OSError):  # OSError: the client left
                raise failure
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
                    with suppress(asyncio.CancelledError, Exception):
                        await t
            try:
                await self._body.aclose()
                await self._source.aclose()
            finally:
                if self._on_end is not None:
                    self._on_end()


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, ApiError 413 as soon as it passes `limit` bytes (the rest is not read)."""
    size = 0
    parts = []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"request body larger than {limit} bytes", type_="invalid_request_error")
        parts.append(part)
    return b"".join(parts)


def loads(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ApiError(400, f"the request body is not valid JSON ({type(exc).__name__})") from None


async def read_json(request: Request, limit: int):
    return loads(await read_body(request, limit))


def decoded(body: bytes, then: Callable, args: tuple):
    """`then(json, *args)`: a parse that checks the counts and builds protobufs (run in a process of
    router/decode_pool.py for a large body: what comes back is compact, not the decoded objects)."""
    return then(loads(body), *args)


# A whole answer of more entries than this (tokens x (1 + top logprobs)) is built and encoded off the
# loop: 20k entries take ~20 ms on the loop; 16 choices x 4,096 tokens x 20 top logprobs, seconds.
LARGE_ANSWER_ENTRIES = 20_000
_ANSWERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="http-answers")


class Outbound:
    """Per tenant: its open server-sent-event streams, and the bytes of its whole answers that its
    clients have not taken yet (built, not yet handed off: a client that does not read keeps them
    in the router's memory until the write timeout). Over either cap (0 = none) the tenant's new
    requests get 429: the memory a tenant's slow readers hold is its own to spend."""

    def __init__(self, max_streams: int = 0, max_unsent_bytes: int = 0):
        self.max_streams, self.max_unsent_bytes = max_streams, max_unsent_bytes
        self.streams: Counter[str] = Counter()
        self.unsent: Counter[str] = Counter()

    def check(self, tenant: str) -> None:
        if self.max_unsent_bytes and self.unsent[tenant] >= self.max_unsent_bytes:
            raise ApiError(
                429,
                f"tenant {tenant}: {self.unsent[tenant]:,} bytes of answers not yet read by its clients "
                f"(at most {self.max_unsent_bytes:,}): read them, then retry",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )

    def open_stream(self, tenant: str) -> Callable[[], None]:
        """Counts a stream of `tenant` (429 over the cap); -> the call that ends it (once)."""
        if self.max_streams and self.streams[tenant] >= self.max_streams:
            raise ApiError(
                429,
                f"tenant {tenant}: {self.streams[tenant]} streams already open (at most {self.max_streams})",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        return self._held(self.streams, tenant, 1)

    def owe(self, tenant: str, size: int) -> Callable[[], None]:
        """Charges `size` unsent bytes to `tenant`; -> the call that pays them back (once)."""
        return self._held(self.unsent, tenant, size)

    @staticmethod
    def _held(counter: Counter, tenant: str, amount: int) -> Callable[[], None]:
        counter[tenant] += amount
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                counter[tenant] -= amount
                if counter[tenant] <= 0:
                    del counter[tenant]

        return release


class _Sent:
    """A response that calls `on_sent()` once it was handed off (or failed to be)."""

    on_sent: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_sent is not None:
                self.on_sent()


class OwedResponse(_Sent, Response):
    """A whole answer's bytes (encoded off the loop), charged to its tenant until handed off."""


class OwedJSON(_Sent, JSONResponse):
    """A small whole answer, encoded on the loop, charged to its tenant until handed off."""


async def json_answer(
    build: Callable[[], object],
    entries: int,
    headers: dict[str, str],
    owe: Callable[[int], Callable[[], None]] | None = None,
) -> Response:
    """A whole JSON answer. `build()` makes its object, `entries` says about how many token entries
    it holds. A small one is built and encoded on the loop; a large one on a thread, piece by
    piece (json.dumps holds the GIL from start to end: one call over a whole large answer would
    hold the loop as long as if it ran there).
    `owe(size)`: charges the answer's bytes to its tenant until it is handed off (`Outbound.owe`)."""
    if entries <= LARGE_ANSWER_ENTRIES:
        response = OwedJSON(build(), headers=headers)
    else:
        body = await asyncio.get_running_loop().run_in_executor(_ANSWERS, _encoded, build)
        response = OwedResponse(body, media_type="application/json", headers=headers)
    if owe is not None:
        response.on_sent = owe(len(response.body))
    return response


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_SMALL = 32  # a list of at most this many items is encoded by one json.dumps call


def _large(value) -> bool:
    if isinstance(value, list):
        return len(value) > _SMALL or any(_large(v) for v in value)
    return isinstance(value, dict) and any(_large(v) for v in value.values())


class _Pieces:
    """JSON text in pieces, turned into bytes a block at a time (each join and encode is short)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.blocks: list[bytes] = []

    def add(self, piece: str) -> None:
        self.text.append(piece)
        if len(self.text) >= 4096:
            self.flush()

    def flush(self) -> None:
        self.blocks.append("".join(self.text).encode())
        self.text.clear()


def _encode_into(value, out: _Pieces) -> None:
    """`value` as JSON, the same text as `_dumps(value)`: small parts by one call each."""
    if not _large(value):
        out.add(_dumps(value))
    elif isinstance(value, list):
        out.add("[")
        for i, item in enumerate(value):
            if i:
                out.add(",")
            _encode_into(item, out)
        out.add("]")
    else:
        out.add("{")
        for i, (key, item) in enumerate(value.items()):
            # json's own key form (a non-string key is converted as json.dumps converts it)
            out.add(
                ("," if i else "") + (_dumps(key) if isinstance(key, str) else _dumps({key: 0})[1:-3]) + ":"
            )
            _encode_into(item, out)
        out.add("}")


def _encoded(build: Callable[[], object]) -> bytes:
    out = _Pieces()
    _encode_into(build(), out)
    out.flush()
    return b"".join(out.blocks)
