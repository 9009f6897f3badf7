"""Address helpers shared by router, worker and launchers (pure; no grpc)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_address(host: str, port: int) -> str:
    """`host:port` as grpc expects it (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (for a process that must be started on a known port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
