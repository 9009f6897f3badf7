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
  calls run in a thread (`asyncio.to_thread`), never on the event loop. If the Ray head goes away,
  discovery keeps the last known workers until it answers again. A router that connected itself
  (`ray://`, the KubeRay router) reconnects once its connection is gone: Ray Client gives up after
  its reconnect grace period (`RAY_CLIENT_RECONNECT_GRACE_PERIOD`, 30 s; from then on
  `ray.util.client.ray.is_connected()` is False and every call raises `ConnectionError`, "Client
  is shutting down." or "Request can't be sent because the Ray client has already been
  disconnected"), or calls failed with `ConnectionError` `_FAILURES_BEFORE_RECONNECT` rounds in a
  row. Then the lookup thread makes no other Ray call (after a give-up a listing would
  auto-`ray.init()` a local Ray in the router's process) and tries `ray.shutdown()` + one
  `ray.init()` (bounded by Ray Client's connection timeout, ~30 s), at most one attempt per round,
  `_RECONNECT_FIRST_S` apart, doubling to `_RECONNECT_MAX_S`; each attempt is logged once. After
  reconnecting it forgets the old connection's actor handles and pending calls and looks every
  actor up again (relaunched workers are found; workers whose address still probes healthy are
  kept without a call). A router that did not connect itself (Ray initialised in-process, `make
  serve`) never shuts Ray down. A driver on a GCS address (`HOST:PORT`) is ended by Ray itself
  after the GCS reconnect timeout (`gcs_rpc_server_reconnect_timeout_s`, 60 s: "Failed to connect
  to GCS within 60 seconds ... The program will terminate."); its supervisor restarts it.
- proven by: tests/test_ray_cluster.py (discover 4, restart seen again, two routers; with
  --runslow: a Ray Client router sees the workers relaunched after a head restart),
  tests/test_ray_reconnect.py (reconnect, backoff, stale handles, in-process Ray left alone).
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.ray_names import DEFAULT_NAME_PREFIX, DEFAULT_NAMESPACE, list_worker_names
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)
_CONNECT_ATTEMPTS = 4
# A lost connection is retried every _RECONNECT_FIRST_S, doubling up to _RECONNECT_MAX_S: a head
# that stays down costs one connection attempt (and one log line) per 30 s, not one per poll.
_RECONNECT_FIRST_S = 1.0
_RECONNECT_MAX_S = 30.0
# Rounds in a row whose Ray calls failed with ConnectionError before the connection counts as gone
# even though Ray still reports it connected (the state check below is the usual signal).
_FAILURES_BEFORE_RECONNECT = 3


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
        self._through_client = False  # connected through Ray Client (ray://)
        self._ray = None  # the ray module, once connected (tests set a fake)
        self._clock = time.monotonic  # tests set a fake
        self._failures = 0  # lookup rounds in a row that failed with ConnectionError
        self._reconnect_attempts = 0  # failed reconnects since the connection was lost
        self._reconnect_at = 0.0  # `_clock` time before which no reconnect is tried
        self._stopping = False
        self._slow_logged = False  # "discovery is slow" logged for the lookup in flight
        self._lookup: asyncio.Future | None = None  # the Ray lookup in flight (a thread), at most one
        self._found: list[str] | None = None  # its last result (None: none yet)

    async def start(self) -> None:
        await asyncio.to_thread(self._connect)
        await super().start()

    async def stop(self) -> None:
        self._stopping = True  # a lookup thread still running starts no reconnect
        await super().stop()
        if self._lookup is not None:
            self._lookup.cancel()  # its thread ends on its own (Ray's timeouts)
        if self._connected_here:
            await asyncio.to_thread(self._ray.shutdown)

    async def discover(self) -> list[str]:
        """The Ray lookup runs in a thread; a round waits for it at most `call_timeout_s` + 1 s
        (the first round: until it answers) and otherwise goes on with the last workers found, so
        a Ray call that blocks (the GCS unreachable) never holds up the health probes."""
        if self._lookup is None:
            unhealthy = {a for a, h in self._handles.items() if not h.healthy}
            draining = {a for a, h in self._handles.items() if h.draining}
            self._lookup = asyncio.ensure_future(asyncio.to_thread(self._look_up, unhealthy, draining))
        known = self._found or []
        try:
            async with asyncio.timeout(None if self._found is None else self._call_timeout_s + 1.0):
                found = await asyncio.shield(self._lookup)
        except TimeoutError:
            if not self._slow_logged:  # once per lookup: a blocked one spans many rounds
                self._slow_logged = True
                log.warning("Ray discovery is slow; probing the %d known worker(s) meanwhile", len(known))
            found = known
        except Exception as exc:  # noqa: BLE001 - Ray unreachable: keep serving the known workers
            self._lookup, self._slow_logged = None, False
            log.warning("Ray discovery failed (%s); keeping %d known worker(s)", exc, len(known))
            found = known
        else:
            self._lookup, self._slow_logged = None, False
            self._found = found
        return [*self._static, *(a for a in found if a not in self._static)]

    def _connect(self, attempts: int = _CONNECT_ATTEMPTS) -> None:
        import ray

        self._ray = ray
        if ray.is_initialized():
            return
        # Bounded retries: a Ray Client server can fail to start in time on a loaded head node.
        for attempt in range(1, attempts + 1):
            try:
                ray.init(
                    address=self._ray_address,
                    namespace=self._namespace,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
                break
            except (ConnectionError, RuntimeError) as exc:
                if attempt == attempts:
                    raise
                log.warning(
                    "connecting to Ray at %s failed (attempt %d of %d: %s); retrying",
                    self._ray_address,
                    attempt,
                    attempts,
                    exc,
                )
                ray.shutdown()
                time.sleep(2.0 * attempt)
        self._connected_here = True
        self._through_client = ray.util.client.ray.is_connected()
        log.info("connected to Ray at %s (namespace %s)", self._ray_address, self._namespace)

    def _look_up(self, unhealthy: set[str], draining: set[str]) -> list[str]:
        """One discovery round, in the lookup thread: reconnects first if this process's own Ray
        connection is gone (see the module docstring), else `_find`."""
        if self._connected_here and self._connection_lost() and not self._reconnect():
            # No Ray call while disconnected: keep serving the workers found last.
            return [self._addresses[n] for n in sorted(self._addresses)]
        try:
            found = self._find(unhealthy, draining)
        except ConnectionError:
            self._failures += 1
            raise
        self._failures = 0
        return found

    def _connection_lost(self) -> bool:
        ray = self._ray
        if self._failures >= _FAILURES_BEFORE_RECONNECT:
            return True
        if self._through_client:  # False once Ray Client gave up; a local check, no call
            return not ray.util.client.ray.is_connected()
        return not ray.is_initialized()

    def _reconnect(self) -> bool:
        """One attempt to connect again, if its backoff has passed; True once connected."""
        if self._stopping or self._clock() < self._reconnect_at:
            return False
        attempt = self._reconnect_attempts + 1
        try:
            self._ray.shutdown()  # frees the dead client; init refuses to run beside it
            self._connect(attempts=1)  # this round's only attempt: rounds are the retries
        except Exception as exc:  # noqa: BLE001 - any failure to connect: retry after the backoff
            self._reconnect_attempts = attempt
            delay = min(_RECONNECT_MAX_S, _RECONNECT_FIRST_S * 2 ** (attempt - 1))
            self._reconnect_at = self._clock() + delay
            log.warning(
                "Ray connection to %s lost; reconnect attempt %d failed (%s); keeping %d known "
                "worker(s), next attempt in %.0f s",
                self._ray_address,
                attempt,
                exc,
                len(self._addresses),
                delay,
            )
            return False
        log.warning("Ray connection to %s lost; reconnected (attempt %d)", self._ray_address, attempt)
        self._reconnect_attempts, self._reconnect_at, self._failures = 0, 0.0, 0
        # The old connection's actor handles and pending calls are dead: every actor is looked up
        # again. The addresses stay: a worker still probing healthy needs no call, and a relaunched
        # one failed its probes, so it is asked for its new address.
        self._actors.clear()
        self._pending.clear()
        return True

    def _find(self, unhealthy: set[str], draining: frozenset[str] | set[str] = frozenset()) -> list[str]:
        ray = self._ray
        names = set(list_worker_names(self._namespace, self._prefix, ray))
        for name in (set(self._actors) | set(self._addresses)) - names:  # handles dropped on reconnect
            log.info("worker actor %s is gone", name)
            self._actors.pop(name, None)
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
