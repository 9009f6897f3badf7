"""Worker discovery from Ray: the router finds the worker actors that deploy/ray_launch.py started.

Contract
- input: a Ray address (`HOST:PORT` of the GCS, `auto`, or `ray://HOST:10001` through Ray Client;
  ignored when this process is already connected, as in `make serve`), the namespace and actor
  name prefix of the workers, optional static addresses (served as well).
- output: `discover()` -> the static addresses plus the address of every named worker actor that
  answers `address()`; the base `WorkerRegistry` health-checks them, adds new ones, drops gone
  ones, and keeps working on its own when Ray calls are slow (a round waits for the Ray lookup at
  most `call_timeout_s` + 1 s, then probes the workers it last found).
- state: per actor name the handle, the last address it gave and at most one pending `address()`
  call. Nothing durable: any number of routers can discover the same workers.
- cost per poll: one GCS call (list named actors) and one actor call per new or unhealthy worker
  only; healthy workers cost their gRPC health/load probes and nothing in Ray.
- failure modes: a worker that is restarting (its call does not answer within `call_timeout_s`)
  or dead (the call fails) is left out until it answers again, at its new port; one that announced
  a drain (NOT_SERVING) is kept while its actor is busy stopping, so its open streams finish. Ray
  calls run in a
  thread (`asyncio.to_thread`), never on the event loop. If the Ray head goes away, discovery
  keeps the last known workers until it answers again (the driver may exit after Ray's GCS
  reconnect timeout).
- proven by: tests/test_ray_cluster.py (discover 4, restart seen again, two routers).
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE, list_worker_names
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)
_CONNECT_ATTEMPTS = 4


class RayRegistry(WorkerRegistry):
    def __init__(
        self,
        ray_address: str,
        namespace: str = DEFAULT_NAMESPACE,
        name_prefix: str = DEFAULT_NAME_PREFIX,
        static: tuple[str, ...] = (),
        call_timeout_s: float = 0.5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._ray_address = ray_address
        self._namespace = namespace
        self._prefix = name_prefix
        self._static = list(static)
        self._call_timeout_s = call_timeout_s
        self._actors: dict = {}  # name -> ActorHandle
        self._addresses: dict[str, str] = {}
        self._pending: dict = {}  # name -> ObjectRef of an unanswered address() call
        self._connected_here = False
        self._ray = None  # the ray module, once connected (tests set a fake)
        self._lookup: asyncio.Future | None = None  # the Ray lookup in flight (a thread), at most one
        self._found: list[str] | None = None  # its last result (None: none yet)

    async def start(self) -> None:
        await asyncio.to_thread(self._connect)
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._lookup is not None:
            self._lookup.cancel()  # its thread ends on its own (Ray's timeouts)
        if self._connected_here:
            import ray

            await asyncio.to_thread(ray.shutdown)

    async def discover(self) -> list[str]:
        """The Ray lookup runs in a thread; a round waits for it at most `call_timeout_s` + 1 s
        (the first round: until it answers) and otherwise goes on with the last workers found, so
        a Ray call that blocks (the GCS unreachable) never holds up the health probes."""
        if self._lookup is None:
            unhealthy = {a for a, h in self._handles.items() if not h.healthy}
            draining = {a for a, h in self._handles.items() if h.draining}
            self._lookup = asyncio.ensure_future(asyncio.to_thread(self._find, unhealthy, draining))
        known = self._found or []
        try:
            async with asyncio.timeout(None if self._found is None else self._call_timeout_s + 1.0):
                found = await asyncio.shield(self._lookup)
        except TimeoutError:
            log.warning("Ray discovery is slow; probing the %d known worker(s) meanwhile", len(known))
            found = known
        except Exception as exc:  # noqa: BLE001 - Ray unreachable: keep serving the known workers
            self._lookup = None
            log.warning("Ray discovery failed (%s); keeping %d known worker(s)", exc, len(known))
            found = known
        else:
            self._lookup = None
            self._found = found
        return [*self._static, *(a for a in found if a not in self._static)]

    def _connect(self) -> None:
        import ray

        self._ray = ray
        if ray.is_initialized():
            return
        # Bounded retries: a Ray Client server can fail to start in time on a loaded head node.
        for attempt in range(1, _CONNECT_ATTEMPTS + 1):
            try:
                ray.init(
                    address=self._ray_address,
                    namespace=self._namespace,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
                break
            except (ConnectionError, RuntimeError) as exc:
                if attempt == _CONNECT_ATTEMPTS:
                    raise
                log.warning(
                    "connecting to Ray at %s failed (attempt %d of %d: %s); retrying",
                    self._ray_address,
                    attempt,
                    _CONNECT_ATTEMPTS,
                    exc,
                )
                ray.shutdown()
                time.sleep(2.0 * attempt)
        self._connected_here = True
        log.info("connected to Ray at %s (namespace %s)", self._ray_address, self._namespace)

    def _find(self, unhealthy: set[str], draining: frozenset[str] | set[str] = frozenset()) -> list[str]:
        ray = self._ray
        names = set(list_worker_names(self._namespace, self._prefix, ray))
        for name in set(self._actors) - names:
            log.info("worker actor %s is gone", name)
            self._actors.pop(name)
            self._addresses.pop(name, None)
            self._pending.pop(name, None)
        for name in names - set(self._actors):
            try:
                self._actors[name] = ray.get_actor(name, namespace=self._namespace)
            except ValueError:  # died between the listing and this lookup
                continue
        for name, actor in self._actors.items():
            known = self._addresses.get(name)
            if name not in self._pending and (known is None or known in unhealthy):
                self._pending[name] = actor.address.remote()
        if self._pending:
            refs = list(self._pending.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self._call_timeout_s)
            ready = set(ready)
            for name, ref in list(self._pending.items()):
                if ref not in ready:  # restarting (or busy): not routable until it answers
                    # ... unless it announced a drain: the actor answers nothing while its stop()
                    # runs, and dropping it here would cancel the streams its drain lets finish
                    if self._addresses.get(name) not in draining:
                        self._addresses.pop(name, None)
                    continue
                del self._pending[name]
                try:
                    address = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    log.info("worker actor %s did not answer: %s", name, type(exc).__name__)
                    self._addresses.pop(name, None)
                    continue
                if self._addresses.get(name) != address:
                    log.info("worker actor %s serves at %s", name, address)
                self._addresses[name] = address
        return [self._addresses[n] for n in sorted(self._addresses)]
