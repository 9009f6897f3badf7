"""The per-request Prometheus families that router and worker both export: same names, same
buckets, each measured on its own process's clock (see docs/observability.md for what each side's
clock covers).

Contract
- input: a `CollectorRegistry` (one per process).
- output: counters `llm_requests_total{status}`, `llm_prompt_tokens_total`,
  `llm_generation_tokens_total`; histograms `llm_time_to_first_token_seconds`,
  `llm_inter_token_latency_seconds`, `llm_e2e_request_latency_seconds`, `llm_queue_time_seconds`,
  `llm_request_prompt_tokens`, `llm_request_generation_tokens`.
- state: the metric objects (thread-safe; prometheus_client locks per child).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# CPU serving is slow and GPU serving fast: the buckets span both.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LENGTH_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry, side: str):
        self.requests = Counter(
            "llm_requests",
            f"Requests by final status at the {side}: stop, length, cancelled, or the "
            "gRPC status code of a failure (invalid_argument, resource_exhausted, ...)",
            ["status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llm_prompt_tokens", f"Prompt tokens of requests the {side} finished", registry=registry
        )
        self.generation_tokens = Counter(
            "llm_generation_tokens", f"Tokens generated, as streamed by the {side}", registry=registry
        )
        self.ttft = Histogram(
            "llm_time_to_first_token_seconds",
            f"Arrival at the {side} -> first output token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "llm_inter_token_latency_seconds",
            f"Gaps between consecutive token-carrying messages at the {side}",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "llm_e2e_request_latency_seconds",
            f"Arrival at the {side} -> last message",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.queue = Histogram(
            "llm_queue_time_seconds",
            f"Time requests waited in the {side}'s queue",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.prompt_len = Histogram(
            "llm_request_prompt_tokens",
            "Prompt length per request",
            buckets=LENGTH_BUCKETS,
            registry=registry,
        )
        self.output_len = Histogram(
            "llm_request_generation_tokens",
            "Generated tokens per request",
            buckets=LENGTH_BUCKETS,
            registry=registry,
        )


class TokenClock:
    """One request's token timing on one process: TTFT and inter-token gaps as messages arrive."""

    __slots__ = ("_metrics", "arrival_s", "first_token_s", "last_token_s", "num_tokens")

    def __init__(self, metrics: RequestMetrics, arrival_s: float):
        self._metrics = metrics
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_tokens = 0

    def tokens(self, n: int, now_s: float) -> None:
        if n <= 0:
            return
        m = self._metrics
        if self.last_token_s is None:
            self.first_token_s = now_s
            m.ttft.observe(now_s - self.arrival_s)
        else:
            m.itl.observe(now_s - self.last_token_s)
        self.last_token_s = now_s
        self.num_tokens += n
        m.generation_tokens.inc(n)

    def finish(self, status: str, num_prompt_tokens: int | None, now_s: float) -> None:
        """`num_prompt_tokens` None: the request never reached serving (refused before it)."""
        m = self._metrics
        m.requests.labels(status).inc()
        if num_prompt_tokens is None:
            return
        m.prompt_tokens.inc(num_prompt_tokens)
        m.e2e.observe(now_s - self.arrival_s)
        m.prompt_len.observe(num_prompt_tokens)
        m.output_len.observe(self.num_tokens)
