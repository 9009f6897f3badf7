"""The router's Prometheus metrics, defined in one place.

Contract
- input: admission's counters (read at scrape time: refusals by (tenant, reason), admissions by
  tenant), the registry (for `/targets`).
- output: a `CollectorRegistry` with the per-request families of `common.request_metrics` (fed by
  `router.observe`, on the router's clock), gauges `llm_num_requests_running` (streaming from a
  worker) and `llm_num_requests_waiting` (admitted, in the fair queue), counters
  `llm_admission_rejections_total{tenant,reason}` and `llm_admitted_requests_total{tenant}` (with
  --no-queue, a request admitted and then refused for lack of KV room on every worker counts in
  both, as admitted and as `no_capacity`);
  `targets()` -> Prometheus HTTP service discovery JSON listing every known worker's metrics address.
  `export_state` adds gauges read at scrape time from the router's own bookkeeping, which must
  all be back to zero when no call is open (the cancellation-storm test checks this):
  `llm_router_open_calls` (drain counter), `llm_router_queue_length`,
  `llm_router_tokens_in_flight` (admission budget), `llm_router_tenant_open_requests{tenant}`,
  and per worker `llm_router_worker_reserved_tokens`, `llm_router_worker_outstanding_tokens`,
  `llm_router_worker_inflight`, `llm_router_worker_streams`, plus `llm_router_worker_healthy` and
  `llm_router_worker_circuit_open` (1 while its circuit breaker keeps traffic away) and
  `llm_router_worker_refused` (1 while its model or tokenizer fingerprint does not match the
  router's, router.models).
  `llm_router_requests_by_protocol_total{protocol,status}`: `llm_requests_total` split by the front
  (grpc | http) the request came in by; `llm_router_structured_requests_total{format,status}`: the
  requests with a response_format (json_object | json_schema | regex; a format llguidance cannot
  compile ends as invalid_argument); `llm_router_requests_by_model_total{model,status}` and
  `llm_router_tokens_by_model_total{model,kind}` (prompt | generation): the same per served model
  (a base model or a LoRA adapter; requests refused before validation carry no model).
  `export_http` (the OpenAI front's connection limits, router/openai/server.py): gauge
  `llm_router_http_connections` (open, admitted connections) and counter
  `llm_router_http_connections_closed_total{reason}` (header_timeout | body_timeout |
  write_timeout | too_many | too_many_per_client: closed by a limit, or refused at accept).
- state: the registry (one per router process).
- proven by: tests/test_observability_e2e.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.request_metrics import RequestMetrics
from router.registry import WorkerRegistry


class AdmissionCollector:
    """Admission's own counters (plain `collections.Counter`s on the event loop), exported as is."""

    def __init__(
        self,
        rejections: Callable[[], Mapping[tuple[str, str], int]],
        admitted: Callable[[], Mapping[str, int]],
    ):
        self._rejections = rejections
        self._admitted = admitted

    def collect(self):
        refused = CounterMetricFamily(
            "llm_admission_rejections", "Requests refused by admission control", labels=["tenant", "reason"]
        )
        for (tenant, reason), n in sorted(dict(self._rejections()).items()):  # dict(): one atomic copy
            refused.add_metric([tenant, reason], n)
        yield refused
        admitted = CounterMetricFamily(
            "llm_admitted_requests", "Requests admitted into the fair queue", labels=["tenant"]
        )
        for tenant, n in sorted(dict(self._admitted()).items()):
            admitted.add_metric([tenant], n)
        yield admitted


class HttpConnectionCollector:
    """The HTTP front's connection count and its closes by a limit, read at scrape time."""

    def __init__(self, stats: Callable[[], tuple[int, Mapping[str, int]]]):
        self._stats = stats

    def collect(self):
        num_open, closed = self._stats()
        yield GaugeMetricFamily(
            "llm_router_http_connections", "Open connections of the OpenAI HTTP API", value=num_open
        )
        family = CounterMetricFamily(
            "llm_router_http_connections_closed",
            "HTTP connections closed by a limit (header, body or write timeout) or refused at accept "
            "(too_many, too_many_per_client)",
            labels=["reason"],
        )
        for reason, n in sorted(closed.items()):
            family.add_metric([reason], n)
        yield family


