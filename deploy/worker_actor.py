"""One worker as a Ray actor (started by deploy/ray_launch.py `launch_workers`): the plain worker
gRPC server (`worker.server.serve`) on a thread of the actor's process, with its own event loop
(Ray owns the main thread).

Contract
- `WorkerActor(engine, host, drain_grace_s, ready_timeout_s, tls, server_options)`: builds its
  `WorkerServerConfig` here, on the node (`LaunchConfig.worker_values`; host NODE_IP = this node's
  IP; TLS paths need only exist on the nodes), starts serving and returns once it listens.
  `address()` -> "host:port" where it serves (a restarted actor serves on a new port, which routers
  learn from here), `pid()`, `node_id()`, `stop()` drains in-flight streams (`drain_grace_s`) and
  stops the server and the engine.
- state: the server thread, its loop and stop event, the port.
- failure modes: not serving within `ready_timeout_s` -> TimeoutError; a server that fails to start
  (bad model path, cannot bind) -> RuntimeError from the constructor (final: Ray does not restart
  failed constructors); a server that dies under a live actor ends the process (exit 1) so that
  Ray restarts it. Ray unpickles this class by module name in the actor processes: the repo must
  be importable there (ray_launch.ray_process_env, deploy/Dockerfile).
- proven by: tests/test_ray_cluster.py (restart, discovery), tests/test_tls.py (an actor serving
  mutual TLS, /metrics over HTTPS), tests/test_ray_serve.py.
Only the actor process imports torch (worker.server, lazily).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from common.config_cli import construct
from common.logs import setup_logging
from common.net import bind_address
from deploy.launch_config import NODE_IP, LaunchConfig
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

log = logging.getLogger(__name__)


class WorkerActor:
    """One worker: the gRPC server on its own thread and event loop (Ray owns the main thread).
    `server_options`: further `WorkerServerConfig` fields (see `LaunchConfig`)."""

    def __init__(
        self,
        engine: EngineConfig,
        host: str = "127.0.0.1",
        drain_grace_s: float = WorkerServerConfig.drain_grace_s,
        ready_timeout_s: float = 600.0,
        tls: tuple[str, str, str | None] | None = None,
        server_options: Mapping[str, Any] | None = None,
    ):
        launch = LaunchConfig(
            engine=engine,
            host=host,
            drain_grace_s=drain_grace_s,
            tls=tls,
            server_options=dict(server_options or {}),
        )
        if host == NODE_IP:
            import ray

            host = ray.util.get_node_ip_address()
        self._config: WorkerServerConfig = construct(WorkerServerConfig, launch.worker_values(host))
        setup_logging("worker", self._config.telemetry.log_format)
        self._port: int | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(ready_timeout_s):
            raise TimeoutError(f"worker did not start serving within {ready_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"worker failed to start: {self._error!r}") from self._error

    def _run(self) -> None:
        from worker.server import serve

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await serve(self._config, stop=self._stop, on_listening=self._on_listening)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - SystemExit too (cannot bind): report it
            self._error = exc
            log.exception("worker server failed")
        finally:
            started = self._ready.is_set()
            self._ready.set()
        if started and not self._stopping:
            # The server died under a live actor: end the process so that Ray restarts it.
            os._exit(1)

    def _on_listening(self, port: int) -> None:
        self._port = port
        self._ready.set()

    def address(self) -> str:
        return bind_address(self._config.host, self._port)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        """Drains in-flight streams (`drain_grace_s`), then stops the server and the engine."""
        self._stopping = True
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self._config.drain_announce_s + self._config.drain_grace_s + 15)
