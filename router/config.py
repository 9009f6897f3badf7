"""Router configuration: one frozen dataclass, built from the command line in one place."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.net import is_loopback_host


@dataclass(frozen=True)
class Limits:
    """Request limits the validator enforces (model-independent ones; the context comes from workers)."""
    default_max_tokens: int = 256       # used when stopping.max_tokens is unset
    max_tokens_limit: int = 4096        # largest max_tokens a client may ask for
    max_stop_strings: int = 8
    max_stop_string_len: int = 64       # characters
    max_stop_token_ids: int = 64
    max_chat_messages: int = 256
    max_prompt_chars: int = 1_000_000   # refuse before tokenizing absurd inputs
    max_request_id_len: int = 128

    def __post_init__(self) -> None:
        assert 1 <= self.default_max_tokens <= self.max_tokens_limit
        assert self.max_stop_strings >= 0 and self.max_stop_string_len >= 1


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    workers: tuple[str, ...] = ()             # static registry: host:port of each worker
    model: str | None = None                  # tokenizer source (GGUF path); None = embedded model
    tenants_file: str | None = None
    allow_insecure_public: bool = False
    drain_grace_s: float = 30.0               # SIGTERM: how long in-flight streams may finish
    health_poll_s: float = 1.0                # worker health/load probe period
    max_message_bytes: int = 16 * 1024 * 1024
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError("drain_grace_s must be >= 0")
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")

    @property
    def binds_loopback(self) -> bool:
        return is_loopback_host(self.host)


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router", description="LLM router (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--workers", default="", help="comma-separated host:port list of workers")
    p.add_argument("--model", default=None, help="GGUF file for the tokenizer (default: embedded model)")
    p.add_argument("--tenants", dest="tenants_file", default=None, help="tenants YAML file")
    p.add_argument("--allow-insecure-public", action="store_true",
                   help="serve a non-loopback address without API keys")
    p.add_argument("--drain-grace-s", type=float, default=30.0)
    p.add_argument("--health-poll-s", type=float, default=1.0)
    p.add_argument("--default-max-tokens", type=int, default=Limits.default_max_tokens)
    p.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens_limit)
    a = p.parse_args(argv)
    workers = tuple(w.strip() for w in a.workers.split(",") if w.strip())
    return RouterConfig(
        host=a.host, port=a.port, workers=workers, model=a.model, tenants_file=a.tenants_file,
        allow_insecure_public=a.allow_insecure_public, drain_grace_s=a.drain_grace_s,
        health_poll_s=a.health_poll_s,
        limits=Limits(default_max_tokens=a.default_max_tokens, max_tokens_limit=a.max_tokens_limit),
    )
