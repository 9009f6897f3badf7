"""router/openai/http.py's EventStream, in process against uvicorn's send/receive reduced to what
it does: a stalled reader or a disconnect ends the stream and closes its source, also when the
connection is lost under a write blocked on a full buffer."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("how", ["stalled", "disconnected"])
def test_event_stream_closes_its_source_when_the_client_stalls_or_leaves(how):
    """A stalled reader (a write blocked past the idle timeout) or a disconnect ends the response
    and closes the pipeline it reads (which closes the worker call)."""
    import asyncio

    from router.openai.http import EventStream

    async def scenario() -> tuple[bool, int]:
        closed, sent, gone = asyncio.Event(), [], asyncio.Event()

        async def source():
            try:
                while True:
                    yield b"data: x\n\n"
                    await asyncio.sleep(0)  # a token now and then
            finally:
                closed.set()

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                if how == "stalled":
                    await asyncio.Event().wait()  # the client's window is full: this write never ends
                gone.set()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        events = source()
        response = EventStream(events, {}, events, idle_timeout_s=0.2)
        await asyncio.wait_for(response(scope={}, receive=receive, send=send), timeout=10)
        return closed.is_set(), len(sent)

    closed, num_sent = asyncio.run(scenario())
    assert closed and num_sent >= 3


@pytest.mark.parametrize("idle_timeout_s", [30.0, 0.0])
def test_event_stream_ends_when_the_connection_is_lost_under_a_blocked_write(idle_timeout_s):
    """uvicorn's connection_lost, with a write blocked on a full buffer, finishes that write and
    wakes the disconnect watcher in one loop turn, and its send returns quietly from then on. The
    stream must still end at once and close its source (once, Python 3.11's asyncio.wait_for around
    the write swallowed the cancellation, and the stream ran on without a client until the
    generation ended: a CI failure of the client-gone e2e test)."""
    import asyncio

    from router.openai.http import EventStream

    async def scenario() -> tuple[bool, int, int]:
        closed, pulled = asyncio.Event(), [0]
        writable, message_event = asyncio.Event(), asyncio.Event()
        writable.set()
        state = {"disconnected": False, "writes": 0, "blocked": False}

        async def source():  # a generation of 2,000 tokens: a stream that runs on reads them all
            try:
                for _ in range(2000):
                    pulled[0] += 1
                    yield b"data: x\n\n"
                    await asyncio.sleep(0)
            finally:
                closed.set()

        async def send(message):  # uvicorn's RequestResponseCycle.send, reduced
            if not writable.is_set() and not state["disconnected"]:
                state["blocked"] = True
                await writable.wait()  # flow.drain(): the transport's buffer is over its mark
            if state["disconnected"]:
                return  # uvicorn drops writes to a lost connection without an error
            state["writes"] += 1
            if state["writes"] == 5:
                writable.clear()

        async def receive():  # uvicorn's RequestResponseCycle.receive, reduced
            if not state["disconnected"]:
                await message_event.wait()
                message_event.clear()
            return {"type": "http.disconnect"}

        events = source()
        task = asyncio.ensure_future(EventStream(events, {}, events, idle_timeout_s)({}, receive, send))
        while not state.get("blocked"):  # until the pump blocks in a write
            await asyncio.sleep(0)
        before = pulled[0]
        state["disconnected"] = True  # uvicorn's H11Protocol.connection_lost, reduced: all in one turn
        message_event.set()
        writable.set()
        await asyncio.wait_for(task, timeout=10)
        return closed.is_set(), before, pulled[0]

    closed, before, after = asyncio.run(scenario())
    assert closed and after - before <= 5, (before, after)  # not the rest of the generation


@pytest.mark.parametrize("forwarded", [False, True])
def test_a_stalled_readers_connection_is_dropped_and_no_error_logged(caplog, forwarded):
    """The HTTP front (real uvicorn) and a client that sends its request and never reads: the idle
    timeout ends the stream, and the connection must go too. uvicorn closes it gracefully, which
    waits for the unsent output to be read: it stayed open as long as the client kept it (its
    buffers full) and uvicorn logged "ASGI callable returned without completing response" at
    ERROR. With X-Forwarded-For (uvicorn rewrites the scope's client) the same connection goes."""
    import asyncio
    import logging
    import socket
    import time

    from fastapi import FastAPI

    from router.openai.http import EventStream
    from router.openai.server import HttpFront

    closed = asyncio.Event()

    async def source():
        try:
            while True:
                yield b"data: " + b"x" * 65_536 + b"\n\n"  # fills the socket buffers in a few ms
                await asyncio.sleep(0)
        finally:
            closed.set()

    app = FastAPI()

    @app.get("/stream")
    async def stream():
        events = source()
        return EventStream(events, {}, events, idle_timeout_s=0.3)

    async def scenario() -> None:
        front = HttpFront(app, "127.0.0.1", 0)
        front.start()
        connections = front._server.server_state.connections
        client = socket.create_connection(("127.0.0.1", front.port))  # sends its request, never reads
        forward = b"X-Forwarded-For: 10.1.2.3\r\n" if forwarded else b""
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n" + forward + b"\r\n")
        deadline = time.monotonic() + 20
        try:
            await asyncio.wait_for(closed.wait(), 10)
            while connections:
                assert time.monotonic() < deadline, "the stalled connection was kept open"
                await asyncio.sleep(0.01)
        finally:
            client.close()
            await front.stop(1.0)

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert any("took nothing for 0.3 s" in r.getMessage() for r in caplog.records)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
