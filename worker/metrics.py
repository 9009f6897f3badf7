"""A worker's Prometheus metrics, defined in one place.

Contract
- input: the `AsyncEngine` (read at scrape time through `stats()`, an immutable snapshot taken on
  the engine thread after each step, so a scrape never touches engine state or the step loop).
- output: a `CollectorRegistry` with the per-request families of `common.request_metrics` (fed by
  `worker.observe`) and, from `EngineStats`: gauges `llm_num_requests_running`,
  `llm_num_requests_waiting`, `llm_kv_cache_usage_ratio`, `llm_kv_cache_free_blocks`,
  `llm_kv_cache_total_blocks`; counters `llm_preemptions_total`, `llm_prefix_cache_queries_total`,
  `llm_prefix_cache_hits_total` (prompt tokens looked up in / served from the prefix cache),
  `llm_structured_output_failures_total` (grammars that failed mid-generation),
  `llm_structured_output_over_budget_total` (of those, masks over the step budget),
  `llm_structured_output_compiles_total` (grammar texts compiled),
  `llm_engine_steps_total{mode="overlapped"|"synchronous"}` (steps planned while the step before
  ran, async scheduling / with none in flight); with LoRA (`LLMEngine.lora`, replaced on
  each load / unload): gauges `llm_lora_adapters`, `llm_lora_adapters_max`,
  `llm_lora_adapter_memory_bytes`, `llm_lora_reserved_memory_bytes`; the counter
  `llm_lora_adapter_operations_total{operation,result}` (fed by worker/server.py); and, observed
  on the engine thread after each committed step (`LLMEngine.last_step`, a step observer of the
  AsyncEngine), histograms `llm_engine_step_duration_seconds`, `llm_engine_step_tokens` (tokens
  computed) and `llm_engine_step_sequences`.
- state: the registry (one per worker process).
- proven by: tests/test_observability_e2e.py (counters equal a known workload).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.request_metrics import RequestMetrics
from worker.async_engine import AsyncEngine
from worker.engine import LLMEngine
from worker.types import RequestOutput

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
POWERS_OF_TWO = tuple(float(2**i) for i in range(14))  # 1 .. 8192


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
        yield CounterMetricFamily(
            "llm_structured_output_failures",
            "Constrained generations whose grammar failed mid-way (llguidance's error state): ended with EOS",
            value=s.num_grammar_failures,
        )
        yield CounterMetricFamily(
            "llm_structured_output_over_budget",
            "Of those, grammars whose mask took longer than --grammar-step-budget-ms (ended alone)",
            value=s.num_grammar_over_budget,
        )
        yield CounterMetricFamily(
            "llm_structured_output_compiles",
            "Grammar texts compiled on the worker (choices and requests of one grammar share one)",
            value=s.num_grammar_compiles,
        )
        yield CounterMetricFamily(
            "llm_spec_decode_draft_tokens",
            "Speculative decoding: drafted tokens verified by the model",
            value=s.num_draft_tokens,
        )
        yield CounterMetricFamily(
            "llm_spec_decode_accepted_tokens",
            "Speculative decoding: drafted tokens kept (the rest were sampled otherwise)",
            value=s.num_accepted_tokens,
        )
        steps = CounterMetricFamily(
            "llm_engine_steps",
            "Engine steps, by whether they were planned during the step before",
            labels=["mode"],
        )
        steps.add_metric(["overlapped"], s.num_overlapped_steps)
        steps.add_metric(["synchronous"], s.num_sync_steps)
        yield steps
        yield from self._lora()

    def _lora(self):
        """LoRA gauges, on workers serving adapters or loading them at run time (docs/lora.md)."""
        figures = getattr(getattr(self._engine, "engine", None), "lora", None)
        if figures is None:
            return
        yield GaugeMetricFamily("llm_lora_adapters", "LoRA adapters served", value=figures.adapters)
        yield GaugeMetricFamily(
            "llm_lora_adapters_max",
            "LoRA adapters this worker may hold (--max-lora-adapters with --lora-dir, else its start-ups)",
            value=figures.max_adapters,
        )
        yield GaugeMetricFamily(
            "llm_lora_adapter_memory_bytes",
            "Memory the served LoRA adapters' weights take",
            value=figures.memory_bytes,
        )
        yield GaugeMetricFamily(
            "llm_lora_reserved_memory_bytes",
            "Memory the KV pool left for run-time LoRA adapters when it was sized (--lora-dir)",
            value=figures.reserved_bytes,
        )


class WorkerMetrics:
    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = RequestMetrics(self.registry, "worker")
        self.registry.register(EngineCollector(engine))
        self.step_seconds = Histogram(
            "llm_engine_step_duration_seconds",
            "Time of each engine step: launch (or the previous step's end) -> its sampled tokens on the host",
            buckets=STEP_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.step_tokens = Histogram(
            "llm_engine_step_tokens",
            "Tokens each engine step computed (prompt-chunk tokens + one per decoding sequence)",
            buckets=POWERS_OF_TWO,
            registry=self.registry,
        )
        self.step_sequences = Histogram(
            "llm_engine_step_sequences",
            "Sequences in each engine step",
            buckets=POWERS_OF_TWO[:10],
            registry=self.registry,
        )
        self.lora_operations = Counter(
            "llm_lora_adapter_operations",
            "Run-time LoRA loads and unloads by result: ok, or the refusal's kind (invalid, off, full, "
            "busy, missing) or internal",
            ["operation", "result"],
            registry=self.registry,
        )
        self._seen_step = 0
        engine.step_observers.append(self._on_step)

    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each `step()` call: the step it committed, if any (three observes)."""
        record = engine.last_step
        if record is None or record.index == self._seen_step:
            return
        self._seen_step = record.index
        self.step_seconds.observe(record.seconds)
        self.step_tokens.observe(record.tokens)
        self.step_sequences.observe(record.sequences)
