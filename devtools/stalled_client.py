"""A gRPC client that never reads: raw HTTP/2 over a socket, announcing a stream window of 0 bytes.

It opens one stream per `open_stream(...)`, sends the request, answers the server's SETTINGS and
PINGs (so that the connection stays up) and never sends WINDOW_UPDATE, so the server cannot send a
single response byte: exactly what a hostile or stuck client does to a server that waits on its
writes. `wait_closed(stream_id)` waits until the server ends the stream (RST_STREAM, or trailers
in a HEADERS frame with END_STREAM) and returns the grpc-status it sent, if any could be decoded.
Used by tests/test_trust_streams.py and benchmarks/soak_trust.py (stalled readers).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x4


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK integer (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _int(len(n), 7) + n + _int(len(v), 7) + v


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


class StalledClient:
    def __init__(self, address: str, timeout_s: float = 10.0):
        host, _, port = address.rpartition(":")
        self.authority = address
        self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._closed: dict[int, str | None] = {}  # stream id -> grpc-status (None: reset)
        self._changed = threading.Condition()
        self._next_id = 1
        self._alive = True
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, 0)
        self._send(PREFACE + _frame(SETTINGS, 0, 0, settings))
        self._reader = threading.Thread(target=self._read_loop, name="stalled-client", daemon=True)
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def open_stream(self, path: str, message: bytes, metadata=(), timeout_s: float | None = None) -> int:
        """Starts a unary-request call of `path` with the serialized request `message`."""
        stream_id = self._next_id
        self._next_id += 2
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        if timeout_s is not None:
            headers.append(("grpc-timeout", f"{int(timeout_s * 1000)}m"))
        block = b"".join(_literal(k, v) for k, v in headers)
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self._send(_frame(HEADERS, END_HEADERS, stream_id, block) + _frame(DATA, END_STREAM, stream_id, body))
        return stream_id

    def wait_closed(self, stream_id: int, timeout_s: float) -> tuple[bool, str | None]:
        """(closed, grpc-status text or None) once the server ended the stream, or (False, None)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while stream_id not in self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._alive:
                    return stream_id in self._closed, self._closed.get(stream_id)
                self._changed.wait(left)
            return True, self._closed[stream_id]

    def _read_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self._sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _read_loop(self) -> None:
        try:
            while True:
                head = self._read_exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream_id = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._read_exact(length)
                if kind == SETTINGS and not flags & ACK:
                    self._send(_frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    self._send(_frame(PING, ACK, 0, payload))
                elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM):
                    status = None
                    if kind == HEADERS:  # trailers: find grpc-status among the literal bytes
                        at = payload.find(b"grpc-status")
                        status = payload[at + 12 : at + 14].decode(errors="replace") if at >= 0 else ""
                    with self._changed:
                        self._closed[stream_id] = status
                        self._changed.notify_all()
                elif kind == GOAWAY:
                    break
        except (ConnectionError, OSError):  # the server closed the connection: the reader's job ends
            pass
        finally:
            with self._changed:
                self._alive = False
                self._changed.notify_all()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the server
        self._sock.close()
        self._reader.join(5)
