"""uvicorn serving the OpenAI-compatible app inside the router's asyncio loop.

Contract
- input: host, port (None = 8000, or an ephemeral port when 8000 is taken; 0 = ephemeral), the
  FastAPI app, the router's TLS files (the same certificate as its gRPC port; a client CA makes
  it mutual TLS).
- output: `start()` binds the socket itself (so a bind failure is immediate: SystemExit with the
  reason) and runs `uvicorn.Server.serve` as a task; `url` and `announce()` ("OpenAI-compatible
  HTTP API at http(s)://HOST:PORT/v1", read by tests and launchers); `await stop(grace_s)` stops
  accepting, lets open responses finish for `grace_s`, then cancels them.
- state: the uvicorn server and its task. uvicorn's own signal handlers are not installed: the
  router's shutdown path (router/server.py) decides when to stop. Each HTTP request's scope
  carries `ABORT_CONNECTION` (router/openai/http.py): it aborts that client's TCP connection, for
  a stream closed because its reader stalled (uvicorn's close waits for the unsent data).
- connection limits (`ConnectionLimits`, each 0 = off; uvicorn's own defaults have none): a
  connection's request headers must be complete within `header_timeout_s` of its opening (or of
  the first byte of a keep-alive connection's next request: before it, uvicorn's 5 s keep-alive
  timer closes an idle connection), else it is closed; a request body must be complete within
  `body_timeout_s` of its headers, else 408 (an OpenAI error object, `Connection: close`; the app's
  `receive` sees a disconnect) or, when the app already answered, the connection is closed (not
  while the app leaves 64 KiB of it unread: uvicorn then stops reading, the wait is the app's); a
  whole (non-SSE) response whose unsent bytes do not move for `write_timeout_s` (the client reads
  nothing) has its connection aborted, checked every quarter of it (SSE streams have their own
  idle timeout, router/openai/http.py); past `max_connections` open connections, or
  `max_connections_per_client` from one peer address (the TCP peer: behind a proxy, the proxy),
  a new connection gets 503 at once and is closed, without its request being read.
  `connection_stats()` -> (open connections, {reason: connections closed}) with reasons
  `CLOSE_REASONS`; exported as `llm_router_http_connections` and
  `llm_router_http_connections_closed_total{reason}` when a `RouterMetrics` is given.
- proven by: tests/test_openai_e2e.py (port 0 and the announce line), tests/test_openai_serving_e2e.py
  (SIGTERM drain, HTTPS), tests/test_openai_event_stream.py (a stalled reader's connection dropped),
  tests/test_http_limits.py (each limit, on real sockets).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import resource
import socket
import ssl
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import DEFAULT_HTTP_PORT
from router.openai.http import ABORT_CONNECTION

log = logging.getLogger(__name__)

CLOSE_REASONS = ("header_timeout", "body_timeout", "write_timeout", "too_many", "too_many_per_client")
_CONNECTION = "llm.connection"  # scope["extensions"]: the request's _LimitedH11Protocol
_REFUSED_LINGER_S = 1.0  # a refused connection waits this long at most for the client's own close


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection time limits and connection caps of the HTTP front; 0 turns one off (the
    router's defaults live in router.config: --http-header-timeout-s and its neighbours)."""

    header_timeout_s: float = 0.0
    body_timeout_s: float = 0.0
    write_timeout_s: float = 0.0
    max_connections: int = 0
    max_connections_per_client: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {value}")


