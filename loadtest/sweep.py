"""Runs every sweep point on every target, interleaved, and summarizes each.

Contract
- input: `RunConfig`, one connected client per target (by target name), the `SyntheticText` and
  prompt sets the tenants need, a run id for request ids.
- output: `list[PointResult]` in run order. Each point's request stream is seeded by
  (seed, point index): both targets of a comparison get the same stream, and successive points
  get fresh prompts (so a server's prefix cache does not carry one point's prompts into the next).
- order: each point runs on every target before the next point; the target order alternates
  (A B, B A, A B, ...) so slow drift on a shared machine does not favour one side.
- server counters: when a target has a metrics URL, its Prometheus counters are scraped before
  and (`METRICS_SETTLE_S` after the last request ended) after each point, and the differences
  stored with the point; they cover warm-up requests too (compare with `all_requests()`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from loadtest.config import RunConfig
from loadtest.environment import counter_deltas, scrape_counters
from loadtest.record import RequestRecord
from loadtest.runner import Clock, PointRun
from loadtest.summary import summarize_point
from loadtest.workload import SyntheticText, Workload

# A server counts a request when it ends, which can be just after the client saw the last message.
METRICS_SETTLE_S = 1.0


@dataclass
class PointResult:
    target: str
    label: str
    value: float | None
    records: list[RequestRecord]
    summary: dict
    server_counters: dict | None = None

    def all_requests(self) -> dict:
        """Counts over every request sent, warm-up included: what the server's counters saw."""
        ok = [r for r in self.records if r.ok]
        return {
            "sent": len(self.records),
            "ok": len(ok),
            "server_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "server_completion_tokens": sum(r.completion_tokens or 0 for r in ok),
            "client_output_tokens": sum(r.num_client_tokens for r in ok),
        }

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "label": self.label,
            "sweep_value": self.value,
            "summary": self.summary,
            "all_requests": self.all_requests(),
            "server_counters": self.server_counters,
        }


def point_seed(seed: int, index: int) -> str:
    return f"{seed}:{index}"


def point_label(config: RunConfig, value: float | None) -> str:
    return f"{config.sweep}={value:g}" if config.sweep and value is not None else "run"


async def run_sweep(
    config: RunConfig,
    clients: dict,
    clock: Clock,
    synthetic: SyntheticText | None,
    prompt_sets: dict[str, tuple[str, ...]],
    run_id: str,
) -> list[PointResult]:
    results = []
    slo = dict(config.slo_s)
    for index, value in enumerate(config.sweep_values or (None,)):
        tenants = config.tenants_at(value)
        label = point_label(config, value)
        seed = point_seed(config.seed, index)
        order = config.targets if index % 2 == 0 else tuple(reversed(config.targets))
        for target in order:
            workloads = {t.name: Workload(t, seed, synthetic, prompt_sets.get(t.prompts)) for t in tenants}
            before = scrape_counters(target.metrics_url) if target.metrics_url else None
            run = PointRun(
                config,
                tenants,
                workloads,
                clients[target.name],
                clock,
                seed,
                f"lt-{run_id}-{index}",
                f"{target.name} {label}",
            )
            records = await run.run()
            counters = None
            if before is not None:
                await asyncio.sleep(METRICS_SETTLE_S)
                counters = counter_deltas(before, scrape_counters(target.metrics_url))
            results.append(
                PointResult(
                    target.name, label, value, records, summarize_point(records, tenants, slo), counters
                )
            )
    return results
