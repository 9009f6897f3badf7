"""The HTTP front's connection limits (router/openai/server.py ConnectionLimits) on real sockets:
the front (real uvicorn on 127.0.0.1) serves a small FastAPI app inside each test's event loop, the
clients are asyncio streams in the same loop; one test runs a real router process (its flags and
metrics). Without the limits (uvicorn's defaults) every stalled connection here was held until the
client left: the waits below end at their deadlines instead."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

DEADLINE_S = 5.0  # a limit fires after its timeout; this is how long a test waits for it at most
BIG = 20_000_000  # a whole response far larger than the socket buffers (~4 MB over loopback)


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "SERVING"})

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:  # as router/openai/app.py: nobody reads it
            return Response(status_code=499)
        return JSONResponse({"bytes": len(body)})

    @app.post("/late-echo")
    async def late_echo(request: Request) -> Response:
        await asyncio.sleep(0.8)  # the endpoint is busy before it reads the body (the router's wait)
        return await echo(request)

    @app.get("/big")
    async def big() -> Response:
        return Response(b"x" * BIG, media_type="application/octet-stream")

    return app


def serve(limits, scenario) -> None:
    """Runs `scenario(front)` against a started HttpFront with `limits`, then stops the front."""
    from router.openai.server import HttpFront

    async def main() -> None:
        front = HttpFront(make_app(), "127.0.0.1", 0, limits=limits)
        front.start()
        try:
            async with asyncio.timeout(60):
                await scenario(front)
        finally:
            await front.stop(1.0)

    asyncio.run(main())


async def connect(front, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", front.port, local_addr=(source, 0))


async def read_response(reader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length (all this app sends)."""
    async with asyncio.timeout(DEADLINE_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines if line)
        body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


