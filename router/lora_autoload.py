"""LoRA adapters loaded on demand (`--lora-autoload`), and the least recently used ones unloaded
to make room: vLLM's filesystem LoRA resolver and max_loras eviction, through the router.

Contract
- when: a Generate call (gRPC or the HTTP front) names a model this router does not serve, the
  name is a well-formed adapter name (common/adapter_names.py), and the router serves one base
  model. Otherwise the request is refused as before (unknown model). A name of adapter-name
  characters that is not canonical (`sql/`, `sql/.`, `sql//`, `x/../sql`: an empty, `.` or `..`
  segment, a trailing `/`) is refused INVALID_ARGUMENT naming the spelling to use, before any
  load: one directory is never loaded under two spellings.
- which: the tenant's `adapters` patterns (router/tenants.py) are checked before this module is
  asked (router/service.py `_autoload`: PERMISSION_DENIED); a load for a tenant that holds
  `max_autoloaded_adapters` adapters this router autoloaded for its requests (those still held
  by a worker, and its loads under way) is refused RESOURCE_EXHAUSTED naming the limit (retry-after
  1 s), before any load or eviction. An adapter counts for the tenant whose request started its
  load, until it is unloaded (to make room, by an admin) or an admin's load takes it over; a
  request waiting for a load under way, or naming a served adapter, starts none and counts
  nothing.
- what: `AdapterAdmin.load_core(name, path=name, base, remember=False)`: every healthy worker of
  the base model loads `<its --lora-dir>/<name>` (the worker checks the path lies inside its
  --lora-dir; workers without one refuse; one that holds the name already, loaded by another
  router, counts as serving it). The request then runs on it. Requests naming a name whose load
  is under way wait for that load (one load per name), each until its own deadline (then
  DEADLINE_EXCEEDED; the load goes on); loads of different names run one at a time (they
  compete for the same slots). The router claims the request against its tenant's rate and caps
  first (router/service.py `_autoload`): a tenant over them causes no load, and its requests
  waiting here count as open. A request whose deadline has passed starts no load.
- room: a worker that is full (RESOURCE_EXHAUSTED: --max-lora-adapters) makes the autoloader
  unload the least recently used adapter that it loaded itself and that no request in this
  router names (queued or running; one naming it while it is being unloaded waits to load it
  again); a worker still running one refuses the unload, and the next is tried. Stop condition:
  each round unloads a different adapter, so it ends when the load fits or no candidate is left:
  RESOURCE_EXHAUSTED (retry-after 1 s). Adapters loaded by an admin (`load_lora_adapter`,
  `--lora-modules`, also one an admin unloaded and loaded again through this router) or by
  another router (every worker held it already) are never unloaded by it. An unload that
  reached no worker (the one holding it does not answer) made no room: the next candidate goes,
  and the name stays a candidate while a worker reports it.
- failures: a load the workers refuse as the request's or the operator's fault (INVALID_ARGUMENT:
  no such directory, a bad adapter; FAILED_PRECONDITION: no --lora-dir) answers INVALID_ARGUMENT
  "model: unknown model ..." with the worker's reason, and the name is not tried again for
  `retry_s` (a bounded cache of the last MAX_FAILED names; forgotten as soon as the name is
  served): a client repeating a wrong name costs the workers one check per `retry_s` (a cached
  failure is answered before the tenant's limit). A worker's own failure (INTERNAL), no worker
  answering, or an admin's load or unload of that name under way: UNAVAILABLE, not cached.
- who: any tenant whose key is accepted (as vLLM's resolver), within its `adapters` and
  `max_autoloaded_adapters` (see "which"); the adapters come only from the
  operator's --lora-dir.
- not remembered: autoloaded adapters are not restored onto workers that lack them (a restarted
  or new worker gets one when a request names it and no healthy worker serves it), nor unloaded
  by `restore`, so several routers never undo each other's loads. Each router autoloads and
  evicts on its own, through the same workers: an adapter one router unloads to make room fails
  the requests another router has queued for it or sends it before its next probe of the workers
  reads the change; after that, the next request naming it loads it again.
- state: per router, in memory: when each autoloaded adapter was last named and the tenant it was
  loaded for, how many requests name each name now, the names being unloaded, the recent
  failures. Metrics: `llm_router_lora_autoloads_total{result}` (results as router/metrics.py, and
  `tenant_limit`, `bad_name`).
- proven by: tests/test_lora_autoload_e2e.py, tests/test_adapter_names.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict

import grpc

from common.adapter_names import NAME, spelling_problem
from router.errors import DeadlineExceeded, Overloaded, Unavailable, ValidationError
from router.lora_admin import AdapterAdmin, AdapterRefused

log = logging.getLogger(__name__)
MAX_FAILED = 1024  # names remembered as failed (oldest dropped first)
# the workers' refusals remembered as failures: the request's fault (a bad name, path or adapter), or
# the operator's (no --lora-dir); not a worker's own failure (INTERNAL) or one that did not answer
REMEMBERED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class Autoloader:
    def __init__(self, admin: AdapterAdmin, retry_s: float = 30.0, counter=None):
        self._admin = admin
        self._retry_s = retry_s
        self._counter = counter  # prometheus Counter labelled by result, or None
        self.last_used: dict[str, float] = {}  # autoloaded adapter -> when a request last named it
        self._users: Counter[str] = Counter()  # model name -> requests naming it in this router now
        self._loading: dict[str, asyncio.Task] = {}  # name -> its load under way
        self._evicting: set[str] = set()  # names being unloaded to make room (not served for new requests)
        self._failed: OrderedDict[str, tuple[float, str]] = OrderedDict()  # name -> (until, reason)
        # autoloaded adapter, or one whose load is under way -> the tenant whose request started it
        self._owner: dict[str, str] = {}
        self._one_at_a_time = asyncio.Lock()

    @contextlib.contextmanager
    def naming(self, model: str):
        """Held for the whole of a request that names `model`: an adapter named by a request in
        this router is not unloaded to make room."""
        if not model:
            yield
            return
        self._users[model] += 1
        if model in self.last_used:
            self.last_used[model] = time.monotonic()
        try:
            yield
        finally:
            self._users[model] -= 1
            if not self._users[model]:
                del self._users[model]

    def would_load(self, name: str, served: dict) -> bool:
        """A request naming `name` goes through `ensure`'s load path (see the contract). A name
        served after all (an admin's load, another router's) loses its cached failure here. A
        non-canonical spelling goes on to `ensure`, which refuses it by name."""
        if not name or not NAME.fullmatch(name) or len(self._admin.served_bases()) != 1:
            return False
        if name in served and name not in self._evicting:
            if self._failed:
                self._failed.pop(name, None)
            return False
        return True

    async def ensure(self, name: str, served: dict, deadline_s: float | None = None, tenant=None) -> bool:
        """Load adapter `name` if the request names one this router may autoload (see the
        contract); True when it was loaded (the caller reads the served models again). Raises
        the refusals the contract names; DEADLINE_EXCEEDED when the load outlasts `deadline_s`
        (time.monotonic(); the load itself goes on for the others). `tenant` (router/tenants.py
        Tenant, None: no limit): the request's, bounded by its max_autoloaded_adapters."""
        if not self.would_load(name, served):
            return False
        if problem := spelling_problem(name):
            self._count("bad_name")
            raise ValidationError("model", problem)
        failed = self._failed.get(name)
        if failed is not None and failed[0] > time.monotonic():
            self._count("cached_failure")
            raise ValidationError("model", failed[1])
        timeout = None if deadline_s is None else deadline_s - time.monotonic()
        if timeout is not None and timeout <= 0:  # no load for a request that cannot wait for it
            self._late(name)
        task = self._loading.get(name)
        if task is None:
            if tenant is not None:
                self._check_limit(tenant, name)
                self._owner[name] = tenant.name
            task = self._loading[name] = asyncio.get_running_loop().create_task(
                self._load(name, self._admin.served_bases()[0])
            )
            task.add_done_callback(self._done)
        try:
            async with asyncio.timeout(timeout):  # shielded: a caller that leaves does not cancel it
                await asyncio.shield(task)
        except TimeoutError:
            self._late(name)
        return True

    def _late(self, name: str) -> None:
        self._count("deadline")
        raise DeadlineExceeded(f"model {name!r}: its adapter was still loading at the request's deadline")

    def _check_limit(self, tenant, name: str) -> None:
        """Overloaded when `tenant` holds its max_autoloaded_adapters already (see the contract)."""
        limit = tenant.max_autoloaded_adapters
        if limit is None:
            return
        self._forget_gone()
        held = sorted(n for n, owner in self._owner.items() if owner == tenant.name)
        if len(held) < limit:
            return
        self._count("tenant_limit")
        shown = ", ".join(repr(n) for n in held[:8]) + (", ..." if len(held) > 8 else "")
        raise Overloaded(
            f"model {name!r}: tenant {tenant.name!r} holds {len(held)} adapter(s) loaded on demand for "
            f"its requests ({shown or 'none'}), its max_autoloaded_adapters ({limit}) in the tenants "
            "file; name one of those, or retry when one is unloaded",
            1000,
        )

    def _forget_gone(self) -> None:
        """Autoloaded adapters that are an admin's now (unloaded and loaded again through it) or
        that no worker holds any more (an admin or another router unloaded them, or the workers
        restarted): not ours to unload, and counted for no tenant."""
        admin = self._admin
        for gone in [n for n in self.last_used if n in admin.loaded or not admin.holds(n)]:
            del self.last_used[gone]
            if gone not in self._loading:
                self._owner.pop(gone, None)

    def _done(self, task: asyncio.Task) -> None:
        names = [n for n, t in self._loading.items() if t is task]
        self._loading = {n: t for n, t in self._loading.items() if t is not task}
        for name in names:  # failed, or not loaded by it (served meanwhile, another router's)
            if name not in self.last_used or task.cancelled() or task.exception() is not None:
                self._owner.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have left before it ended

    async def _load(self, name: str, base: str) -> None:
        async with self._one_at_a_time:
            if self._admin.serves(name):  # loaded meanwhile (an admin, or before the wait)
                return
            tried: set[str] = {name}
            while True:
                try:
                    _, fresh = await self._admin.load_core(name, name, base, remember=False)
                except AdapterRefused as refused:
                    if refused.worker_code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        victim = await self._evict(tried)
                        if victim is not None:
                            tried.add(victim)
                            continue
                        self._count("full")
                        raise Overloaded(
                            f"model {name!r}: every LoRA adapter slot of the workers holds an adapter "
                            "in use or loaded by an admin; retry later",
                            1000,
                        ) from None
                    if refused.worker_code is None:  # this router's: an admin's load or unload of it
                        self._count("unavailable")
                        raise Unavailable(
                            f"model {name!r}: an admin is loading or unloading this adapter now; retry"
                        ) from None
                    if refused.worker_code not in REMEMBERED:  # a worker failed, or did not answer
                        self._count("unavailable")
                        raise Unavailable(
                            f"model {name!r}: no worker could load its adapter now (one failed or did "
                            "not answer); retry later"
                        ) from None
                    self._count("failed")
                    self._remember_failure(name, refused.message)
                    raise ValidationError("model", self._failed[name][1]) from None
                except Unavailable:
                    self._count("unavailable")
                    raise
                self._failed.pop(name, None)
                if not fresh:  # every worker had it already: another router's, not ours to unload
                    return
                self.last_used[name] = time.monotonic()
                self._count("loaded")
                log.info("LoRA adapter %s loaded on demand (base %s)", name, base)
                return

    async def _evict(self, tried: set[str]) -> str | None:
        """Unload the least recently used autoloaded adapter that no request here names; the name
        unloaded, or None when none could be."""
        admin = self._admin
        self._forget_gone()
        for name in sorted(self.last_used, key=self.last_used.__getitem__):
            if name in tried or self._users[name]:
                continue
            tried.add(name)
            self._evicting.add(name)  # a request naming it meanwhile waits to load it again
            try:
                reply = await admin.unload_core(name)
            except (AdapterRefused, Unavailable) as exc:  # a worker still runs it, or is busy
                log.info("LoRA adapter %s not unloaded to make room: %s", name, exc)
                continue
            finally:
                self._evicting.discard(name)
            if not admin.holds(name):  # else an unreachable worker still has it: a candidate later
                self.last_used.pop(name, None)
                if name not in self._loading:  # a request naming it meanwhile loads it again
                    self._owner.pop(name, None)
            if not reply.num_workers:  # reached no worker: no room made
                continue
            self._count("evicted")
            log.info("LoRA adapter %s unloaded to make room (least recently used)", name)
            return name
        return None

    def _remember_failure(self, name: str, reason: str) -> None:
        served = self._admin.served_bases()
        message = (
            f"unknown model {name!r}; this router serves {served}, and loading it from the workers' "
            f"--lora-dir failed: {reason}"
        )
        self._failed[name] = (time.monotonic() + self._retry_s, message)
        self._failed.move_to_end(name)
        while len(self._failed) > MAX_FAILED:
            self._failed.popitem(last=False)

    def _count(self, result: str) -> None:
        if self._counter is not None:
            self._counter.labels(result).inc()
