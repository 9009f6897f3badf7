"""Local launcher: worker and router processes on loopback, without Ray (`benchmarks/`; `make serve`
runs deploy/local.py, with Ray).

Contract
- `LocalProcess(name, args)` starts `python <args>` in its own session (so a terminal Ctrl-C reaches
  only the launcher, which then stops children in order), forwards its output with a name prefix,
  and `wait_listening()` returns the address from its "... listening on HOST:PORT" line.
- `main()` (`python -m devtools.local`): N workers on ephemeral loopback ports, then the router
  (127.0.0.1:50051 unless --host/--port); prints how to try it; on Ctrl-C / SIGTERM stops the
  router (drain) then the workers, and exits 0. It takes every router flag but --workers and every
  engine flag (common.config_cli; --model is the workers' model and the router's tokenizer) and
  passes each on to the processes it concerns: the observability flags but --metrics-* go to the
  workers too. Children inherit the environment, so `LLM_*` variables reach them unchanged.
- failure modes: a child that exits before listening -> RuntimeError with its exit status.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from common.process import terminate
from router.models import entries_for

LISTENING = re.compile(r"listening on (\S+)")


class LocalProcess:
    def __init__(self, name: str, args: list[str], quiet: bool = False):
        self.name = name
        self._quiet = quiet
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._address: str | None = None
        self._listening = threading.Event()
        self._pump = threading.Thread(target=self._forward, name=f"{name}-output", daemon=True)
        self._pump.start()

    def _forward(self) -> None:
        for line in self.popen.stdout:
            found = LISTENING.search(line)
            if found and self._address is None:
                self._address = found.group(1)
                self._listening.set()
            if not self._quiet:
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()
        self._listening.set()  # exited: unblock waiters

    def wait_listening(self, timeout_s: float = 300.0) -> str:
        if not self._listening.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start listening within {timeout_s} s")
        if self._address is None:
            raise RuntimeError(f"{self.name} exited with status {self.popen.wait()} before listening")
        return self._address

    def stop(self, timeout_s: float = 40.0) -> int:
        terminate(self.popen, timeout_s)
        self._pump.join(timeout=5)
        return self.popen.returncode


@dataclass(frozen=True)
class Plan:
    num_workers: int
    worker_args: list[str]  # after `python`; the router's come once the workers listen
    router_args: list[str]  # after `python` and before `--workers ADDRESSES`


def plan(argv: list[str] | None = None) -> Plan:
    """The children's command lines from this command line (a bad value: usage error, exit 2)."""
    from common.config_cli import Flags, new_parser, option, parse_or_exit
    from router.config import RouterConfig
    from worker.config import EngineConfig  # imported here: `import devtools.local` stays worker-free

    @dataclass(frozen=True)
    class Stack:
        num_workers: int = field(default=1, metadata=option("worker processes"))

    p = new_parser("python -m devtools.local", "worker(s) + router on loopback, as plain processes")
    stack = Flags(p, Stack, title="stack")
    router_flags = Flags(p, RouterConfig, exclude=("workers", "model", "allow_download"), title="router")
    engine_flags = Flags(p, EngineConfig, title="engine (every worker)")
    # Both configs are built here so that a bad value is a usage error before anything starts.
    ns, num_workers, _, engine = parse_or_exit(
        p, argv, lambda ns: (ns, stack.build(ns).num_workers, router_flags.build(ns), engine_flags.build(ns))
    )
    telemetry = router_flags.argv(
        ns, only=lambda path: path[0] == "telemetry" and not path[-1].startswith("metrics_")
    )
    # Loopback, ephemeral gRPC and /metrics ports whatever LLM_HOST/LLM_PORT/LLM_METRICS_PORT say.
    worker = [
        "-m",
        "worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        *engine_flags.argv(ns),
        *telemetry,
    ]
    models = entries_for(engine.model, engine.served_model_name)
    router = [
        "-m",
        "router",
        *(["--model", ",".join(models)] if models else []),
        *(["--allow-download"] if engine.allow_download else []),
        *router_flags.argv(ns),
    ]
    return Plan(num_workers, worker, router)


def main(argv: list[str] | None = None) -> int:
    commands = plan(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workers = [LocalProcess(f"worker{i}", commands.worker_args) for i in range(commands.num_workers)]
    router = None
    try:
        addresses = [w.wait_listening() for w in workers]
        router = LocalProcess("router", [*commands.router_args, "--workers", ",".join(addresses)])
        target = router.wait_listening(60)
        print(
            f"\nReady: router on {target}, workers on {', '.join(addresses)}. Try:\n"
            f"  .venv/bin/python -m devtools.client --target {target} --chat "
            "'What is the capital of Germany?'\n"
            f"  .venv/bin/python -m devtools.client --target {target} 'Once upon a time' --max-tokens 64\n"
            f"  grpcurl -plaintext {target} list      # server reflection\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        while not stop.wait(0.5):
            if any(proc.popen.poll() is not None for proc in [*workers, router]):
                print("a child process exited; stopping", file=sys.stderr)
                break
    finally:
        status = router.stop() if router else 0
        statuses = [w.stop() for w in workers]
        print(f"stopped (router {status}, workers {statuses})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