async def request(reader, writer, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    length = f"content-length: {len(body)}\r\n" if method == "POST" else ""
    writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\n{length}\r\n".encode() + body)
    return await read_response(reader)


async def until_closed(reader, timeout_s: float = DEADLINE_S) -> bytes:
    """Everything the server still sends, once it closed the connection (a reset counts as closed);
    TimeoutError when it keeps it open past `timeout_s`."""
    data = b""
    async with asyncio.timeout(timeout_s):
        with contextlib.suppress(ConnectionResetError):  # a reset: closed, as an EOF is
            while chunk := await reader.read(1 << 20):
                data += chunk
    return data


async def until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    """Polls server state that has no event to wait on (the front's counts), with a deadline."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def limits(**kw):
    from router.openai.server import ConnectionLimits

    return ConnectionLimits(**kw)


def test_connections_that_never_complete_their_headers_are_closed_after_the_header_timeout():
    """A connection that sends nothing, one that sends half a request line, and one that trickles a
    header byte every 50 ms (which must not restart the timer) are all closed ~0.3 s after they
    opened, and counted."""

    async def scenario(front) -> None:
        silent, partial, trickle = [await connect(front) for _ in range(3)]
        start = time.monotonic()
        partial[1].write(b"GET /health HTTP/1.1\r\nHo")

        async def trickling() -> None:
            for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200:
                trickle[1].write(bytes([byte]))
                await asyncio.sleep(0.05)

        task = asyncio.create_task(trickling())
        try:
            for reader, _ in (silent, partial, trickle):
                assert await until_closed(reader) == b""  # closed, nothing answered
        finally:
            task.cancel()
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 0.3 + 2.0, elapsed
        await until(lambda: front.connection_stats()[0] == 0, "all three connections gone")
        assert front.connection_stats()[1]["header_timeout"] == 3

    serve(limits(header_timeout_s=0.3), scenario)


def test_a_body_that_does_not_arrive_in_time_gets_408():
    """Headers complete, then part of the body and a stall (or a trickle): 408 with an OpenAI
    error object after ~0.3 s, and the connection closes."""

    async def scenario(front) -> None:
        stalled, trickle = await connect(front), await connect(front)
        head = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
        stalled[1].write(head + b"0123456789")
        trickle[1].write(head)

        async def trickling() -> None:
            for _ in range(100):
                trickle[1].write(b"x")
                await asyncio.sleep(0.05)

        task = asyncio.create_task(trickling())
        try:
            for reader, _ in (stalled, trickle):
                status, headers, body = await read_response(reader)
                assert status == 408 and headers["connection"] == "close"
                assert b"did not arrive within 0.3 s" in body, body
                assert await until_closed(reader) == b""
        finally:
            task.cancel()
        assert front.connection_stats()[1]["body_timeout"] == 2

    serve(limits(body_timeout_s=0.3), scenario)


def test_a_body_the_endpoint_has_not_read_yet_is_not_timed_out():
    """The client sent its 1 MB body at once; the endpoint reads it only after 0.8 s (past the
    0.3 s body timeout): uvicorn stopped reading at 64 KiB meanwhile, so the wait is the router's,
    and the request is served."""

    async def scenario(front) -> None:
        reader, writer = await connect(front)
        status, _, body = await request(reader, writer, "POST", "/late-echo", b"x" * 1_000_000)
        assert (status, body) == (200, b'{"bytes":1000000}')
        assert front.connection_stats()[1]["body_timeout"] == 0

    serve(limits(body_timeout_s=0.3), scenario)


def test_connections_past_the_per_client_cap_are_refused_while_the_others_are_served():
    """3 open from 127.0.0.1 (the cap): the 4th gets 503 at once and is closed; the 3 and another
    address are served; once one of the 3 closes, 127.0.0.1 gets a connection again."""

    async def scenario(front) -> None:
        held = [await connect(front) for _ in range(3)]
        for reader, writer in held:  # each admitted and served (keep-alive: they stay open)
            assert (await request(reader, writer, "GET", "/health"))[0] == 200
        reader, writer = await connect(front)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 503 and headers["retry-after"] == "1"
        assert b"from this address (at most 3)" in body
        assert await until_closed(reader) == b""
        other = await connect(front, source="127.0.0.2")
        assert (await request(*other, "GET", "/health"))[0] == 200
        for reader, writer in held:
            assert (await request(reader, writer, "POST", "/echo", b"abc"))[0] == 200
        held[0][1].close()
        await until(lambda: front.connection_stats()[0] == 3, "the closed connection released")
        again = await connect(front)
        assert (await request(*again, "GET", "/health"))[0] == 200
        assert front.connection_stats()[1]["too_many_per_client"] == 1

    serve(limits(max_connections_per_client=3), scenario)


def test_connections_past_the_overall_cap_are_refused():
    """4 open from two addresses (the cap): a 5th from a third address gets 503; the 4 are served."""

    async def scenario(front) -> None:
        held = [await connect(front, f"127.0.0.{1 + i % 2}") for i in range(4)]
        for reader, writer in held:
            assert (await request(reader, writer, "GET", "/health"))[0] == 200
        reader, writer = await connect(front, "127.0.0.3")
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 503 and b"too many open connections (at most 4)" in body
        assert await until_closed(reader) == b""
        for reader, writer in held:
            assert (await request(reader, writer, "GET", "/health"))[0] == 200
        assert front.connection_stats() == (
            4,
            {
                "header_timeout": 0,
                "body_timeout": 0,
                "write_timeout": 0,
                "too_many": 1,
                "too_many_per_client": 0,
            },
        )

    serve(limits(max_connections=4, max_connections_per_client=3), scenario)


def test_a_client_that_does_not_read_a_whole_response_is_dropped_after_the_write_timeout():
    """A 20 MB response to a client that reads nothing: its unsent bytes stay put, and the
    connection is aborted ~0.5 s later (the socket buffers still deliver what they held: the client
    gets less than the whole). A client that reads gets all of it under the same timeout."""

    async def scenario(front) -> None:
        reader, writer = await connect(front)
        writer.write(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        await until(lambda: front.connection_stats()[1]["write_timeout"] == 1, "the stalled reader dropped")
        await until(lambda: front.connection_stats()[0] == 0, "its connection closed")
        assert len(await until_closed(reader, 30.0)) < BIG
        status, _, body = await request(*await connect(front), "GET", "/big")
        assert status == 200 and len(body) == BIG
        assert front.connection_stats()[1]["write_timeout"] == 1

    serve(limits(write_timeout_s=0.5), scenario)


def test_a_keep_alive_client_is_not_affected_by_the_limits():
    """Requests on one connection, idle 0.5 s between them (past the 0.3 s header and body
    timeouts: the header timer starts at a request's first byte, not when the last answer ended),
    a body in two parts, and a 20 MB answer read at once: all served, nothing counted."""

    async def scenario(front) -> None:
        reader, writer = await connect(front)
        for _ in range(3):
            assert (await request(reader, writer, "GET", "/health"))[0] == 200
            await asyncio.sleep(0.5)  # the client's think time, part of the scenario
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\n\r\nabc")
        await asyncio.sleep(0.1)
        writer.write(b"def")
        status, _, body = await read_response(reader)
        assert status == 200 and body == b'{"bytes":6}'
        status, _, body = await request(reader, writer, "GET", "/big")
        assert status == 200 and len(body) == BIG
        assert (await request(reader, writer, "GET", "/health"))[0] == 200
        assert front.connection_stats() == (1, dict.fromkeys(front.connection_stats()[1], 0))

    serve(
        limits(
            header_timeout_s=0.3,
            body_timeout_s=0.3,
            write_timeout_s=0.3,
            max_connections=2,
            max_connections_per_client=1,
        ),
        scenario,
    )


def test_health_stays_fast_while_200_idle_connections_are_held():
    async def scenario(front) -> None:
        idle = [await connect(front) for _ in range(200)]
        await until(lambda: front.connection_stats()[0] == 200, "200 connections admitted")
        for _ in range(5):
            start = time.monotonic()
            async with asyncio.timeout(1.0):
                assert (await request(*await connect(front), "GET", "/health"))[0] == 200
            assert time.monotonic() - start < 1.0
        for _, writer in idle:
            writer.close()

    serve(limits(header_timeout_s=30.0, max_connections=300, max_connections_per_client=256), scenario)


def test_answers_are_not_held_back_by_nagle():
    """The front's accepted sockets have TCP_NODELAY: its listening socket was made with proto 0,
    asyncio then left Nagle on, and each answer (headers and body written apart) waited for the
    client's delayed ACK: ~44 ms a request on a keep-alive connection (measured 2026-12-07, 0.5 ms
    with it). 20 requests took >= 0.8 s then."""
    import socket

    async def scenario(front) -> None:
        reader, writer = await connect(front)
        assert (await request(reader, writer, "POST", "/echo", b"x" * 1000))[0] == 200
        [connection] = front._server.server_state.connections
        server_side = connection.transport.get_extra_info("socket")
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        start = time.monotonic()
        for _ in range(20):
            assert (await request(reader, writer, "POST", "/echo", b"x" * 1000))[0] == 200
        assert time.monotonic() - start < 0.5

    serve(limits(), scenario)


@pytest.mark.parametrize("field", ["header_timeout_s", "max_connections_per_client"])
def test_a_negative_limit_is_refused(field):
    with pytest.raises(ValueError, match=field):
        limits(**{field: -1})


def test_the_router_applies_its_flags_and_exports_the_counts(tmp_path):
    """A real router process (no workers: the HTTP front needs none): a half-sent header is closed
    after --http-header-timeout-s, and /metrics counts it."""
    import socket

    from tests import openai_helpers, procs

    proc = procs.Proc(
        "router",
        ["-m", "router", "--port", "0", "--http-port", "0", "--http-header-timeout-s", "0.3"],
        tmp_path,
    )
    try:
        url = openai_helpers.http_url(proc)
        host, port = url.split("//", 1)[1].removesuffix("/v1").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHo")
            start = time.monotonic()
            assert client.recv(100) == b""  # closed by the router (socket timeout: DEADLINE_S)
            assert time.monotonic() - start < DEADLINE_S
        key = ("llm_router_http_connections_closed_total", (("reason", "header_timeout"),))
        procs.wait_until(lambda: procs.scrape(proc).get(key) == 1, DEADLINE_S, "the close counted")
        assert procs.scrape(proc)[("llm_router_http_connections", ())] == 0
    finally:
        proc.stop()
