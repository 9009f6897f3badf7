"""Local launcher: worker and router processes on loopback, without Ray (`benchmarks/`; `make serve`
runs deploy/local.py, with Ray).

Contract
- `LocalProcess(name, args)` starts `python <args>` in its own session (so a terminal Ctrl-C reaches
  only the launcher, which then stops children in order), forwards its output with a name prefix,
  and `wait_listening()` returns the address from its "... listening on HOST:PORT" line.
- `main()` (`python -m router.local`): N workers on ephemeral ports, then the router on
  127.0.0.1:50051; prints how to try it; on Ctrl-C / SIGTERM stops the router (drain) then the
  workers, and exits 0.
- failure modes: a child that exits before listening -> RuntimeError with its exit status.
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading

LISTENING = re.compile(r"listening on (\S+)")


class LocalProcess:
    def __init__(self, name: str, args: list[str], quiet: bool = False):
        self.name = name
        self._quiet = quiet
        self.popen = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      start_new_session=True)
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
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._pump.join(timeout=5)
        return self.popen.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.local", description="worker(s) + router on loopback")
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    p.add_argument("--kv-cache-mb", type=float, default=256)
    a = p.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    model = ["--model", a.model] if a.model else []
    workers = [LocalProcess(f"worker{i}", ["-m", "worker", "--port", "0", "--kv-cache-mb", str(a.kv_cache_mb),
                                           *model]) for i in range(a.num_workers)]
    router = None
    try:
        addresses = [w.wait_listening() for w in workers]
        router = LocalProcess("router", ["-m", "router", "--port", str(a.port), "--workers", ",".join(addresses),
                                         *model])
        target = router.wait_listening(60)
        print(f"\nReady: router on {target}, workers on {', '.join(addresses)}. Try:\n"
              f"  .venv/bin/python -m router.client --target {target} --chat 'What is the capital of France?'\n"
              f"  .venv/bin/python -m router.client --target {target} 'Once upon a time' --max-tokens 64\n"
              f"  grpcurl -plaintext {target} list      # server reflection\n"
              "Ctrl-C stops everything.\n", flush=True)
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
