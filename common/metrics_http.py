"""The Prometheus HTTP endpoint: `/metrics` from a registry, plus extra JSON routes (the router's
`/targets` for Prometheus HTTP service discovery).

Contract
- input: host, port (0 = ephemeral), a `CollectorRegistry`, optional `{path: () -> JSON value}`,
  optional `ssl.SSLContext` (HTTPS; with a client CA in it, scrapers need a certificate), optional
  bearer token (then every path needs `Authorization: Bearer <token>`, compared in constant time;
  401 otherwise).
- output: `MetricsServer` serving on its own daemon threads, at most `MAX_THREADS` connections at
  once (more are closed at once); `.address` is the bound `host:port`,
  `.url` the `/metrics` URL. Every path other than the JSON routes serves the registry in the
  Prometheus text format.
- state: the listening socket and its thread; `close()` stops them.
- proven by: tests/test_trust_http.py (bearer, bounded threads), tests/test_observability_*.py.
- failure modes: OSError when the port cannot be bound (the caller decides whether to fall back).
  A client that fails the TLS handshake (plain HTTP, untrusted or missing certificate) is dropped
  and logged at debug level; serving goes on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app

from common.net import bind_address

log = logging.getLogger(__name__)
MAX_THREADS = 16  # connections served at once
# How often the serving thread checks for `close()`: socketserver's default of 0.5 s made every
# router and worker stop wait up to half a second for its /metrics thread.
SHUTDOWN_POLL_S = 0.05


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False
    max_threads = MAX_THREADS

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_threads)

    def process_request(self, request, client_address):
        """A thread per connection, at most `max_threads` at once: beyond that the connection is
        closed at once (a scraper retries; a flood of idle connections cannot pile up threads)."""
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d connections open already; dropping %s", self.max_threads, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        """Handshake failures surface here, in the handler thread; one debug line, no traceback."""
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _QuietHandler(WSGIRequestHandler):
    timeout = 10.0  # seconds a connection may sit idle (or mid-handshake) before its thread gives up

    def log_message(self, format, *args):  # noqa: A002 - scrapes every few seconds would flood the log
        pass  # deliberately silent (see the comment above)


class MetricsServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        json_routes: dict[str, Callable[[], object]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        bearer_token: str | None = None,
    ):
        metrics_app = make_wsgi_app(registry)
        routes = dict(json_routes or {})
        expected = bearer_token and hashlib.sha256(f"Bearer {bearer_token}".encode()).digest()

        def app(environ, start_response):
            if expected:
                presented = environ.get("HTTP_AUTHORIZATION", "").encode(errors="replace")
                if not hmac.compare_digest(hashlib.sha256(presented).digest(), expected):
                    body = b"401: send 'Authorization: Bearer <token>'\n"
                    start_response(
                        "401 Unauthorized",
                        [
                            ("Content-Type", "text/plain"),
                            ("Content-Length", str(len(body))),
                            ("WWW-Authenticate", "Bearer"),
                        ],
                    )
                    return [body]
            route = routes.get(environ.get("PATH_INFO", ""))
            if route is None:
                return metrics_app(environ, start_response)
            body = json.dumps(route()).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]

        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsHTTPServer", (_Server,), {"address_family": family})
        self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        self.scheme = "http"
        if ssl_context is not None:
            # The handshake runs on the first read, in the request's thread, not in accept().
            self._server.socket = ssl_context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
            self.scheme = "https"
        self.host = host
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="metrics-http", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return bind_address(self.host, self.port)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    host: str,
    port: int | None,
    default_port: int,
    registry: CollectorRegistry,
    json_routes: dict[str, Callable[[], object]] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    bearer_token: str | None = None,
) -> MetricsServer | None:
    """`port` None = `default_port`, falling back to an ephemeral port when that one is taken
    (several routers on one machine); an explicit port that cannot be bound is an error; -1 = off."""
    if port == -1:
        return None
    disable_created_metrics()  # process-wide: `_created` series double the output and no panel reads them
    if port is None and default_port:
        try:
            return MetricsServer(host, default_port, registry, json_routes, ssl_context, bearer_token)
        except OSError as exc:
            log.warning("metrics port %d unavailable (%s): using an ephemeral port", default_port, exc)
    return MetricsServer(host, port or 0, registry, json_routes, ssl_context, bearer_token)
