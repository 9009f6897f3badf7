"""Fairness experiment (`make bench-fairness`): three tenants with different weights and rates,
served with the VTC fair queue and with plain FCFS, side by side in the same run.

Set-up: two twin workers (one torch thread each; a small KV pool, 272 tokens: about five
requests, so that the router's queue, not the worker's, holds the backlog), a router with
`--fair-queue vtc` on one and `--fair-queue fcfs` on the other, the same tenants file (weights, a
per-tenant queue cap). The load tester's runner (`loadtest`) drives both at the same time with the
same seeded request streams, so drift in a shared machine's load hits both sides alike, and its
report is written as usual; this command adds the fairness figures and `fairness.png`:

- per tenant: requests/s, output tokens/s, refusals (RESOURCE_EXHAUSTED), p50/p99 TTFT;
- service = (input + 2 x output tokens) / weight, as the VTC counts it (client-side: inputs at the
  first token, outputs as they arrive);
- Jain's index of weighted service over the backlogged tenants (1 = equal), and Jain's index of
  service / max-min fair share over all tenants (the fair share water-fills the delivered service
  over the tenants' offered load, so a light tenant is owed only what it asked for);
- the largest difference in weighted service between backlogged tenants over time, next to the
  bound of docs/fairness.md (U = C + 2K / w_min, 2U over a window).

Default load (tuned for 2 busy shared CPU cores, where the worker makes ~8 output tokens/s):
a (weight 1) sends 2x what b (weight 2) sends, both more than the worker serves, each capped at 4
queued requests (the rest is refused with RESOURCE_EXHAUSTED); c (weight 1) sends little. VTC
should give b about twice a's tokens and c short TTFTs; FCFS serves in arrival order, so a gets
more than b and c waits behind both. On a faster machine raise --rates (or the lengths) until
a and b stay backlogged; the report says which tenants were.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
import tempfile
import time
from datetime import datetime, timezone

import grpc
import yaml

from devtools.local import LocalProcess
from loadtest.cli import load_tokenizer
from loadtest.config import RunConfig, Target, TenantSpec
from loadtest.environment import git_revision, machine
from loadtest.grpc_client import GrpcClient, SendOptions
from loadtest.lengths import LengthDist
from loadtest.report import write_json, write_markdown
from loadtest.runner import Clock, PointRun
from loadtest.stats import jain_index
from loadtest.summary import OUTPUT_WEIGHT, summarize_point
from loadtest.sweep import PointResult, point_seed
from loadtest.workload import SyntheticText, Workload
from protos.llm.v1 import worker_pb2, worker_pb2_grpc
from router.tenants import hash_key

MODES = ("vtc", "fcfs")


@dataclasses.dataclass(frozen=True)
class BenchTenant:
    name: str
    weight: float
    rate_per_s: float
    input_len: int
    output_len: int

    @property
    def key(self) -> str:
        return f"bench-{self.name}"

    @property
    def max_cost(self) -> int:
        return self.input_len + OUTPUT_WEIGHT * self.output_len


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--duration-s",
        type=float,
        default=40.0,
        help="measured seconds (the default run takes ~2 min; try 300 for a long one)",
    )
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--rates", default="1.0,0.5,0.08", help="requests/s of tenants a, b, c (Poisson)")
    p.add_argument("--weights", default="1,2,1", help="weights of tenants a, b, c")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=4, help="per-tenant queue cap in the routers")
    p.add_argument("--kv-cache-mb", type=float, default=12, help="worker KV pool (12 MiB: 272 tokens)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads of each of the two workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: results/fairness/<UTC time>")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def tenants_from(a: argparse.Namespace) -> list[BenchTenant]:
    rates = [float(x) for x in a.rates.split(",")]
    weights = [float(x) for x in a.weights.split(",")]
    if len(rates) != 3 or len(weights) != 3:
        raise SystemExit("--rates and --weights take three values (tenants a, b, c)")
    return [BenchTenant(n, w, r, a.input_len, a.output_len) for n, w, r in zip("abc", weights, rates)]


def tenants_yaml(tenants: list[BenchTenant], max_queued: int) -> str:
    return yaml.safe_dump(
        {
            "tenants": [
                {"name": t.name, "key_sha256": hash_key(t.key), "weight": t.weight, "max_queued": max_queued}
                for t in tenants
            ]
        },
        sort_keys=False,
    )


def worker_capacity_tokens(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return load.num_total_blocks * info.block_size


def fair_shares(demand: dict[str, float], weights: dict[str, float], total: float) -> dict[str, float]:
    """Weighted max-min fair split of `total` service over tenants offering `demand` (water-filling)."""
    share = {name: 0.0 for name in demand}
    active = {n for n in demand if demand[n] > 0}
    left = total
    while active and left > 1e-9:
        level = left / sum(weights[n] for n in active)
        capped = {n for n in active if demand[n] - share[n] <= level * weights[n]}
        if not capped:
            for n in active:
                share[n] += level * weights[n]
            break
        for n in capped:
            left -= demand[n] - share[n]
            share[n] = demand[n]
        active -= capped
    return share


def fairness_figures(point, tenants: list[BenchTenant], capacity_tokens: int) -> dict:
    """The figures this benchmark adds to a loadtest point (`PointResult`)."""
    summary = point.summary
    measured = [r for r in point.records if not r.warmup]
    by_name = {t.name: t for t in tenants}
    weights = {t.name: t.weight for t in tenants}
    demand = {
        t.name: sum(by_name[r.tenant].max_cost for r in measured if r.tenant == t.name) for t in tenants
    }
    service = {name: summary["tenants"][name]["service"] for name in by_name}
    shares = fair_shares(demand, weights, sum(service.values()))
    backlogged = [n for n in by_name if demand[n] > shares[n] * 1.05]
    timeline = summary["fairness"]["timeline"]
    gaps = [0.0]
    if len(backlogged) >= 2:
        series = [timeline["service"][n] for n in backlogged]
        gaps = [max(s[i] for s in series) - min(s[i] for s in series) for i in range(len(timeline["t_s"]))]
    w_min = min(weights.values())
    bound_u = max(t.max_cost / t.weight for t in tenants) + 2 * capacity_tokens / w_min
    per_tenant = {}
    for name, t in summary["tenants"].items():
        per_tenant[name] = {
            "weight": t["weight"],
            "completed": t["completed"],
            "refused": t["errors"].get("RESOURCE_EXHAUSTED", 0),
            "other_failures": t["failed"] - t["errors"].get("RESOURCE_EXHAUSTED", 0),
            "requests_per_s": t["request_throughput"],
            "output_tokens_per_s": t["output_token_throughput"],
            "ttft_p50_s": t["ttft_s"]["p50"] if t["ttft_s"] else None,
            "ttft_p99_s": t["ttft_s"]["p99"] if t["ttft_s"] else None,
            "weighted_service": t["weighted_service"],
            "offered": demand[name],
            "fair_share": shares[name],
        }
    return {
        "mode": point.target,
        "tenants": per_tenant,
        "backlogged": backlogged,
        "jain_backlogged": jain_index([service[n] / weights[n] for n in backlogged]) if backlogged else None,
        "jain_vs_fair_share": jain_index([service[n] / shares[n] for n in by_name if shares[n] > 0]),
        "max_service_difference": max(gaps),
        "bound_u": bound_u,
        "bound_window": 2 * bound_u,
        "capacity_tokens": capacity_tokens,
        "duration_s": summary["duration_s"],
        "gap_series": {"t_s": timeline["t_s"], "gap": gaps},
    }


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(figures: list[dict], tenants: list[BenchTenant]) -> str:
    lines = [
        "## Fairness: VTC vs FCFS",
        "",
        "| mode | tenant | weight | offered req/s | ok | refused | req/s | out tok/s | TTFT p50 ms | "
        "TTFT p99 ms | service / weight | service / fair share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rates = {t.name: t.rate_per_s for t in tenants}
    for f in figures:
        for name, t in f["tenants"].items():
            ttft50 = None if t["ttft_p50_s"] is None else t["ttft_p50_s"] * 1e3
            ttft99 = None if t["ttft_p99_s"] is None else t["ttft_p99_s"] * 1e3
            ratio = t["weighted_service"] * t["weight"] / t["fair_share"] if t["fair_share"] else None
            lines.append(
                f"| {f['mode']} | {name} | {t['weight']:g} | {rates[name]:g} | {t['completed']} | "
                f"{t['refused']} | {t['requests_per_s']:.2f} | {t['output_tokens_per_s']:.1f} | "
                f"{_fmt(ttft50, 0)} | {_fmt(ttft99, 0)} | {t['weighted_service']:.0f} | "
                f"{_fmt(ratio, 2)} |"
            )
    lines += [
        "",
        "| mode | backlogged | Jain (weighted service, backlogged) | Jain (service / fair share, all) | "
        "max service difference over time | bound U / 2U |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f['mode']} | {', '.join(f['backlogged']) or '–'} | {_fmt(f['jain_backlogged'], 3)} | "
            f"{_fmt(f['jain_vs_fair_share'], 3)} | {f['max_service_difference']:.0f} | "
            f"{f['bound_u']:.0f} / {f['bound_window']:.0f} |"
        )
    if len(figures) == 2:
        vtc, fcfs = figures
        c_vtc, c_fcfs = vtc["tenants"].get("c", {}), fcfs["tenants"].get("c", {})
        if c_vtc.get("ttft_p99_s") and c_fcfs.get("ttft_p99_s"):
            lines += [
                "",
                f"Light tenant c, TTFT p99: fcfs / vtc = {c_fcfs['ttft_p99_s'] / c_vtc['ttft_p99_s']:.1f}×.",
            ]
        a_b = [
            f"{f['mode']} "
            f"{f['tenants']['b']['output_tokens_per_s'] / f['tenants']['a']['output_tokens_per_s']:.2f}"
            for f in figures
            if f["tenants"]["a"]["output_tokens_per_s"]
        ]
        lines.append(f"Output tokens b / a (weights 2 : 1; a sends 2× b's requests): {', '.join(a_b)}.")
    lines += [
        "",
        "Service = (input + 2 × output tokens) / weight, measured at the client. Fair share: "
        "the delivered service water-filled over the tenants' offered load (prompt + 2 × max_tokens "
        "of every request sent, refused ones included). The bound is docs/fairness.md §3 with K = "
        f"{figures[0]['capacity_tokens']} tokens (each worker's KV capacity); client-side timing adds "
        "up to one request in flight per tenant of slack.",
        "",
        "![fairness](fairness.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(points, figures: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(points), figsize=(6 * len(points), 10), squeeze=False)
    for col, (point, f) in enumerate(zip(points, figures)):
        timeline = point.summary["fairness"]["timeline"]
        ax = axes[0][col]
        for name, series in timeline["service"].items():
            ax.plot(timeline["t_s"], series, label=f"{name} (w {f['tenants'][name]['weight']:g})")
        ax.set_title(f"{f['mode']}: cumulative service / weight")
        ax.set_ylabel("(input + 2 × output) / weight")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.plot(f["gap_series"]["t_s"], f["gap_series"]["gap"], color="black")
        ax.axhline(f["bound_window"], color="red", linestyle="--", label="2U (bound over a window)")
        ax.set_title(f"{f['mode']}: service difference between backlogged tenants")
        ax.set_ylabel("weighted tokens")
        ax.legend(fontsize=8)
        ax = axes[2][col]
        for name in f["tenants"]:
            ok = [
                r
                for r in point.records
                if r.tenant == name and r.ok and not r.warmup and r.ttft_s is not None
            ]
            ax.scatter([r.sent_ns / 1e9 for r in ok], [r.ttft_s * 1e3 for r in ok], s=6, label=name)
        if ax.collections and any(len(c.get_offsets()) for c in ax.collections):
            ax.set_yscale("log")
        ax.set_title(f"{f['mode']}: TTFT by send time")
        ax.set_xlabel("s since the run started")
        ax.set_ylabel("TTFT (ms)")
        ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run_modes(
    config: RunConfig, addresses: dict[str, str], specs: tuple[TenantSpec, ...], progress: bool
) -> tuple[list[PointResult], dict]:
    """Both modes at once, each on its own router and worker, with the same seeded request streams."""
    synthetic = SyntheticText(load_tokenizer(config.tokenizer))
    options = SendOptions(
        config.model, config.temperature, config.ignore_eos, config.prompt_format, config.request_timeout_s
    )
    seed = point_seed(config.seed, 0)
    clocks = {mode: Clock() for mode in addresses}
    clients = {mode: GrpcClient(address, options, clocks[mode].now_ns) for mode, address in addresses.items()}
    try:
        infos = {
            mode: {
                "name": mode,
                "api": "grpc",
                "address": addresses[mode],
                "server_info": await clients[mode].server_info(specs[0].api_key),
            }
            for mode in addresses
        }
        runs = {
            mode: PointRun(
                dataclasses.replace(config, progress=progress and i == 0),
                specs,
                {t.name: Workload(t, seed, synthetic) for t in specs},
                clients[mode],
                clocks[mode],
                seed,
                f"fair-{mode}",
                mode,
            )
            for i, mode in enumerate(addresses)
        }
        records = await asyncio.gather(*(run.run() for run in runs.values()))
    finally:
        for client in clients.values():
            await client.close()
    results = [
        PointResult(mode, "run", None, recs, summarize_point(recs, specs, {}))
        for mode, recs in zip(runs, records)
    ]
    return results, infos


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tenants = tenants_from(a)
    out_dir = pathlib.Path(a.out_dir or f"results/fairness/{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = tuple(
        TenantSpec(
            name=t.name,
            api_key=t.key,
            weight=t.weight,
            arrival="poisson",
            rate_per_s=t.rate_per_s,
            input_len=LengthDist.parse(str(t.input_len)),
            output_len=LengthDist.parse(str(t.output_len)),
        )
        for t in tenants
    )
    procs: list[LocalProcess] = []
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        tenants_file = pathlib.Path(tmp) / "tenants.yaml"
        tenants_file.write_text(tenants_yaml(tenants, a.max_queued), encoding="utf-8")
        try:
            workers = {
                mode: LocalProcess(
                    f"worker-{mode}",
                    [
                        "-m",
                        "worker",
                        "--port",
                        "0",
                        "--kv-cache-mb",
                        str(a.kv_cache_mb),
                        "--num-threads",
                        str(a.worker_threads),
                    ],
                    quiet=True,
                )
                for mode in MODES
            }
            procs.extend(workers.values())
            routers = {}
            for mode in MODES:
                router = LocalProcess(
                    f"router-{mode}",
                    [
                        "-m",
                        "router",
                        "--port",
                        "0",
                        "--workers",
                        workers[mode].wait_listening(),
                        "--health-poll-s",
                        "0.2",
                        "--tenants",
                        str(tenants_file),
                        "--fair-queue",
                        mode,
                    ],
                    quiet=True,
                )
                procs.insert(0, router)
                routers[mode] = router.wait_listening(120)
            capacity = worker_capacity_tokens(workers[MODES[0]].wait_listening())
            config = RunConfig(
                targets=tuple(Target(mode, "grpc", routers[mode]) for mode in MODES),
                tenants=specs,
                duration_s=a.duration_s,
                warmup_s=a.warmup_s,
                seed=a.seed,
                prompt_format="tokens",
                drain_timeout_s=3.0,
                request_timeout_s=600.0,
                out_dir=str(out_dir),
                progress=a.progress,
            )
            started = time.monotonic()
            results, infos = asyncio.run(run_modes(config, routers, specs, a.progress))
            elapsed_s = time.monotonic() - started
        finally:
            for proc in procs:
                proc.stop()

    figures = [fairness_figures(p, tenants, capacity) for p in results]
    report = {
        "tool": "benchmarks.fairness",
        "format": 1,
        "created": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        "command": ["python -m benchmarks.fairness", *(sys.argv[1:] if argv is None else argv)],
        "config": config.to_json(),
        "seed": a.seed,
        "git": git_revision(),
        "machine": machine(),
        "targets": infos,
        "points": [r.to_json() for r in results],
        "fairness": [{k: v for k, v in f.items() if k != "gap_series"} for f in figures],
        "elapsed_s": elapsed_s,
    }
    write_json(report, results, out_dir)
    plot_files = []
    try:
        from loadtest.plots import write_plots

        plot(results, figures, out_dir / "fairness.png")
        plot_files = write_plots(results, out_dir)
    except ImportError as exc:
        print(f"plots skipped: {exc}", file=sys.stderr)
    md = write_markdown(report, out_dir, plot_files)
    fairness_md = markdown(figures, tenants)
    md.write_text(md.read_text(encoding="utf-8") + "\n" + fairness_md, encoding="utf-8")
    (out_dir / "fairness.json").write_text(json.dumps(report["fairness"], indent=1) + "\n", encoding="utf-8")
    print(fairness_md)
    print(f"full report: {md}; plot: {out_dir / 'fairness.png'} ({elapsed_s:.0f} s of load)", file=sys.stderr)
    return 0 if all(p.summary.get("completed") for p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
