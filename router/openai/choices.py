"""The pipeline calls of one OpenAI request's choices (`n`, a batch of prompts), read as one.

Contract
- input: one async iterator per choice, each the gRPC pipeline's events of that choice's request
  (`TokenChunk`s, then one `Finished`; router/openai/app.py `observed`).
- output: `Choices.start()` (every choice's first event, or the first refusal or failure raised),
  `events()` -> (index, event) as they come, `aclose()`; see the class docstring for the order,
  the buffering and the back-pressure each form keeps.
- state: the calls; with several, one reader task per call and the queue they fill.
- failure modes: a call's exception (or a cancellation from inside its pipeline, as Unavailable)
  is raised from `start()` or `events()`; every reader ends its queue with END whatever happens.
- proven by: tests/test_openai_choices_e2e.py (the SDK, n beyond the worker's room),
  tests/test_openai_requests.py (a pipeline that cancels itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protos.llm.v1 import generation_pb2 as pb
from router.errors import RouterError, Unavailable

Chunk, Done = pb.TokenChunk, pb.Finished


class Choices:
    """The pipeline calls of one HTTP request's choices, read as one. `start()` awaits every call's
    first event (a refusal of any is raised at once; the caller's `aclose()` cancels the others);
    then `events()` yields (index, TokenChunk | Finished) as they come, each call read to its end
    (so each request finishes and is observed as for gRPC). One choice is read directly: a slow
    client holds back its worker stream. Several are each read by a task of their own into a queue
    from the start, so no choice holds a worker slot and KV blocks while waiting for another to be
    admitted (a deadlock when the choices need more room than there is); what a slow client has
    not taken stays in memory (at most every choice's max_tokens chunks) until the stream's idle
    timeout ends it (with --stream-idle-timeout-s 0, until the client goes). A choice that fails
    before every choice has its first token fails the whole request in `start()` (its status);
    later, the stream's `error` event. `aclose()` closes every call, which cancels the worker
    streams of unfinished ones."""

    _END = object()

    def __init__(self, calls: list[AsyncIterator]):
        self._calls = calls
        self._first: list = []  # one call: its first event
        self._queue: asyncio.Queue = asyncio.Queue()  # several: (index, event | exception | _END)
        self._early: list[tuple[int, object]] = []  # taken from the queue by start(), in order
        self._readers: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self._calls)

    async def _read(self, index: int, call: AsyncIterator) -> None:
        """Every outcome ends with END on the queue, so a reader never waits for a call that ended."""
        try:
            async for event in call:
                self._queue.put_nowait((index, event))
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # aclose() cancels the readers: nobody reads the queue any more
            # the pipeline's own cancellation (a worker call cancelled under it): this choice failed
            self._queue.put_nowait((index, Unavailable("the worker stream was cancelled")))
        except Exception as exc:  # noqa: BLE001 - handed to whoever reads the events
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, self._END))

    async def _next(self) -> tuple[int, object]:
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return index, item

    async def start(self) -> None:
        if len(self._calls) == 1:
            self._first = [await anext(self._calls[0])]
            return
        self._readers = [asyncio.ensure_future(self._read(i, c)) for i, c in enumerate(self._calls)]
        started: set[int] = set()
        while len(started) < len(self._calls):
            index, item = await self._next()
            if item is self._END and index not in started:
                raise RouterError("the generation stream ended without a finish")
            started.add(index)
            self._early.append((index, item))

    async def events(self) -> AsyncIterator[tuple[int, Chunk | Done]]:
        if len(self._calls) == 1:
            yield 0, self._first[0]
            async for event in self._calls[0]:
                yield 0, event
            return
        ended = 0
        early, self._early = self._early, []
        for index, item in early:
            if item is self._END:
                ended += 1
            else:
                yield index, item
        while ended < len(self._calls):
            index, item = await self._next()
            if item is self._END:
                ended += 1
            else:
                yield index, item

    async def aclose(self) -> None:
        for reader in self._readers:
            reader.cancel()  # a reader inside its call: the cancellation closes that call's pipeline
        if self._readers:
            await asyncio.gather(*self._readers, return_exceptions=True)
        for call in self._calls:
            await call.aclose()
