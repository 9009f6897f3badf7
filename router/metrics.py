"""The router's Prometheus metrics, defined in one place.

Contract
- input: admission's counters (read at scrape time: refusals by (tenant, reason), admissions by
  tenant), the registry (for `/targets`).
- output: a `CollectorRegistry` with the per-request families of `common.request_metrics` (fed by
  `router.observe`, on the router's clock), gauges `llm_num_requests_running` (streaming from a
  worker) and `llm_num_requests_waiting` (admitted, in the fair queue), counters
  `llm_admission_rejections_total{tenant,reason}` and `llm_admitted_requests_total{tenant}`;
  `targets()` -> Prometheus HTTP service discovery JSON listing every known worker's metrics address.
- state: the registry (one per router process).
- proven by: tests/test_observability_e2e.py.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily

from common.request_metrics import RequestMetrics
from router.registry import WorkerRegistry


class AdmissionCollector:
    """Admission's own counters (plain `collections.Counter`s on the event loop), exported as is."""

    def __init__(self, rejections: Callable[[], Mapping[tuple[str, str], int]],
                 admitted: Callable[[], Mapping[str, int]]):
        self._rejections = rejections
        self._admitted = admitted

    def collect(self):
        refused = CounterMetricFamily("llm_admission_rejections", "Requests refused by admission control",
                                      labels=["tenant", "reason"])
        for (tenant, reason), n in sorted(dict(self._rejections()).items()):  # dict(): one atomic copy
            refused.add_metric([tenant, reason], n)
        yield refused
        admitted = CounterMetricFamily("llm_admitted_requests", "Requests admitted into the fair queue",
                                       labels=["tenant"])
        for tenant, n in sorted(dict(self._admitted()).items()):
            admitted.add_metric([tenant], n)
        yield admitted


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(self.registry, "router")
        self.running = Gauge("llm_num_requests_running", "Requests streaming from a worker",
                             registry=self.registry)
        self.waiting = Gauge("llm_num_requests_waiting", "Requests admitted and waiting in the fair queue",
                             registry=self.registry)

    def export_admission(self, rejections: Callable[[], Mapping[tuple[str, str], int]],
                         admitted: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(AdmissionCollector(rejections, admitted))


def targets(registry: WorkerRegistry) -> list[dict]:
    """http_sd JSON: one target group per worker that reported a metrics address."""
    groups = []
    for h in registry.all():
        if h.info is not None and h.info.metrics_address:
            groups.append({"targets": [h.info.metrics_address],
                           "labels": {"job": "llm-worker", "worker": h.address, "model": h.info.model}})
    return groups