class StateCollector:
    """The router's in-memory bookkeeping as gauges (read on the event loop's data at scrape time)."""

    def __init__(self, registry: WorkerRegistry, drain, admission, queue, dispatcher):
        self._registry, self._drain, self._admission = registry, drain, admission
        self._queue, self._dispatcher = queue, dispatcher

    def collect(self):
        yield GaugeMetricFamily(
            "llm_router_open_calls", "Generate/ListModels calls in progress", value=self._drain.num_inflight
        )
        yield GaugeMetricFamily(
            "llm_router_queue_length", "Requests in the fair queue", value=len(self._queue)
        )
        yield GaugeMetricFamily(
            "llm_router_tokens_in_flight",
            "prompt + max_tokens of admitted open requests",
            value=self._admission.tokens_in_flight,
        )
        per_tenant = GaugeMetricFamily(
            "llm_router_tenant_open_requests", "Admitted open requests per tenant", labels=["tenant"]
        )
        for tenant, n in sorted(self._admission.open_requests().items()):
            per_tenant.add_metric([tenant], n)
        yield per_tenant
        families = {
            "reserved_tokens": "KV tokens this router reserved on the worker (prompt + max_tokens)",
            "outstanding_tokens": "Tokens of work this router expects from the worker",
            "inflight": "This router's requests on the worker",
            "streams": "Open Generate streams to the worker",
            "healthy": "1 if the last health probe succeeded",
            "circuit_open": "1 while the worker's circuit breaker keeps traffic away",
            "refused": "1 while the router refuses the worker: its model or tokenizer fingerprint differs",
        }
        gauges = {
            k: GaugeMetricFamily(f"llm_router_worker_{k}", v, labels=["worker"]) for k, v in families.items()
        }
        for h in self._registry.all():
            values = {
                "reserved_tokens": self._dispatcher.reserved_tokens(h.address),
                "outstanding_tokens": h.outstanding_tokens,
                "inflight": h.num_inflight,
                "streams": len(h.streams),
                "healthy": int(h.healthy),
                "circuit_open": int(not h.breaker.allows()),
                "refused": int(bool(h.refused)),
            }
            for k, v in values.items():
                gauges[k].add_metric([h.address], v)
        yield from gauges.values()


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(self.registry, "router")
        self.running = Gauge(
            "llm_num_requests_running", "Requests streaming from a worker", registry=self.registry
        )
        self.waiting = Gauge(
            "llm_num_requests_waiting",
            "Requests admitted and waiting in the fair queue",
            registry=self.registry,
        )
        self.by_protocol = Counter(
            "llm_router_requests_by_protocol",
            "Requests by the front they came in by (grpc | http) and final status",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.by_model = Counter(
            "llm_router_requests_by_model",
            "Validated requests by the served model they named (base model or LoRA adapter) and status",
            ["model", "status"],
            registry=self.registry,
        )
        self.tokens_by_model = Counter(
            "llm_router_tokens_by_model",
            "Tokens of requests placed on a worker by served model (base or adapter): prompt | generation",
            ["model", "kind"],
            registry=self.registry,
        )
        self.lora_autoloads = Counter(
            "llm_router_lora_autoloads",
            "LoRA adapters loaded on demand (--lora-autoload) by result: loaded | evicted | full | "
            "failed | cached_failure | unavailable | deadline | tenant_limit | bad_name",
            ["result"],
            registry=self.registry,
        )
        self.grammar_compiles = Counter(
            "llm_router_grammar_compiles",
            "response_format grammars asked of the compiler (router/grammar_compile.py) by result: ok | "
            "error (llguidance refused it) | timeout (past its budget: process killed) | crashed | cached "
            "(answered from the cache, success or refusal) | shared (joined a compile in flight) | busy "
            "(the tenant's share or every process stayed busy: 429)",
            ["result"],
            registry=self.registry,
        )
        self.structured = Counter(
            "llm_router_structured_requests",
            "Requests with a response_format (json_object | json_schema | regex) by final status",
            ["format", "status"],
            registry=self.registry,
        )

    def export_admission(
        self,
        rejections: Callable[[], Mapping[tuple[str, str], int]],
        admitted: Callable[[], Mapping[str, int]],
    ) -> None:
        self.registry.register(AdmissionCollector(rejections, admitted))

    def export_http(self, stats: Callable[[], tuple[int, Mapping[str, int]]]) -> None:
        """`stats()` -> (open HTTP connections, {reason: connections closed by that limit})."""
        self.registry.register(HttpConnectionCollector(stats))

    def export_state(self, registry: WorkerRegistry, drain, admission, queue, dispatcher) -> None:
        self.registry.register(StateCollector(registry, drain, admission, queue, dispatcher))


def targets(registry: WorkerRegistry) -> list[dict]:
    """http_sd JSON: one target group per worker that reported a metrics address."""
    groups = []
    for h in registry.all():
        if h.info is not None and h.info.metrics_address:
            groups.append(
                {
                    "targets": [h.info.metrics_address],
                    "labels": {"job": "llm-worker", "worker": h.address, "model": h.info.model},
                }
            )
    return groups
