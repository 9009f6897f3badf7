"""`python -m loadtest`: command line -> `RunConfig` -> run -> report files (see --help).

Contract
- `parse_args(argv) -> RunConfig`, the one place where flags, the tenants file and environment
  variables ($LLM_API_KEY, `key=env:VAR`) are read. Without `--target` the run starts a local
  server (`local`); two `--target`s compare.
- `main(argv) -> exit status`: 0 when the run finished and some measured request succeeded,
  1 when none did, 2 for a bad command line. Writes `report.md`, `report.json`,
  `requests.jsonl` and PNGs under `--out-dir` and prints the Markdown report.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import re
import sys
import time
import uuid
from datetime import datetime, timezone

import yaml

from loadtest.config import RunConfig, Target, TenantSpec, parse_kv
from loadtest.environment import git_revision, machine
from loadtest.grpc_client import GrpcClient, SendOptions
from loadtest.lengths import LengthDist
from loadtest.local_server import LocalServer
from loadtest.openai_client import OpenAIClient
from loadtest.report import write_json, write_markdown
from loadtest.runner import Clock
from loadtest.stats import parse_slo
from loadtest.sweep import run_sweep
from loadtest.workload import SyntheticText, load_prompts

EXAMPLES = """examples:
  python -m loadtest --target 127.0.0.1:50051 --rate 2 --duration-s 60 --output-len 32
  python -m loadtest --concurrencies 1,2,4,8 --num-requests 40 --slo ttft=500ms,tpot=50ms
  python -m loadtest --tenant name=a,key=ka,rate=2 --tenant name=b,key=kb,rate=0.5,weight=2
  python -m loadtest --target ours=local --target llamacpp=http://127.0.0.1:8080 --rate 1
"""


def redact(argv: list[str]) -> list[str]:
    """The command line for the report, API keys replaced by <set>."""
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--api-key":
            arg = "<set>"
        arg = re.sub(r"^--api-key=.*", "--api-key=<set>", arg)
        out.append(re.sub(r"(^|,)key=[^,]*", r"\1key=<set>", arg))
    return out


def _key(value: str) -> str:
    return os.environ.get(value[4:], "") if value.startswith("env:") else value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load-test a gRPC llm.v1 router or an OpenAI-compatible server.",
    )
    g = p.add_argument_group("targets")
    g.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[NAME=]ADDRESS",
        help="host:port (gRPC), http(s)://host:port (OpenAI /v1/completions), or "
        "local[:WORKER ARGS] (start a worker + router here); twice = comparison. "
        "Default: local",
    )
    g.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target (one you run)")
    g.add_argument("--tls-ca", default="", help="gRPC targets: connect over TLS, trusting this CA (PEM)")
    g.add_argument("--metrics-url", action="append", default=[], help="Prometheus URL per target, in order")
    g.add_argument("--local-workers", type=int, default=1, help="workers of a local server")
    g = p.add_argument_group("bounds")
    g.add_argument("--duration-s", type=float, default=None, help="measured seconds per point (default 30)")
    g.add_argument("--num-requests", type=int, default=None, help="measured requests per point")
    g.add_argument("--warmup-s", type=float, default=0.0, help="requests sent earlier are not counted")
    g.add_argument("--drain-timeout-s", type=float, default=120.0)
    g.add_argument("--request-timeout-s", type=float, default=300.0)
    g = p.add_argument_group("load")
    g.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "constant", "closed"),
        default=None,
        help="default: closed with --concurrency/--concurrencies, else poisson",
    )
    g.add_argument("--rate", type=float, default=1.0, help="requests/s (open loop)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier, 1 = Poisson")
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight (closed loop)")
    g.add_argument("--rates", default="", help="sweep: comma-separated rates")
    g.add_argument("--concurrencies", default="", help="sweep: comma-separated concurrencies")
    g.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap in flight at the client")
    g = p.add_argument_group("workload")
    g.add_argument(
        "--prompts", default="synthetic", help="synthetic | bundled | FILE (.jsonl 'prompt' or .txt)"
    )
    g.add_argument("--input-len", default="128", help="N, uniform:LO:HI, normal:MEAN:STD, file:PATH")
    g.add_argument("--output-len", default="16", help="same forms as --input-len")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a common system prompt")
    g.add_argument("--api-key", default=os.environ.get("LLM_API_KEY", ""), help="default: $LLM_API_KEY")
    g.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="K=V,...",
        help="a tenant: name, key (or key=env:VAR), weight, arrival, rate, burstiness, "
        "concurrency, prompts, input_len, output_len, prefix_len, priority; "
        "unset keys take the flags above",
    )
    g.add_argument("--tenants-file", default=None, help="YAML: 'tenants:' list with the --tenant keys")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model", default="", help="model name (OpenAI: default = the server's first)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let EOS end outputs early (default: fixed output lengths)",
    )
    g.add_argument("--prompt-format", choices=("text", "tokens"), default="text")
    g.add_argument(
        "--tokenizer", default="", help="GGUF file or HF dir for synthetic prompts (default: ours)"
    )
    g = p.add_argument_group("report")
    g.add_argument("--slo", default="", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms (also itl, e2e)")
    g.add_argument("--out-dir", default=None, help="default: loadtest-results/<UTC time>")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        closed = a.concurrency is not None or bool(a.concurrencies)
        base = TenantSpec(
            api_key=a.api_key,
            arrival=a.arrival or ("closed" if closed else "poisson"),
            rate_per_s=a.rate,
            burstiness=a.burstiness,
            concurrency=a.concurrency or 1,
            prompts=a.prompts,
            input_len=LengthDist.parse(a.input_len),
            output_len=LengthDist.parse(a.output_len),
            shared_prefix_len=a.shared_prefix_len,
        )
        entries = [parse_kv(text) for text in a.tenant]
        if a.tenants_file:
            doc = yaml.safe_load(pathlib.Path(a.tenants_file).read_text(encoding="utf-8")) or {}
            entries += [{k: str(v) for k, v in e.items()} for e in doc.get("tenants", [])]
        for e in entries:
            if "key" in e:
                e["key"] = _key(e["key"])
        tenants = tuple(TenantSpec.from_fields(e, base) for e in entries) or (base,)
        targets = [Target.parse(t, i, a.allow_remote) for i, t in enumerate(a.target or ["local"])]
        urls = a.metrics_url + [""] * len(targets)
        targets = [dataclasses.replace(t, metrics_url=url) for t, url in zip(targets, urls)]
        if a.rates and a.concurrencies:
            raise ValueError("sweep either --rates or --concurrencies")
        sweep = "rate" if a.rates else "concurrency" if a.concurrencies else ""
        values = a.rates or a.concurrencies
        duration_s = a.duration_s if a.duration_s is not None or a.num_requests is not None else 30.0
        out_dir = a.out_dir or f"loadtest-results/{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        return RunConfig(
            targets=tuple(targets),
            tenants=tenants,
            duration_s=duration_s,
            num_requests=a.num_requests,
            warmup_s=a.warmup_s,
            sweep=sweep,
            sweep_values=tuple(float(v) for v in values.split(",") if v),
            seed=a.seed,
            model=a.model,
            temperature=a.temperature,
            ignore_eos=a.ignore_eos,
            prompt_format=a.prompt_format,
            max_concurrency=a.max_concurrency,
            request_timeout_s=a.request_timeout_s,
            drain_timeout_s=a.drain_timeout_s,
            slo_s=tuple(parse_slo(a.slo).items()),
            tokenizer=a.tokenizer,
            out_dir=out_dir,
            plots=a.plots,
            progress=a.progress,
            local_num_workers=a.local_workers,
            tls_ca=a.tls_ca,
        )
    except (ValueError, OSError) as exc:
        p.error(str(exc))


def load_tokenizer(path: str):
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    source = pathlib.Path(path) if path else default_model_path()
    return Tokenizer.from_pretrained_dir(source) if source.is_dir() else Tokenizer.from_gguf(source)


async def _wait_ready(client, api_key: str, want_workers: int, timeout_s: float = 120.0) -> dict:
    """Server info from a local server, once its router sees all its workers."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await client.server_info(api_key)
        models = info.get("models") or []
        if models and all(m.get("num_workers", want_workers) >= want_workers for m in models):
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(f"target not ready within {timeout_s} s: {info}")
        await asyncio.sleep(0.2)