def _error_response(status: int, reason: str, message: str) -> bytes:
    """A short OpenAI error answer that closes its connection, written outside uvicorn's cycle."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
    retry = "retry-after: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"{retry}content-length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


class _Guard:
    """The limits and the counts that every connection of one HttpFront shares (on its loop)."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        self.closed: dict[str, int] = dict.fromkeys(CLOSE_REASONS, 0)

    def admit(self, peer: str) -> str | None:
        """None (and the connection counted open), or the reason it is refused."""
        limits = self.limits
        if limits.max_connections and self.open >= limits.max_connections:
            return "too_many"
        if limits.max_connections_per_client and self.per_client[peer] >= limits.max_connections_per_client:
            return "too_many_per_client"
        self.open += 1
        self.per_client[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.open -= 1
        self.per_client[peer] -= 1
        if not self.per_client[peer]:
            del self.per_client[peer]


class _LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of `ConnectionLimits` (a subclass per HttpFront sets
    `guard`). The read timer follows h11's view of the client: waiting for request headers
    (`their_state` IDLE, on a new connection or once a keep-alive request's first bytes arrived)
    or for the rest of a body (SEND_BODY); it is armed when that phase begins and not re-armed
    by data, so a client that trickles bytes gains nothing."""

    guard: _Guard

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._peer: str | None = None  # set once admitted (counted open)
        self._refused = False
        self._read_phase: str | None = None  # "header_timeout" | "body_timeout" while timed
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_seen = (0, 0.0)  # (unsent bytes at the last check, when they last moved)
        self._cycle_seen = None

    # -- connection caps
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        refusal = self.guard.admit(peer)
        if refusal is not None:
            self._refuse(transport, refusal)
            return
        self._peer = peer
        super().connection_made(transport)
        self._update_read_timer()

    def _refuse(self, transport: asyncio.Transport, reason: str) -> None:
        """503 at once, without reading the request, then close: the half-close lets the answer
        reach a client whose request is still arriving (a plain close with unread input resets
        the connection, and the client may lose the answer); the client's own close, or
        _REFUSED_LINGER_S, ends it."""
        self._refused = True
        self.transport = transport
        self.guard.closed[reason] += 1
        limits = self.guard.limits
        message = (
            f"too many open connections (at most {limits.max_connections})"
            if reason == "too_many"
            else f"too many open connections from this address (at most {limits.max_connections_per_client})"
        )
        transport.write(_error_response(503, "Service Unavailable", message))
        if transport.can_write_eof():
            transport.write_eof()
            self._read_timer = self.loop.call_later(_REFUSED_LINGER_S, transport.abort)
        else:  # TLS: no half-close
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the request of a refused connection is not read
        super().data_received(data)

    def eof_received(self) -> None:
        if not self._refused:
            super().eof_received()
        # returning None: the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_timer(None)
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._refused:
            return
        if self._peer is not None:
            self.guard.release(self._peer)
            self._peer = None
        super().connection_lost(exc)

    # -- read timers
    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not self._cycle_seen:  # a new request: its app task has not run
            self._cycle_seen = cycle
            cycle.scope.setdefault("extensions", {})[_CONNECTION] = self  # type: ignore[typeddict-item]
        self._update_read_timer()

    def _update_read_timer(self) -> None:
        phase = None
        if not self.transport.is_closing():
            state = self.conn.their_state
            if state is h11.IDLE and (self._cycle_seen is None or self.conn.trailing_data[0]):
                phase = "header_timeout"  # before the first byte of a later request: keep-alive's timer
            elif state is h11.SEND_BODY:
                phase = "body_timeout"
        if phase != self._read_phase:
            self._set_read_timer(phase)

    def _set_read_timer(self, phase: str | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        limits = self.guard.limits
        timeout = {"header_timeout": limits.header_timeout_s, "body_timeout": limits.body_timeout_s}
        timeout = timeout.get(phase)
        if timeout:
            self._read_timer = self.loop.call_later(timeout, self._read_timed_out, phase)

    def _read_timed_out(self, phase: str) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if phase == "body_timeout" and self.flow.read_paused:  # the app has not taken 64 KiB of it yet:
            self._set_read_timer(phase)  # the router, not the client, is the slow one; another period
            return
        self.guard.closed[phase] += 1
        cycle = self.cycle
        if phase == "body_timeout" and cycle is not None and not cycle.response_started:
            timeout = self.guard.limits.body_timeout_s
            log.info("HTTP request body not complete after %.1f s: 408", timeout)
            cycle.disconnected = True  # the app's receive returns http.disconnect, its answer goes nowhere
            cycle.message_event.set()
            message = f"the request body did not arrive within {timeout:g} s"
            self.transport.write(_error_response(408, "Request Timeout", message))
        elif phase == "header_timeout":
            log.debug("HTTP request headers not complete after %.1f s", self.guard.limits.header_timeout_s)
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # a graceful close would wait for a client that does not read
        else:
            self.transport.close()

    # -- write timer
    def watch_writes(self) -> None:
        """Called as a whole response starts: from now on, unsent bytes that stay unsent for
        `write_timeout_s` abort the connection (until they are all out and the response is done)."""
        timeout = self.guard.limits.write_timeout_s
        self._write_seen = (-1, time.monotonic())
        if timeout and self._write_timer is None and not self.transport.is_closing():
            self._write_timer = self.loop.call_later(timeout / 4, self._check_writes)

    def _check_writes(self) -> None:
        self._write_timer = None
        timeout = self.guard.limits.write_timeout_s
        unsent = self.transport.get_write_buffer_size()
        now = time.monotonic()
        last, since = self._write_seen
        if unsent == 0 and (self.cycle is None or self.cycle.response_complete):
            return  # all out: nothing to watch until the next response
        if unsent == 0 or unsent != last:
            since = now  # moving (or the app is still writing): not the client's fault
        elif now - since >= timeout:
            self.guard.closed["write_timeout"] += 1
            log.info("HTTP client read nothing of its response for %.1f s: dropping the connection", timeout)
            self.transport.abort()
            return
        self._write_seen = (unsent, since)
        self._write_timer = self.loop.call_later(timeout / 4, self._check_writes)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router owns SIGTERM/SIGINT


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP;
    # without it each answer written in two parts (headers, then body) waited ~40 ms (Nagle + the
    # client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _watching_writes(send, connection: _LimitedH11Protocol):
    """`send` that puts a whole response (not server-sent events: EventStream times its own
    writes) under the connection's write timeout as it starts."""

    async def watched(message) -> None:
        if message["type"] == "http.response.start":
            streaming = any(
                k.lower() == b"content-type" and v.lower().startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
            if not streaming:
                connection.watch_writes()
        await send(message)

    return watched


class HttpFront:
    def __init__(
        self,
        app,
        host: str,
        port: int | None,
        tls: tuple[str | None, str | None, str | None] = (None, None, None),
        limits: ConnectionLimits = ConnectionLimits(),  # none: uvicorn's own behaviour
        metrics=None,  # a RouterMetrics: the connection gauge and counters are exported to it
    ):
        cert, key, client_ca = tls
        try:
            if port is None:
                try:
                    self.sock = _bind(host, DEFAULT_HTTP_PORT)
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    log.warning("HTTP port %d is taken: using an ephemeral port", DEFAULT_HTTP_PORT)
                    self.sock = _bind(host, 0)
            else:
                self.sock = _bind(host, port)
        except OSError as exc:
            raise SystemExit(
                f"cannot serve the HTTP API on {host}:{port or DEFAULT_HTTP_PORT}: {exc}"
            ) from None
        self.port = self.sock.getsockname()[1]
        self.https = cert is not None
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if self.https else 'http'}://{shown}:{self.port}/v1"
        self._app = app
        self._guard = _Guard(limits)
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limits.max_connections and files != resource.RLIM_INFINITY and limits.max_connections + 64 > files:
            log.warning(
                "up to %d HTTP connections, but this process may open only %d files (ulimit -n): "
                "raise the limit or lower --http-max-connections",
                limits.max_connections,
                files,
            )
        if metrics is not None:
            metrics.export_http(self.connection_stats)
        config = uvicorn.Config(
            self._asgi,
            interface="asgi3",  # a bound method: uvicorn's guess would take it for ASGI 2
            http=type("_Protocol", (_LimitedH11Protocol,), {"guard": self._guard}),
            ws="none",  # no WebSocket endpoints; an upgrade would also leave the connection counts
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=cert,
            ssl_keyfile=key,
            ssl_ca_certs=client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
            server_header=False,
            timeout_graceful_shutdown=None,
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    def connection_stats(self) -> tuple[int, dict[str, int]]:
        """(open connections, {reason: connections closed or refused by a limit}), CLOSE_REASONS."""
        return self._guard.open, dict(self._guard.closed)

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            extensions = scope.setdefault("extensions", {})
            # the request's own connection (its protocol put itself in the scope, which is the same
            # dict uvicorn's cycle holds), not one found by the client address, which
            # X-Forwarded-For may have rewritten
            connection = extensions.get(_CONNECTION)
            if connection is not None:
                extensions[ABORT_CONNECTION] = connection.transport.abort
                send = _watching_writes(send, connection)
        await self._app(scope, receive, send)

    def start(self) -> None:
        """The socket already listens: connections wait in its backlog until uvicorn accepts them."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]), name="http-front")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the HTTP API stopped", exc_info=task.exception())

    def announce(self) -> None:
        print(f"router OpenAI-compatible HTTP API at {self.url}", flush=True)

    async def stop(self, grace_s: float) -> None:
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        try:
            async with asyncio.timeout(grace_s + 5.0):
                await self._task
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        self.sock.close()
