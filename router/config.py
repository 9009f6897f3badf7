"""Router configuration: one frozen dataclass, checked at construction.

Contract: `RouterConfig` (with `Limits` and `TelemetryConfig` nested) holds every router setting;
its field metadata makes the flags of `python -m router` and the launchers and the `LLM_*`
variables (common.config_cli); `parse_args(argv)` is flags > variables > defaults, with a bad
value a usage error (exit 2). The non-loopback rule is common.public_bind's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from common.config_cli import MIB, Flags, comma_list, new_parser, option, parse_or_exit, section
from common.net import is_loopback_host
from common.public_bind import refusal, router_missing
from common.ray_names import DEFAULT_NAMESPACE
from common.telemetry import TelemetryConfig
from common.tls import check_files, check_server_files

DEFAULT_METRICS_PORT = 9464  # Prometheus /metrics and /targets; taken -> an ephemeral port
DEFAULT_HTTP_PORT = 8000  # OpenAI-compatible HTTP API (router/openai); taken -> an ephemeral port
WORKER_TLS_FLAGS = ("--worker-tls-cert", "--worker-tls-key", "--worker-tls-ca")


@dataclass(frozen=True)
class Limits:
    """Request limits the validator enforces (model-independent ones; the context comes from workers)."""

    default_max_tokens: int = field(
        default=256, metadata=option("max_tokens of a request that leaves it unset (fitted to the context)")
    )
    max_tokens_limit: int | None = field(
        default=None,
        metadata=option(
            "largest max_tokens a client may ask for (0: whatever fits the model's context with the "
            "prompt, the bound that always holds)",
            none_value=0,
        ),
    )
    max_stop_strings: int = field(default=8, metadata=option("stop strings per request at most"))
    max_stop_string_len: int = field(default=64, metadata=option("characters per stop string at most"))
    max_stop_token_ids: int = field(default=64, metadata=option("stop token ids per request at most"))
    # 10,000: long agent histories pass it (a message costs a few template tokens, so even a 128k
    # context holds no more than ~10k real ones); each message is ~2-10 us of validation on the
    # router's event loop, so 100,000 would let one request stall it for ~0.2-1 s
    max_chat_messages: int = field(
        default=10_000,
        metadata=option(
            "messages per chat request at most: a bound on per-message work, not on conversations "
            "(their cost is bounded by --max-prompt-chars, the body size and the model's context)"
        ),
    )
    max_prompt_chars: int = field(
        default=1_000_000, metadata=option("prompt characters at most (refused before tokenizing)")
    )
    max_request_id_len: int = field(default=128, metadata=option("request id characters at most"))
    grammar_compile_timeout_s: float = field(
        default=3.0,
        metadata=option(
            "wall-clock budget of one structured-output grammar compile (response_format); past it the "
            "compile process is killed and the request refused, INVALID_ARGUMENT (router/grammar_compile.py)"
        ),
    )
    grammar_compile_memory_mb: int = field(
        default=1024,
        metadata=option(
            "memory budget of one grammar-compile process, beyond what it holds when ready (its address "
            "space is capped there: a compile past it ends the process, a refusal); 0 = no cap"
        ),
    )
    grammar_compile_processes: int = field(
        default=4, metadata=option("grammar-compile processes at most (started on first use)")
    )
    grammar_compiles_per_tenant: int = field(
        default=2,
        metadata=option(
            "grammar compiles one tenant runs at once (the rest wait, then RESOURCE_EXHAUSTED); keep it "
            "below --grammar-compile-processes so one tenant's slow schemas leave room for others"
        ),
    )
    parse_special_tokens_in_messages: bool = field(
        default=False,
        metadata=option(
            "tokenize control-token text in chat messages, tool definitions and tool results as the "
            "control tokens it spells (a client can then write its own system turn); off: only the "
            "chat template writes control tokens (docs/openai.md, 'Control tokens in messages')"
        ),
    )

    def __post_init__(self) -> None:
        cap = self.max_tokens_limit
        if cap is not None and cap < 1:
            raise ValueError(f"max_tokens_limit must be >= 1 (or unset: the context), got {cap}")
        if not 1 <= self.default_max_tokens <= (cap or self.default_max_tokens):
            raise ValueError(
                f"default_max_tokens must be in [1, max_tokens_limit = {cap}], got {self.default_max_tokens}"
            )
        if self.max_chat_messages < 1:
            raise ValueError(f"max_chat_messages must be >= 1, got {self.max_chat_messages}")
        if self.max_stop_strings < 0 or self.max_stop_string_len < 1:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_len >= 1")
        if not self.grammar_compile_timeout_s > 0:  # NaN too
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_compile_memory_mb < 0:
            raise ValueError(f"grammar_compile_memory_mb must be >= 0, got {self.grammar_compile_memory_mb}")
        if self.grammar_compile_processes < 1 or self.grammar_compiles_per_tenant < 1:
            raise ValueError("grammar_compile_processes and grammar_compiles_per_tenant must be >= 1")


@dataclass(frozen=True)
class RouterConfig:
    """Router settings; the field metadata makes the flags of `python -m router` and of the
    launchers, and the `LLM_*` variables (common.config_cli). Defaults live only here."""

    host: str = field(
        default="127.0.0.1",
        metadata=option(
            "client port address; a non-loopback one needs --tenants and --tls-cert/--tls-key, or "
            "--allow-insecure-public"
        ),
    )
    port: int = field(default=50051, metadata=option("client port; 0 = ephemeral (printed at start-up)"))
    http_host: str = field(
        default="127.0.0.1",
        metadata=option(
            "OpenAI-compatible HTTP API address (docs/openai.md); a non-loopback one needs what --host "
            "needs: --tenants and --tls-cert/--tls-key (served over HTTPS), or --allow-insecure-public"
        ),
    )
    http_port: int | None = field(
        default=None,
        metadata=option(
            f"OpenAI-compatible HTTP API port (default {DEFAULT_HTTP_PORT}; taken default -> ephemeral; "
            "0 = ephemeral; -1 = off); printed at start-up"
        ),
    )
    workers: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "static workers: comma-separated host:port list",
            parse=comma_list,
            format=",".join,
            metavar="HOST:PORT,...",
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=option(
            "also discover worker actors in this Ray cluster: HOST:PORT (GCS), auto, or ray://HOST:10001 "
            "(Ray Client, from outside the cluster)",
            metavar="ADDRESS",
        ),
    )
    ray_namespace: str = field(
        default=DEFAULT_NAMESPACE, metadata=option("Ray namespace the worker actors are named in")
    )
    model: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "the served models, comma-separated, each [ID=]SOURCE: SOURCE a GGUF file, a Hugging Face "
            "directory or hub id (org/name, from the local HF cache) the router takes the tokenizer, "
            "chat template and generation defaults from; ID (default: the hub id, GGUF general.name or "
            "directory name) must equal the workers' --served-model-name (default: the embedded model)",
            parse=comma_list,
            format=",".join,
            metavar="[ID=]SOURCE,...",
        ),
    )
    allow_download: bool = field(
        default=False,
        metadata=option(
            "fetch a hub id's tokenizer files missing from the local HF cache (default: offline)"
        ),
    )
    tenants_file: str | None = field(
        default=None,
        metadata=option(
            "tenants YAML file (API keys, weights, limits; docs/serving.md)", flag="tenants", metavar="FILE"
        ),
    )
    allow_insecure_public: bool = field(
        default=False, metadata=option("serve a non-loopback address without API keys and TLS", negative=())
    )
    drain_grace_s: float = field(
        default=30.0, metadata=option("SIGTERM: how long in-flight streams may finish")
    )
    health_poll_s: float = field(default=1.0, metadata=option("worker health/load probe period"))
    health_timeout_s: float = field(
        default=1.0, metadata=option("deadline of each worker probe call (a hung worker fails it)")
    )
    down_after_probes: int = field(
        default=2,
        metadata=option(
            "failed probes in a row after which a worker is down and its open streams are cancelled "
            "(UNAVAILABLE, retried if no token was sent)"
        ),
    )
    breaker_failures: int = field(
        default=3, metadata=option("failed calls in a row that open a worker's circuit (no traffic)")
    )
    breaker_cooldown_s: float = field(
        default=2.0, metadata=option("how long an open circuit stays open; doubles on each re-open")
    )
    breaker_max_cooldown_s: float = field(default=60.0, metadata=option("longest circuit cool-down"))
    max_message_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=option(
            "largest gRPC message received or sent (a larger request gets RESOURCE_EXHAUSTED before it "
            "is parsed)",
            flag="max-message-mb",
            unit=MIB,
        ),
    )
    limits: Limits = field(default=Limits(), metadata=section("request limits"))
    tenants_poll_s: float = field(
        default=2.0,
        metadata=option("check the tenants file for changes this often (0: reload on SIGHUP only)"),
    )
    fair_queue: str = field(
        default="vtc",
        metadata=option(
            "queue order: weighted virtual token counter, or first come first served (the baseline)",
            choices=("vtc", "fcfs"),
        ),
    )
    max_queued: int | None = field(
        default=1024, metadata=option("requests waiting in this router's queue (0: no cap)", none_value=0)
    )
    queue_requests: bool = field(
        default=True,
        metadata=option(
            "queue requests no worker can start now; --no-queue admits only those a worker can start "
            "and refuses the rest at once (RESOURCE_EXHAUSTED): time to first token stays near the "
            "unloaded value under overload, at the cost of fair queueing",
            flag="queue",
            negative=("no-queue",),
        ),
    )
    max_tokens_in_flight: int | None = field(
        default=None,
        metadata=option("budget of prompt + max_tokens over open requests (0: none)", none_value=0),
    )
    affinity_imbalance: float = field(
        default=0.25,
        metadata=option(
            "prefix affinity yields to the least loaded worker when the preferred one's load, as a "
            "fraction of its KV capacity, is higher by more than this"
        ),
    )
    no_worker_grace_s: float = field(
        default=5.0,
        metadata=option("requests queued for a model with no healthy worker fail (UNAVAILABLE) after this"),
    )
    router_replicas: int = field(
        default=1,
        metadata=option(
            "how many routers share these workers and tenants behind one balancer that spreads requests "
            "evenly: this one enforces 1/N of each tenant's rates and caps (caps rounded up), of "
            "--max-tokens-in-flight and of each worker's KV room and sequence slots"
        ),
    )
    lora_autoload: bool = field(
        default=False,
        metadata=option(
            "a request naming an adapter not served loads it from the workers' --lora-dir (one base "
            "model), unloading the least recently used autoloaded adapter when they are full"
        ),
    )
    lora_autoload_retry_s: float = field(
        default=30.0, metadata=option("a name whose on-demand load failed is not tried again for this long")
    )
    telemetry: TelemetryConfig = field(default=TelemetryConfig(), metadata=section("observability"))
    tls_cert: str | None = field(
        default=None, metadata=option("PEM: TLS certificate chain of the client port", metavar="FILE")
    )
    tls_key: str | None = field(
        default=None, metadata=option("PEM: private key of --tls-cert", metavar="FILE")
    )
    tls_client_ca: str | None = field(
        default=None,
        metadata=option(
            "PEM: require client certificates signed by this CA (mutual TLS on the client port)",
            metavar="FILE",
        ),
    )
    worker_tls_ca: str | None = field(
        default=None, metadata=option("PEM: connect to workers over TLS, trusting this CA", metavar="FILE")
    )
    worker_tls_cert: str | None = field(
        default=None,
        metadata=option(
            "PEM: the router's client certificate for workers that require one (mutual TLS)", metavar="FILE"
        ),
    )
    worker_tls_key: str | None = field(
        default=None, metadata=option("PEM: private key of --worker-tls-cert", metavar="FILE")
    )
    worker_token: str | None = field(
        default=None,
        repr=False,
        metadata=option(
            "shared secret sent to workers on every call (common.auth; the launchers make one per "
            "deployment). Prefer the variable: a flag shows in ps",
            metavar="TOKEN",
        ),
    )
    stream_idle_timeout_s: float = field(
        default=30.0,
        metadata=option(
            "end a client stream that has taken no response for this long (DEADLINE_EXCEEDED; its "
            "worker sequence, KV blocks and admission slot are freed); 0 = never"
        ),
    )
    # HTTP connection limits (router/openai/server.py ConnectionLimits, docs/reliability.md); 0 = off
    http_header_timeout_s: float = field(
        default=10.0,
        metadata=option(
            "close an HTTP connection whose request headers are not complete this long after it "
            "opened (or after a keep-alive request's first byte); 0 = never"
        ),
    )
    http_body_timeout_s: float = field(
        default=60.0,
        metadata=option(
            "answer 408 to an HTTP request whose body is not complete this long after its headers; 0 = never"
        ),
    )
    http_write_timeout_s: float = field(
        default=30.0,
        metadata=option(
            "drop the connection of a whole (non-streaming) HTTP response none of whose unsent bytes "
            "the client took for this long; 0 = never"
        ),
    )
    http_max_connections: int = field(
        default=1024, metadata=option("open HTTP connections at most; more get 503 at once (0 = no cap)")
    )
    http_max_connections_per_client: int = field(
        default=256,
        metadata=option(
            "open HTTP connections per client address at most (behind a proxy: the proxy's); more get "
            "503 at once (0 = no cap)"
        ),
    )
    http_max_streams_per_tenant: int = field(
        default=64,
        metadata=option("open server-sent-event streams per tenant at most; more get 429 (0 = no cap)"),
    )
    http_max_unsent_mb_per_tenant: float = field(
        default=64.0,
        metadata=option(
            "MB of a tenant's whole HTTP answers not yet taken by its clients; past it the tenant's "
            "new requests get 429 (0 = no cap)"
        ),
    )
    worker_tls_server_name: str | None = field(
        default=None,
        metadata=option(
            "name the workers' certificates carry, when it is not the host dialled", metavar="NAME"
        ),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not -1 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [-1, 65535], got {self.http_port}")
        if self.drain_grace_s < 0:
            raise ValueError("drain_grace_s must be >= 0")
        if self.tenants_poll_s < 0:
            raise ValueError("tenants_poll_s must be >= 0")
        if self.fair_queue not in ("vtc", "fcfs"):
            raise ValueError(f"fair_queue must be vtc or fcfs, got {self.fair_queue!r}")
        if not self.lora_autoload_retry_s >= 0:  # NaN too
            raise ValueError(f"lora_autoload_retry_s must be >= 0, got {self.lora_autoload_retry_s}")
        if not isinstance(self.router_replicas, int) or self.router_replicas < 1:
            raise ValueError(f"router_replicas must be an integer >= 1, got {self.router_replicas!r}")
        for name in ("max_queued", "max_tokens_in_flight"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if not self.affinity_imbalance >= 0:
            raise ValueError(f"affinity_imbalance must be >= 0, got {self.affinity_imbalance}")
        if not self.health_timeout_s > 0 or self.down_after_probes < 1 or self.breaker_failures < 1:
            raise ValueError("health_timeout_s must be > 0; down_after_probes and breaker_failures >= 1")
        if not 0 < self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ValueError(
                "breaker cool-downs must satisfy 0 < breaker_cooldown_s <= breaker_max_cooldown_s"
            )
        if not self.no_worker_grace_s >= 0:
            raise ValueError(f"no_worker_grace_s must be >= 0, got {self.no_worker_grace_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.worker_token is not None and not self.worker_token.strip():
            raise ValueError("worker_token must not be empty (unset it to turn worker authentication off)")
        if not self.stream_idle_timeout_s >= 0:
            raise ValueError(f"stream_idle_timeout_s must be >= 0, got {self.stream_idle_timeout_s}")
        for name in (
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_write_timeout_s",
            "http_max_connections",
            "http_max_connections_per_client",
            "http_max_streams_per_tenant",
            "http_max_unsent_mb_per_tenant",
        ):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        check_files(self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca, WORKER_TLS_FLAGS)
        if self.worker_tls_ca is None:
            for flag, value in (
                ("--worker-tls-cert", self.worker_tls_cert),
                ("--worker-tls-server-name", self.worker_tls_server_name),
            ):
                if value is not None:
                    raise ValueError(
                        f"{flag} needs --worker-tls-ca (the CA that signed the workers' certificates)"
                    )

    @property
    def binds_loopback(self) -> bool:
        return is_loopback_host(self.host)

    def missing_for_public_bind(self) -> list[str]:
        """What a non-loopback client port lacks: API keys and TLS, so that keys never travel in
        clear text. Empty when the bind is loopback or --allow-insecure-public."""
        return router_missing(self.host, self.allow_insecure_public, self.tenants_file, self.tls_cert)

    def public_bind_refusal(self) -> str | None:
        """The error `serve` stops with when `missing_for_public_bind()` is not empty, or when the
        HTTP API (unless off) binds a non-loopback address without the same."""
        problem = refusal(self.host, self.missing_for_public_bind(), "router")
        if problem or self.http_port == -1:
            return problem
        missing = router_missing(self.http_host, self.allow_insecure_public, self.tenants_file, self.tls_cert)
        return refusal(self.http_host, missing, "router")


def parser() -> tuple[argparse.ArgumentParser, Flags]:
    p = new_parser("python -m router", "LLM router (gRPC)")
    return p, Flags(p, RouterConfig, title="router")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p, flags = parser()
    return parse_or_exit(p, argv, flags.build)
