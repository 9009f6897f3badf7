"""LoRA adapters loaded and unloaded at run time through the router: `Generation.LoadLoraAdapter` /
`UnloadLoraAdapter` (gRPC) and POST /v1/load_lora_adapter, /v1/unload_lora_adapter (HTTP, vLLM's
bodies; router/openai/app.py).

Contract
- who: a tenant with `admin: true` in the tenants file; without a tenants file, loopback clients
  only. Anyone else: PERMISSION_DENIED. The workers must run with --lora-dir (the adapter's path
  must lie inside it: the router forwards the path, the worker checks it).
- load(name, path, base_model): `name` as the workers take it (common/adapter_names.py: canonical,
  so `sql/` or `x/../sql` is INVALID_ARGUMENT naming the spelling to use, never a second adapter) and
  not a model id this router serves already, `path` at most MAX_PATH characters; `base_model` a
  served base model (optional when one is served). One load or unload per name at a time (else
  FAILED_PRECONDITION). Every healthy worker of that base model gets `Worker.LoadAdapter` at once,
  each call bounded by `call_timeout_s`. All succeed: the adapter is remembered and the workers'
  info updated together (routable as soon as the call returns). One fails: every worker asked
  unloads it again (one may have loaded it after its call timed out), except those that held the
  name already (ALREADY_EXISTS: another router's load), and the call fails with that
  worker's reason: INVALID_ARGUMENT (name, path or adapter), FAILED_PRECONDITION (no --lora-dir
  there, or the worker is full), INTERNAL (the worker's own failure), UNAVAILABLE (no healthy
  worker of the base, or one did not answer).
- unload(name): every healthy worker that reports it gets `Worker.UnloadAdapter` (NOT_FOUND there
  counts as done); then it is forgotten, and for an adapter loaded through this router the
  workers that were unhealthy are remembered: they drop it when they answer again (restore). A
  worker still running requests with it refuses: FAILED_PRECONDITION, and it stays served (retry
  when they end); a healthy worker that does not answer fails the unload (UNAVAILABLE). Unknown:
  NOT_FOUND.
- restore: when the registry reads a worker's info (a worker that joined, or came back after a
  restart or a hang), each remembered adapter of its base model it lacks is loaded onto it, and
  each adapter unloaded through this router while that worker did not answer is unloaded if it
  still has it (not a later load of the name by another router, unless that came before this
  router read the worker again): one attempt per read, a failure logged (a failed load: that
  worker does not serve it; a failed unload: it still does). After a load, the healthy workers the load
  left out (joined meanwhile, or their circuit open) get the same treatment at once. Adapters
  loaded on demand (router/lora_autoload.py, `remember=False`) are neither restored nor unloaded.
- state: the adapters loaded through this router, name -> (base model, path), and the names
  unloaded through it -> the workers that have not answered the unload yet (forgotten when one
  leaves the registry); the names with an operation in progress. Not persisted: a
  restarted router forgets them (the workers keep theirs); with several routers, the one that
  loaded an adapter is the one that restores it.
- proven by: tests/test_lora_runtime_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from common.adapter_names import name_problem
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import worker_pb2
from router.errors import PermissionDenied, RouterError, Unavailable, ValidationError
from router.models import ModelTable
from router.registry import WorkerHandle, WorkerRegistry
from router.tenants import TenantsFile, is_loopback_peer

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 120.0  # one worker's load: reading and checking the adapter's files
MAX_PATH = 4096


class AdapterRefused(RouterError):
    """A worker's refusal of a load or unload, with the status the router answers."""

    def __init__(self, code: grpc.StatusCode, message: str, worker_code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code
        self.worker_code = worker_code  # the worker's own status (RESOURCE_EXHAUSTED: it is full)


# the worker's status -> the router's (worker/server.py ADAPTER_CODES)
CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: grpc.StatusCode.INVALID_ARGUMENT,  # the name is loaded there already
    grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


def _exists(result) -> bool:
    """A worker's load refused because it holds that name already."""
    return isinstance(result, AdapterRefused) and result.worker_code == grpc.StatusCode.ALREADY_EXISTS


def _definite(result) -> bool:
    """A worker's answer that it did not load the adapter (a refusal it decided); not a timeout or
    a lost call, after which it may still load it."""
    return isinstance(result, AdapterRefused) and result.worker_code in DEFINITE


async def _value(value):
    return value


DEFINITE = {  # a worker's refusals that leave it without the adapter (not INTERNAL: it failed midway)
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True)
class Loaded:
    base: str
    path: str


class AdapterAdmin:
    def __init__(
        self,
        registry: WorkerRegistry,
        models: ModelTable,
        tenants: TenantsFile,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ):
        self._registry = registry
        self._models = models
        self._tenants = tenants
        self._timeout = call_timeout_s
        self.loaded: dict[str, Loaded] = {}  # loaded through this router: restored where missing
        # unloaded through it -> the workers that did not answer the unload: unloaded when they do
        self.dropped: dict[str, set[str]] = {}
        self._busy: set[str] = set()  # names with a load or unload in progress
        self._restoring: set[tuple[str, str]] = set()  # (worker address, name) being restored
        self._tasks: set[asyncio.Task] = set()
        registry.on_info = self.restore

    def served_bases(self) -> list[str]:
        return self._models.ids()

    def serves(self, name: str) -> bool:
        """A healthy worker serves model `name` (a base model or an adapter)."""
        return name in self._registry.models()

    def holds(self, name: str) -> bool:
        """Some worker, healthy or not, reports adapter `name`."""
        return any(h.info is not None and name in h.info.adapters for h in self._registry.all())

    def _authorize(self, context) -> None:
        tenants = self._tenants.current
        tenant = tenants.authenticate(context.invocation_metadata() or (), context.peer())
        allowed = tenant.admin if tenants.require_key else is_loopback_peer(context.peer())
        if not allowed:
            raise PermissionDenied(
                "loading LoRA adapters needs an admin tenant (admin: true in the tenants file; "
                "without one, a loopback client)"
            )

    @contextlib.contextmanager
    def _claim(self, name: str):
        if name in self._busy or any(n == name for _, n in self._restoring):
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"adapter {name!r}: another load or unload is in progress",
            )
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    async def load(self, request: pb.LoraAdapterRequest, context) -> pb.LoraAdapterReply:
        self._authorize(context)
        name, path = request.name, request.path
        if problem := name_problem(name):
            raise ValidationError("name", problem)
        if not path or len(path) > MAX_PATH:
            raise ValidationError(
                "path",
                f"required: a PEFT adapter directory inside the workers' --lora-dir (<= {MAX_PATH} chars)",
            )
        bases = self._models.ids()
        if name in bases or name in self._registry.models():
            raise ValidationError("name", f"{name!r} is served already (unload it first)")
        base = request.base_model or (bases[0] if len(bases) == 1 else "")
        if base not in bases:
            wanted = "not a served" if request.base_model else "required: this router serves several"
            raise ValidationError("base_model", f"{wanted} base model; served: {bases}")
        return (await self.load_core(name, path, base))[0]

    async def load_core(
        self, name: str, path: str, base: str, *, remember: bool = True
    ) -> tuple[pb.LoraAdapterReply, int]:
        """`load` after its checks; the reply and how many workers this call loaded it on.
        `remember=False` (the autoloader, router/lora_autoload.py): the adapter is not restored
        onto workers that lack it later, and a worker that has it already (ALREADY_EXISTS: another
        router loaded it meanwhile) counts as serving it."""
        with self._claim(name):
            workers = [h for h in self._registry.healthy(base) if h.info.model == base]
            if not workers:
                raise Unavailable(f"no healthy worker serves base model {base!r}")
            message = worker_pb2.LoadAdapterRequest(name=name, path=path)
            try:
                results = await asyncio.gather(*(self._call(h, h.stub.LoadAdapter, message) for h in workers))
            except asyncio.CancelledError:  # the client left: what loaded is unloaded again
                await asyncio.shield(self._unload_from(workers, name))
                raise
            # A worker that had it already keeps it: not loaded by this call (another router's).
            had = [_exists(r) for r in results]
            failed = [
                r for r, old in zip(results, had) if isinstance(r, AdapterRefused) and (remember or not old)
            ]
            if failed:  # unloaded where it loaded, or may have (no answer: it may load after the timeout)
                await self._unload_from([h for h, r in zip(workers, results) if not _definite(r)], name)
                raise failed[0]
            infos = results
            if any(had):  # one that had it: its info lists it now
                infos = await asyncio.gather(
                    *(self._info(h) if old else _value(r) for h, r, old in zip(workers, results, had))
                )
            for h, info in zip(workers, infos):
                if info is not None:
                    h.info = info  # routable at once, on all of them together
            if remember:
                self.loaded[name] = Loaded(base, path)
            self.dropped.pop(name, None)  # not unloaded from the workers by `restore` any more
        self._sweep(workers)  # workers that joined during the load, or were left out (circuit open)
        fresh = len(workers) - sum(had)
        log.info("LoRA adapter %s (base %s) loaded on %d worker(s) from %s", name, base, fresh, path)
        return pb.LoraAdapterReply(name=name, base_model=base, num_workers=len(workers)), fresh

    async def unload(self, request: pb.LoraAdapterRequest, context) -> pb.LoraAdapterReply:
        self._authorize(context)
        return await self.unload_core(request.name)

    async def unload_core(self, name: str) -> pb.LoraAdapterReply:
        """`unload` after its check (also the autoloader's eviction)."""
        with self._claim(name):
            having = [h for h in self._registry.all() if h.info is not None and name in h.info.adapters]
            if not having and name not in self.loaded:
                raise AdapterRefused(grpc.StatusCode.NOT_FOUND, f"adapter {name[:128]!r} is not loaded")
            reachable = [h for h in having if h.healthy]
            await self._unload_from(reachable, name, strict=True)
            known = self.loaded.pop(name, None)
            stale = {h.address for h in having if not h.healthy}
            if known is not None and stale:  # loaded through this router: they drop it when they answer
                self.dropped[name] = stale
        self._sweep(reachable)
        base = known.base if known else having[0].info.model
        log.info("LoRA adapter %s unloaded from %d worker(s)", name, len(reachable))
        return pb.LoraAdapterReply(name=name, base_model=base, num_workers=len(reachable))

    async def _unload_from(self, workers: list[WorkerHandle], name: str, strict: bool = False) -> None:
        """Worker.UnloadAdapter on each (NOT_FOUND there: done). `strict`: the first refusal is
        raised; else refusals are logged, and the name is left for `restore` to unload later."""
        message = worker_pb2.UnloadAdapterRequest(name=name)
        results = await asyncio.gather(*(self._call(h, h.stub.UnloadAdapter, message) for h in workers))
        for h, result in zip(workers, results):
            if not isinstance(result, AdapterRefused):
                h.info = result
        refused = [
            r for r in results if isinstance(r, AdapterRefused) and r.code != grpc.StatusCode.NOT_FOUND
        ]
        if strict and refused:
            raise refused[0]

    def _sweep(self, done: list[WorkerHandle]) -> None:
        """`restore` for the healthy workers an operation did not reach (skipped as busy meanwhile);
        an unhealthy one is restored when the registry reads it as it comes back (a call to it now
        would hold the name busy until it timed out, and fail)."""
        for h in self._registry.all():
            if h.info is not None and h.healthy and h not in done:
                self.restore(h)

    async def _call(self, h: WorkerHandle, method, message) -> worker_pb2.WorkerInfo | AdapterRefused:
        """One worker's load or unload: its new info, or its refusal."""
        try:
            return await method(message, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            code = CODES.get(exc.code(), grpc.StatusCode.UNAVAILABLE)
            details = (exc.details() or "")[:2000]
            log.warning("worker %s: LoRA adapter %s: %s", h.address, message.name[:128], details)
            return AdapterRefused(code, f"a worker refused: {details}", worker_code=exc.code())

    async def _info(self, h: WorkerHandle) -> worker_pb2.WorkerInfo | None:
        """The worker's info now; None if it does not answer (the registry reads it at its next probe)."""
        try:
            return await h.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s: info after a LoRA load: %s", h.address, (exc.details() or "")[:200])
            return None

    def restore(self, h: WorkerHandle) -> None:
        """Registry hook after `h.info` was read: the adapters loaded through this router that it
        lacks are loaded onto it, those unloaded through it while it did not answer are unloaded (one
        attempt per read; names with a load or unload in progress are left alone). Not for a
        worker the router refuses: it is not routed to, and its info is read at every probe."""
        if h.refused:
            return
        present = {w.address for w in self._registry.all()}
        for name, missed in list(self.dropped.items()):  # a worker gone from the registry: forgotten
            for address in missed - present:
                self._unloaded_on(name, address)
        for name in [*self.loaded, *self.dropped]:
            known, has = self.loaded.get(name), name in h.info.adapters
            wanted = known is not None and known.base == h.info.model and not has
            # only where it was when unloaded: another router may load the name later
            unwanted = known is None and has and h.address in self.dropped.get(name, ())
            if known is None and not has:
                self._unloaded_on(name, h.address)
            key = (h.address, name)
            if (wanted or unwanted) and name not in self._busy and key not in self._restoring:
                self._restoring.add(key)
                task = asyncio.get_running_loop().create_task(self._restore(h, name, known))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _unloaded_on(self, name: str, address: str) -> None:
        """An unload through this router reached the worker at `address` at last."""
        left = self.dropped.get(name)
        if left is not None:
            left.discard(address)
            if not left:
                del self.dropped[name]

    async def _restore(self, h: WorkerHandle, name: str, known: Loaded | None) -> None:
        try:
            if known is None:
                await self._unload_from([h], name)
                if name not in h.info.adapters:
                    self._unloaded_on(name, h.address)
                return
            result = await self._call(
                h, h.stub.LoadAdapter, worker_pb2.LoadAdapterRequest(name=name, path=known.path)
            )
            if not isinstance(result, AdapterRefused):
                h.info = result
                log.info("LoRA adapter %s loaded again on worker %s", name, h.address)
        finally:
            self._restoring.discard((h.address, name))
