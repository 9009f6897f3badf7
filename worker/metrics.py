"""A worker's Prometheus metrics, defined in one place.

Contract
- input: the `AsyncEngine` (read at scrape time through `stats()`, an immutable snapshot taken on
  the engine thread after each step, so a scrape never touches engine state or the step loop).
- output: a `CollectorRegistry` with the per-request families of `common.request_metrics` (fed by
  `worker.observe`) and, from `EngineStats`: gauges `llm_num_requests_running`,
  `llm_num_requests_waiting`, `llm_kv_cache_usage_ratio`, `llm_kv_cache_free_blocks`,
  `llm_kv_cache_total_blocks`; counters `llm_preemptions_total`, `llm_prefix_cache_queries_total`,
  `llm_prefix_cache_hits_total` (prompt tokens looked up in / served from the prefix cache),
  `llm_engine_steps_total{mode="overlapped"|"synchronous"}` (steps planned while the step before
  ran, async scheduling / with none in flight).
- state: the registry (one per worker process).
- proven by: tests/test_observability_e2e.py (counters equal a known workload).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.request_metrics import RequestMetrics
from worker.async_engine import AsyncEngine


class EngineCollector:
    """Engine gauges and cumulative counters, read from the latest `EngineStats` at scrape time."""

    def __init__(self, engine: AsyncEngine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        yield GaugeMetricFamily(
            "llm_num_requests_running", "Sequences in the running batch", value=s.num_running
        )
        yield GaugeMetricFamily(
            "llm_num_requests_waiting",
            "Sequences waiting for their first schedule (or preempted)",
            value=s.num_waiting,
        )
        yield GaugeMetricFamily(
            "llm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", value=s.kv_usage
        )
        yield GaugeMetricFamily("llm_kv_cache_free_blocks", "Free KV-cache blocks", value=s.num_free_blocks)
        yield GaugeMetricFamily(
            "llm_kv_cache_total_blocks", "KV-cache blocks in the pool", value=s.num_total_blocks
        )
        yield CounterMetricFamily(
            "llm_preemptions", "Sequences preempted (KV blocks recomputed later)", value=s.num_preemptions
        )
        yield CounterMetricFamily(
            "llm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s.num_prefix_queries,
        )
        yield CounterMetricFamily(
            "llm_prefix_cache_hits", "Prompt tokens served from the prefix cache", value=s.num_prefix_hits
        )
        steps = CounterMetricFamily(
            "llm_engine_steps",
            "Engine steps, by whether they were planned during the step before",
            labels=["mode"],
        )
        steps.add_metric(["overlapped"], s.num_overlapped_steps)
        steps.add_metric(["synchronous"], s.num_sync_steps)
        yield steps


class WorkerMetrics:
    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(self.registry, "worker")
        self.registry.register(EngineCollector(engine))
