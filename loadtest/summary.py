"""Records of one sweep point -> the numbers a report shows (docs/metrics.md "Per run" and "Fairness").

Contract
- input: the point's `RequestRecord`s (warm-up ones are dropped here), the tenants (weights) and
  the SLOs.
- output: a JSON-ready dict: counts, errors by status, duration (first measured send -> last
  measured end), request / output / total token throughput, peak output tokens/s (1-second
  buckets), peak in-flight, token totals as the client counted them and as the server reported
  them, `Summary`s of TTFT, ITL (pooled gaps), TPOT, E2E, tokens per chunk, client wait and server
  queue time, goodput; the same per tenant; fairness: each tenant's service
  (input + 2 x output tokens) / weight, Jain's index over tenants, and the cumulative service per
  tenant in 1-second steps with the largest gap between tenants over time.
- Latency statistics cover successful requests; throughput counts their tokens; a tenant's
  service counts every token delivered to it, inputs at the first token, outputs as they arrive.
"""

from __future__ import annotations

from collections import Counter

from loadtest.config import TenantSpec
from loadtest.record import NS_PER_S, RequestRecord
from loadtest.stats import jain_index, meets_slo, peak_concurrency, peak_per_bucket, summarize

OUTPUT_WEIGHT = 2  # docs/metrics.md: service = input + 2 x output tokens


def _opt(summary):
    return summary.to_json() if summary is not None else None


def _window_s(records: list[RequestRecord]) -> tuple[int, int]:
    return min(r.sent_ns for r in records), max(r.end_ns for r in records)


def basic_stats(records: list[RequestRecord], duration_s: float, slo: dict[str, float]) -> dict:
    ok = [r for r in records if r.ok]
    with_server_usage = [r for r in ok if r.completion_tokens is not None]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    out = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.status for r in records if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "client_output_tokens": sum(r.num_client_tokens for r in ok),
        "server_prompt_tokens": sum(r.prompt_tokens or 0 for r in with_server_usage),
        "server_completion_tokens": sum(r.completion_tokens for r in with_server_usage),
        "server_cached_prompt_tokens": sum(r.cached_prompt_tokens or 0 for r in with_server_usage),
        "num_with_server_usage": len(with_server_usage),
        "ttft_s": _opt(summarize([r.ttft_s for r in ok if r.ttft_s is not None])),
        "itl_s": _opt(summarize([gap for r in ok for gap in r.itl_s])),
        "tpot_s": _opt(summarize([r.tpot_s for r in ok if r.tpot_s is not None])),
        "e2e_s": _opt(summarize([r.e2e_s for r in ok])),
        "tokens_per_chunk": _opt(summarize([n for r in ok for n in r.chunk_tokens])),
        "client_wait_s": _opt(summarize([r.client_wait_s for r in records])),
        "server_queue_s": _opt(
            summarize([r.server_queue_ms / 1e3 for r in ok if r.server_queue_ms is not None])
        ),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        out["goodput"] = {
            "requests_per_s": per_s(good),
            "num_good": good,
            "fraction": good / len(records) if records else 0.0,
        }
    return out


def service_timeline(
    records: list[RequestRecord],
    tenants: tuple[TenantSpec, ...],
    start_ns: int,
    end_ns: int,
    step_s: float = 1.0,
) -> dict:
    """Cumulative (input + 2 x output tokens) / weight per tenant at the end of each step."""
    weights = {t.name: t.weight for t in tenants}
    num_steps = max(1, int((end_ns - start_ns) / (step_s * NS_PER_S)) + 1)
    per_step = {name: [0.0] * num_steps for name in weights}
    for r in records:
        row = per_step[r.tenant]
        if r.chunk_ns:
            row[min(num_steps - 1, int((r.chunk_ns[0] - start_ns) / (step_s * NS_PER_S)))] += (
                r.input_tokens / weights[r.tenant]
            )
        for t, n in zip(r.chunk_ns, r.chunk_tokens):
            row[min(num_steps - 1, int((t - start_ns) / (step_s * NS_PER_S)))] += (
                OUTPUT_WEIGHT * n / weights[r.tenant]
            )
    cumulative = {}
    for name, row in per_step.items():
        total, acc = 0.0, []
        for v in row:
            total += v
            acc.append(total)
        cumulative[name] = acc
    gaps = [
        max(c[i] for c in cumulative.values()) - min(c[i] for c in cumulative.values())
        for i in range(num_steps)
    ]
    return {
        "step_s": step_s,
        "t_s": [(i + 1) * step_s for i in range(num_steps)],
        "service": cumulative,
        "max_gap": max(gaps),
    }


def summarize_point(
    records: list[RequestRecord], tenants: tuple[TenantSpec, ...], slo: dict[str, float]
) -> dict:
    measured = [r for r in records if not r.warmup]
    if not measured:
        return {"num_requests": 0, "completed": 0, "failed": 0, "errors": {}, "tenants": {}}
    start_ns, end_ns = _window_s(measured)
    duration_s = (end_ns - start_ns) / NS_PER_S
    out = basic_stats(measured, duration_s, slo)
    out["peak_output_token_throughput"] = peak_per_bucket(
        [t - start_ns for r in measured if r.ok for t in r.chunk_ns],
        [n for r in measured if r.ok for n in r.chunk_tokens],
    )
    out["peak_in_flight"] = peak_concurrency([(r.sent_ns, r.end_ns) for r in measured])
    out["tenants"] = {}
    for tenant in tenants:
        mine = [r for r in measured if r.tenant == tenant.name]
        stats = basic_stats(mine, duration_s, slo)
        served = sum(r.input_tokens + OUTPUT_WEIGHT * r.num_client_tokens for r in mine if r.chunk_ns)
        stats["service"] = served
        stats["weighted_service"] = served / tenant.weight
        stats["weight"] = tenant.weight
        out["tenants"][tenant.name] = stats
    timeline = service_timeline(measured, tenants, start_ns, end_ns)
    out["fairness"] = {
        "jain_index": jain_index([s["weighted_service"] for s in out["tenants"].values()]),
        "max_service_gap": timeline["max_gap"],
        "timeline": timeline,
    }
    return out
