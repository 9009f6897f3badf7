"""A local server for targets named `local` (`make loadtest` without a target): worker(s) and a
router on loopback ephemeral ports, started before the run and stopped after it.

Contract
- `LocalServer(tenants, worker_args, num_workers)`; `start() -> router address`; `stop()`.
- When the tenants carry API keys, the router gets a tenants file with their sha256 digests and
  weights, so the same keys authenticate; without keys it serves the keyless default tenant.
- failure modes: ValueError when only some tenants have keys (the router needs all or none);
  RuntimeError / TimeoutError from `devtools.local.LocalProcess` when a process fails to start.
  `stop()` always stops every process it started (router first, so it drains).
"""

from __future__ import annotations

import hashlib
import pathlib
import tempfile

import yaml

from devtools.local import LocalProcess
from loadtest.config import TenantSpec


def tenants_yaml(tenants: tuple[TenantSpec, ...]) -> str | None:
    keyed = [t for t in tenants if t.api_key]
    if not keyed:
        return None
    if len(keyed) != len(tenants):
        raise ValueError("a local server needs an API key for every tenant, or for none")
    return yaml.safe_dump(
        {
            "tenants": [
                {
                    "name": t.name,
                    "key_sha256": hashlib.sha256(t.api_key.encode()).hexdigest(),
                    "weight": t.weight,
                }
                for t in tenants
            ]
        },
        sort_keys=False,
    )


class LocalServer:
    def __init__(
        self, tenants: tuple[TenantSpec, ...], worker_args: tuple[str, ...] = (), num_workers: int = 1
    ):
        self._tenants_text = tenants_yaml(tenants)
        self._worker_args = worker_args
        self._num_workers = num_workers
        self._procs: list[LocalProcess] = []
        self._dir = tempfile.TemporaryDirectory(prefix="loadtest-")
        self.worker_addresses: list[str] = []

    def start(self) -> str:
        workers = [
            LocalProcess(f"worker{i}", ["-m", "worker", "--port", "0", *self._worker_args], quiet=True)
            for i in range(self._num_workers)
        ]
        self._procs.extend(workers)
        self.worker_addresses = [w.wait_listening() for w in workers]
        args = [
            "-m",
            "router",
            "--port",
            "0",
            "--workers",
            ",".join(self.worker_addresses),
            "--health-poll-s",
            "0.2",
        ]
        if self._tenants_text is not None:
            path = pathlib.Path(self._dir.name) / "tenants.yaml"
            path.write_text(self._tenants_text, encoding="utf-8")
            args += ["--tenants", str(path)]
        router = LocalProcess("router", args, quiet=True)
        self._procs.insert(0, router)
        return router.wait_listening(120)

    def stop(self) -> None:
        for proc in self._procs:
            proc.stop()
        self._procs.clear()
        self._dir.cleanup()
