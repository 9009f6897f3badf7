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
- proven by: tests/test_openai_e2e.py (port 0 and the announce line), tests/test_openai_serving_e2e.py
  (SIGTERM drain, HTTPS), tests/test_openai_event_stream.py (a stalled reader's connection dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import ssl

import uvicorn

from router.config import DEFAULT_HTTP_PORT
from router.openai.http import ABORT_CONNECTION

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router owns SIGTERM/SIGINT


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpFront:
    def __init__(
        self,
        app,
        host: str,
        port: int | None,
        tls: tuple[str | None, str | None, str | None] = (None, None, None),
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
        config = uvicorn.Config(
            self._asgi,
            interface="asgi3",  # a bound method: uvicorn's guess would take it for ASGI 2
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

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            abort = functools.partial(self._abort_connection, scope)
            scope.setdefault("extensions", {})[ABORT_CONNECTION] = abort
        await self._app(scope, receive, send)

    def _abort_connection(self, scope: dict) -> None:
        """Drops the connection that carries the request `scope` now, its unsent data with it. Found
        by the scope itself (uvicorn's protocol and its request cycle hold the same dict), not by
        the client address, which X-Forwarded-For may have rewritten."""
        for connection in list(self._server.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if getattr(connection, "scope", None) is scope or getattr(cycle, "scope", None) is scope:
                connection.transport.abort()

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
