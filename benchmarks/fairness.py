"""Fairness experiment (`make bench-fairness`): three tenants with different weights, served with
the VTC fair queue and with plain FCFS side by side, at offered loads calibrated to the capacity
measured first; exits non-zero, with the reason, when the run does not show VTC's weights honoured.

Set-up: two twin workers (one torch thread each; a small KV pool, 12 MiB: 544 tokens in bfloat16,
about 11 requests, so that the router's queue, not the worker's, holds the backlog), a router with
`--fair-queue vtc` on one and `--fair-queue fcfs` on the other, the same tenants file (weights, a
per-tenant queue cap). The load tester's runner (`loadtest`) drives both at the same time with the
same seeded request streams, so drift in a shared machine's load hits both sides alike.

1. Calibration: a closed loop of 2x the requests a worker holds, through both routers at once,
   for `--calibrate-s`; capacity = output tokens/s over that time / output length (requests/s).
2. Per load level L in `--loads` (default 3 and 6): Poisson streams, a (weight 1) and b (weight 2)
   together offer L x capacity, a sending twice b's requests, so that each alone offers at least
   its fair share x 1.5 and both stay backlogged; c (weight 1) sends `--light-share` x capacity.
3. Figures (benchmarks/fairness_figures.py): per tenant requests, output tokens/s, refusals, TTFT
   p50 / max; the time in which a and b were both backlogged, b / a service within it (VTC: the
   weights, 2.00), the largest swing of the weighted service difference next to the bound 2U of
   docs/fairness.md section 3. Written: per level the load tester's report under `level-<L>/`,
   and `fairness.md`, `fairness.json`, `fairness.png` in the run's directory.

Exit status: 0 when at every level VTC kept b / a within `--tolerance` of the weights while both
were backlogged for at least `--min-backlogged` of the time, and within the bound; 1 with the
reason otherwise (too little backlog: the run cannot show the weights; a ratio outside; calibration
that served nothing; a process that did not start or a worker that stopped answering). FCFS is the
control and has no pass mark.
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

from benchmarks.fairness_figures import fairness_figures, markdown, plot, verdict
from devtools.local import LocalProcess
from loadtest.cli import load_tokenizer
from loadtest.config import RunConfig, Target, TenantSpec
from loadtest.environment import git_revision, machine
from loadtest.grpc_client import GrpcClient, SendOptions
from loadtest.lengths import LengthDist
from loadtest.record import NS_PER_S
from loadtest.report import write_json, write_markdown
from loadtest.runner import Clock, PointRun
from loadtest.summary import OUTPUT_WEIGHT, summarize_point
from loadtest.sweep import PointResult, point_seed
from loadtest.workload import SyntheticText, Workload
from protos.llm.v1 import worker_pb2, worker_pb2_grpc
from router.tenants import hash_key

MODES = ("vtc", "fcfs")


CAL = "cal"  # the calibration tenant


@dataclasses.dataclass(frozen=True)
class BenchTenant:
    name: str
    weight: float
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
    p.add_argument("--duration-s", type=float, default=60.0, help="measured seconds per load level")
    p.add_argument("--warmup-s", type=float, default=10.0, help="unmeasured seconds before each level")
    p.add_argument("--calibrate-s", type=float, default=15.0, help="closed-loop capacity measurement")
    p.add_argument(
        "--loads",
        default="3,6",
        help="offered load of a and b together, as multiples of the measured capacity (a sends 2x b)",
    )
    p.add_argument("--light-share", type=float, default=0.05, help="c's offered load / capacity")
    p.add_argument("--weights", default="1,2,1", help="weights of tenants a, b, c")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=16, help="per-tenant queue cap in the routers")
    p.add_argument("--kv-cache-mb", type=float, default=12, help="worker KV pool (12 MiB: 544 tokens)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads of each of the two workers")
    p.add_argument("--tolerance", type=float, default=0.10, help="allowed |b/a service / weights - 1|")
    p.add_argument("--min-backlogged", type=float, default=0.95, help="share of the time a, b must queue")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: results/fairness/<UTC time>")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    try:
        a.load_levels = [float(x) for x in a.loads.split(",")]
        a.weight_list = [float(x) for x in a.weights.split(",")]
    except ValueError as exc:
        p.error(f"--loads / --weights: {exc}")
    if len(a.weight_list) != 3 or min(a.weight_list) <= 0 or not a.load_levels or min(a.load_levels) <= 0:
        p.error("--weights takes three positive values (tenants a, b, c); --loads positive multiples")
    if a.duration_s <= 0 or a.calibrate_s <= 0 or a.warmup_s < 0:
        p.error("--duration-s and --calibrate-s must be > 0, --warmup-s >= 0")
    return a


def tenants_from(a: argparse.Namespace) -> list[BenchTenant]:
    return [BenchTenant(n, w, a.input_len, a.output_len) for n, w in zip("abc", a.weight_list)]


def level_rates(load: float, capacity_req_s: float, light_share: float) -> dict[str, float]:
    """Requests/s per tenant: a and b together `load` x capacity, a twice b; c a light share."""
    return {
        "a": load * capacity_req_s * 2 / 3,
        "b": load * capacity_req_s / 3,
        "c": light_share * capacity_req_s,
    }


def specs_for(tenants: list[BenchTenant], rates: dict[str, float]) -> tuple[TenantSpec, ...]:
    return tuple(
        TenantSpec(
            name=t.name,
            api_key=t.key,
            weight=t.weight,
            arrival="poisson",
            rate_per_s=rates[t.name],
            input_len=LengthDist.parse(str(t.input_len)),
            output_len=LengthDist.parse(str(t.output_len)),
        )
        for t in tenants
    )


def tenants_yaml(tenants: list[BenchTenant], max_queued: int) -> str:
    rows = [
        {"name": t.name, "key_sha256": hash_key(t.key), "weight": t.weight, "max_queued": max_queued}
        for t in tenants
    ]
    rows.append({"name": CAL, "key_sha256": hash_key(f"bench-{CAL}"), "weight": 1.0})
    return yaml.safe_dump({"tenants": rows}, sort_keys=False)


def worker_capacity_tokens(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return load.num_total_blocks * info.block_size


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


def start_stack(
    a: argparse.Namespace, tenants_file: pathlib.Path, procs: list[LocalProcess]
) -> tuple[dict[str, str], str]:
    """Two twin workers and a router per mode: the routers' addresses by mode, one worker's."""
    workers = {
        mode: LocalProcess(
            f"worker-{mode}",
            ["-m", "worker", "--port", "0", "--kv-cache-mb", str(a.kv_cache_mb)]
            + ["--num-threads", str(a.worker_threads)],
            quiet=True,
        )
        for mode in MODES
    }
    procs.extend(workers.values())
    routers = {}
    for mode in MODES:
        router = LocalProcess(
            f"router-{mode}",
            ["-m", "router", "--port", "0", "--workers", workers[mode].wait_listening()]
            + ["--health-poll-s", "0.2", "--tenants", str(tenants_file), "--fair-queue", mode],
            quiet=True,
        )
        procs.insert(0, router)
        routers[mode] = router.wait_listening(120)
    return routers, workers[MODES[0]].wait_listening()


def output_rate(point: PointResult, warmup_s: float, duration_s: float) -> float:
    """Output tokens/s of a point within its measured window, by token arrival time."""
    lo, hi = warmup_s * NS_PER_S, (warmup_s + duration_s) * NS_PER_S
    tokens = sum(n for r in point.records for t, n in zip(r.chunk_ns, r.chunk_tokens) if lo <= t < hi)
    return tokens / duration_s


def calibrate(
    a: argparse.Namespace, config: RunConfig, routers: dict[str, str], capacity_tokens: int
) -> dict:
    """Closed loop, 2x the requests one worker holds, through both routers at once."""
    fits = max(1, capacity_tokens // (a.input_len + a.output_len))
    spec = TenantSpec(
        name=CAL,
        api_key=f"bench-{CAL}",
        arrival="closed",
        concurrency=2 * fits,
        input_len=LengthDist.parse(str(a.input_len)),
        output_len=LengthDist.parse(str(a.output_len)),
    )
    warmup_s = min(5.0, a.calibrate_s / 3)
    cal = dataclasses.replace(config, tenants=(spec,), warmup_s=warmup_s, duration_s=a.calibrate_s)
    points, _ = asyncio.run(run_modes(cal, routers, (spec,), a.progress))
    tok_s = {p.target: output_rate(p, warmup_s, a.calibrate_s) for p in points}
    req_s = sum(tok_s.values()) / len(tok_s) / a.output_len
    return {"concurrency": 2 * fits, "output_tok_s": tok_s, "capacity_req_s": req_s}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tenants = tenants_from(a)
    out_dir = pathlib.Path(a.out_dir or f"results/fairness/{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    procs: list[LocalProcess] = []
    levels, level_points, infos = [], [], {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        tenants_file = pathlib.Path(tmp) / "tenants.yaml"
        tenants_file.write_text(tenants_yaml(tenants, a.max_queued), encoding="utf-8")
        try:
            routers, worker = start_stack(a, tenants_file, procs)
            capacity = worker_capacity_tokens(worker)
            base = RunConfig(
                targets=tuple(Target(mode, "grpc", routers[mode]) for mode in MODES),
                tenants=specs_for(tenants, {t.name: 1.0 for t in tenants}),
                duration_s=a.duration_s,
                warmup_s=a.warmup_s,
                seed=a.seed,
                prompt_format="tokens",
                drain_timeout_s=3.0,
                request_timeout_s=600.0,
                out_dir=str(out_dir),
                progress=a.progress,
            )
            calibration = calibrate(a, base, routers, capacity)
            cap = calibration["capacity_req_s"]
            print(
                f"calibration: {cap:.2f} requests/s per worker {calibration['output_tok_s']}", file=sys.stderr
            )
            if not cap > 0:
                print("bench-fairness: calibration served no tokens; nothing to measure", file=sys.stderr)
                return 1
            for load in a.load_levels:
                rates = level_rates(load, cap, a.light_share)
                specs = specs_for(tenants, rates)
                config = dataclasses.replace(base, tenants=specs)
                points, infos = asyncio.run(run_modes(config, routers, specs, a.progress))
                figures = [
                    fairness_figures(p, tenants, rates, a.warmup_s, a.duration_s, capacity) for p in points
                ]
                levels.append({"load": load, "rates": rates, "figures": figures, "config": config})
                level_points.append(points)
        except (RuntimeError, TimeoutError, OSError, grpc.RpcError) as exc:
            # a process that did not start, a port, a worker that stopped answering: say so, no traceback
            why = f"{type(exc).__name__}: {exc}"
            print(f"bench-fairness: the run could not be measured: {why}", file=sys.stderr)
            return 1
        finally:
            for proc in procs:
                proc.stop()
    return report(a, out_dir, calibration, levels, level_points, infos, time.monotonic() - started)


def report(a, out_dir: pathlib.Path, calibration: dict, levels, level_points, infos, elapsed_s: float) -> int:
    """Writes the per-level load-test reports and the fairness summary; the exit status."""
    command = ["python -m benchmarks.fairness", *sys.argv[1:]]
    for level, points in zip(levels, level_points):
        level_dir = out_dir / f"level-{level['load']:g}"
        level_dir.mkdir(exist_ok=True)
        rep = {
            "tool": "benchmarks.fairness",
            "format": 2,
            "created": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
            "command": command,
            "config": level["config"].to_json(),
            "seed": a.seed,
            "git": git_revision(),
            "machine": machine(),
            "targets": infos,
            "points": [p.to_json() for p in points],
        }
        write_json(rep, points, level_dir)
        plot_files = []
        try:
            from loadtest.plots import write_plots

            plot_files = write_plots(points, level_dir)
        except ImportError as exc:
            print(f"plots skipped: {exc}", file=sys.stderr)
        write_markdown(rep, level_dir, plot_files)
    failures = [
        f"load {level['load']:g}x: {why}"
        for level in levels
        for f in level["figures"]
        if f["mode"] == "vtc" and (why := verdict(f, a.tolerance, a.min_backlogged))
    ]
    summary = {
        "command": command,
        "created": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": machine(),
        "git": git_revision(),
        "calibration": calibration,
        "levels": [
            {
                "load": lv["load"],
                "rates": lv["rates"],
                "figures": [{k: v for k, v in f.items() if k != "gap_series"} for f in lv["figures"]],
            }
            for lv in levels
        ],
        "failures": failures,
        "elapsed_s": elapsed_s,
    }
    (out_dir / "fairness.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    md = markdown(levels)
    head = (
        f"Calibrated capacity: {calibration['capacity_req_s']:.2f} requests/s per worker "
        f"(closed loop x {calibration['concurrency']}).\n\n"
    )
    (out_dir / "fairness.md").write_text(head + md, encoding="utf-8")
    try:
        plot(levels, level_points, out_dir / "fairness.png")
    except ImportError as exc:
        print(f"plot skipped: {exc}", file=sys.stderr)
    print(head + md)
    print(f"report: {out_dir / 'fairness.md'} ({elapsed_s:.0f} s in all)", file=sys.stderr)
    for why in failures:
        print(f"bench-fairness: {why}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