async def execute(config: RunConfig, run_id: str):
    """Starts local servers, connects, runs the sweep; returns (results, server info per target)."""
    needs_words = any(t.prompts == "synthetic" or t.shared_prefix_len for t in config.tenants)
    synthetic = SyntheticText(load_tokenizer(config.tokenizer)) if needs_words else None
    prompt_sets = {t.prompts: load_prompts(t.prompts) for t in config.tenants if t.prompts != "synthetic"}
    options = SendOptions(
        config.model,
        config.temperature,
        config.ignore_eos,
        config.prompt_format,
        config.request_timeout_s,
        config.tls_ca,
    )
    clock, servers, clients, infos = Clock(), [], {}, {}
    targets = []
    try:
        for target in config.targets:
            if target.local:
                server = LocalServer(config.tenants, target.local_args, config.local_num_workers)
                servers.append(server)
                target = dataclasses.replace(target, address=await asyncio.to_thread(server.start))
            targets.append(target)
            kind = OpenAIClient if target.api == "openai" else GrpcClient
            clients[target.name] = kind(target.address, options, clock.now_ns)
            key = config.tenants[0].api_key
            info = (
                await _wait_ready(clients[target.name], key, config.local_num_workers)
                if target.local
                else await clients[target.name].server_info(key)
            )
            infos[target.name] = {**dataclasses.asdict(target), "server_info": info}
        config = dataclasses.replace(config, targets=tuple(targets))
        results = await run_sweep(config, clients, clock, synthetic, prompt_sets, run_id)
    finally:
        for client in clients.values():
            await client.close()
        for server in servers:
            await asyncio.to_thread(server.stop)
    return results, infos


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    out_dir = pathlib.Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    created = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"
    mach, git = machine(), git_revision()
    results, infos = asyncio.run(execute(config, run_id))
    report = {
        "tool": "loadtest",
        "format": 1,
        "created": created,
        "run_id": run_id,
        "command": ["python -m loadtest", *redact(sys.argv[1:] if argv is None else argv)],
        "config": config.to_json(),
        "seed": config.seed,
        "git": git,
        "machine": mach,
        "targets": infos,
        "points": [r.to_json() for r in results],
    }
    plot_files = []
    if config.plots:
        try:
            from loadtest.plots import write_plots

            plot_files = write_plots(results, out_dir)
        except ImportError as exc:
            print(f"plots skipped: {exc}", file=sys.stderr)
    written = write_json(report, results, out_dir)
    md = write_markdown(report, out_dir, plot_files)
    print(md.read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in [md, *written, *plot_files]), file=sys.stderr)
    return 0 if any(r.summary.get("completed") for r in results) else 1
