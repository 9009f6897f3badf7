"""Structured output's grammar compiles, off the router's process: a wall-clock budget, a cache, and
a share of the compile capacity per tenant.

Why: llguidance can take minutes on a small schema (a 600-byte `json_schema` whose `allOf` holds 14
string patterns `.*aN.*`: ~3.5x per extra pattern, then an error), it cannot be interrupted inside
a compile, and its own limits (`llguidance.LLParserLimits`: lexer fuel, lexer states, grammar size)
do not bound that path (measured: 12 patterns take the same 0.6 s with a fuel of 10,000). The one
bound that holds is a process that is killed.

Contract
- input: `GrammarCompiler.compile(task, tenant)`, `task` a canonical, hashable compile input (what
  `common.structured.compile_task` takes): `("format", kind, value)`, the request's format as
  router/validation.py carries it (`ValidRequest.grammar_source`), or `("think", grammar, opened,
  open_id, close_id)` (router/validation.py `after_think_block`).
- output: the grammar text; `ValueError` naming the problem (llguidance's refusal, or "the grammar
  did not compile within 3.0 s (its compile budget)"); `Overloaded` (RESOURCE_EXHAUSTED: 429 on
  the HTTP front) when the tenant's share, or every compile process, stays busy past the wait bound;
  `Unavailable` when no compile process starts.
- How: up to `processes` child processes (`python -c` `common.structured.serve_compiles`: started
  on first use, each compile on a DEEP_STACK_BYTES thread, nice 10) take one task at a time over a
  pipe. A compile past `budget_s` gets its child killed (SIGKILL) and a replacement started in the
  background; a child that dies on a grammar (a stack overflow is a SIGSEGV; a compile past the
  child's memory budget, `memory_bytes` of address space beyond what it had when ready, aborts
  it) is a refusal too.
  Results, refusals included, go to a bounded LRU cache keyed by the task (entries and bytes; a
  timeout or a dead child is remembered for `failure_ttl_s`, 10 minutes, the rest until evicted):
  a repeated bad schema costs nothing. Concurrent calls with the same task share one compile (n
  choices, many clients with one schema). A tenant runs at most `per_tenant` compiles at once
  (`per_tenant` < `processes`: one tenant's slow schemas leave slots for the others); the rest
  wait up to `wait_s` (default twice the budget) in its queue (at most 4 x `per_tenant` waiting)
  and for a free process, then are refused. A compile holds its tenant's slot until its child is
  done, whoever cancelled.
- state: the cache, the child processes, the per-tenant counts (on the event loop; a compiler
  moved to another event loop starts its queues afresh).
- options: `--grammar-compile-timeout-s`, `--grammar-compile-memory-mb`, `--grammar-compile-processes`,
  `--grammar-compiles-per-tenant` (router/config.py `Limits`).
- proven by: tests/test_grammar_budget.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from common.structured import MEMORY_ENV
from router.errors import Overloaded, Unavailable

if TYPE_CHECKING:
    from router.config import Limits

log = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: `common` imports
_CHILD = "from common.structured import serve_compiles; serve_compiles()"
STARTUP_S = 30.0  # a child's start (import llguidance) at most; not counted in a compile's budget
MAX_WAITING_PER_SLOT = 4  # a tenant's queue: this many waiting per compile it may run


class _ChildGone(Exception):
    """The child exited (or never became ready)."""


class _Child:
    """One compile process and its pipes (blocking calls: run on a thread, not the event loop)."""

    def __init__(self, memory_bytes: int = 0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        env[MEMORY_ENV] = str(memory_bytes)  # the child's memory budget (common.structured)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
            close_fds=True,
        )
        self._buf = b""
        try:
            ready = self._line(time.monotonic() + STARTUP_S)
        except _ChildGone:
            ready = None
        if ready is None or json.loads(ready) != {"ready": True}:
            self.kill()
            raise _ChildGone(f"a grammar-compile process did not start within {STARTUP_S:.0f} s")

    def _line(self, deadline: float) -> bytes | None:
        """The next reply line; None past `deadline`; _ChildGone at EOF."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise _ChildGone("exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def run(self, task: tuple, budget_s: float) -> dict | None:
        """The child's reply to `task`; None past the budget; _ChildGone if it died on it."""
        try:
            self.proc.stdin.write(json.dumps(list(task)).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _ChildGone("exited") from None
        line = self._line(time.monotonic() + budget_s)
        return None if line is None else json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass  # the pipe to a killed child: nothing more to say to it


class CompilePool:
    """Child processes, one task each at a time; blocking and thread-safe. At most `processes`
    children live or are starting (a caller runs at most `processes` tasks at once: one waiting for
    a child then always finds one idle or starting)."""

    def __init__(self, processes: int, memory_bytes: int = 0):
        self.processes, self.memory_bytes = processes, memory_bytes
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._starting = 0
        self._cond = threading.Condition()
        self._closed = False
        self.tasks = 0  # tasks sent to a child (a cache hit sends none)
        self.started = 0  # children started
        self.killed = 0  # children killed past their budget or dead on a task

    def _take(self, wait: bool = True) -> _Child | None:
        """An idle child, else a new one where there is room; else (`wait`) the next one given back
        or started, or (not `wait`) None."""
        with self._cond:
            while self._closed or (not self._idle and len(self._all) + self._starting >= self.processes):
                if self._closed:
                    raise _ChildGone("the compile pool is closed")
                if not wait:
                    return None
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._starting += 1
        child = None
        try:
            child = _Child(self.memory_bytes)
        finally:
            with self._cond:
                self._starting -= 1
                if child is not None:
                    self.started += 1
                    self._all.add(child)
                self._cond.notify_all()
        if self._closed:  # closed while it started
            self._drop(child)
            raise _ChildGone("the compile pool is closed")
        return child

    def _give(self, child: _Child) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(child)
                self._cond.notify_all()
                return
            self._all.discard(child)
        child.kill()

    def _drop(self, child: _Child) -> None:
        child.kill()
        with self._cond:
            self._all.discard(child)
            self._cond.notify_all()

    def _replace(self) -> None:
        try:
            child = self._take(wait=False)
        except _ChildGone as exc:
            log.warning("grammar compiles: no replacement process: %s", exc)
            return
        if child is not None:
            self._give(child)

    def run(self, task: tuple, budget_s: float) -> dict:
        """`{"ok": grammar}`, `{"error": why}` or `{"internal": what}`; `{"timeout": True}` past the
        budget (the child killed), `{"crashed": code}` when the child died on the task,
        `{"unavailable": why}` when no child starts."""
        try:
            child = self._take()
        except _ChildGone as exc:
            return {"unavailable": str(exc)}
        with self._cond:
            self.tasks += 1
        try:
            reply = child.run(task, budget_s)
        except _ChildGone:
            child.kill()  # reaps it: its own exit status (-11: a stack overflow), if it had one
            reply = {"crashed": child.proc.returncode}
        if reply is not None and "crashed" not in reply:
            self._give(child)
            return reply
        with self._cond:
            self.killed += 1
        self._drop(child)
        threading.Thread(target=self._replace, name="grammar-compile-replace", daemon=True).start()
        return reply or {"timeout": True}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            children, self._all, self._idle = list(self._all), set(), []
            self._cond.notify_all()
        for child in children:
            child.kill()


class _Cache:
    """LRU of task -> (ok, text, expires_at or None), bounded in entries and in bytes."""

    def __init__(self, entries: int, max_bytes: int):
        self._entries = entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._items: collections.OrderedDict[tuple, tuple[bool, str, float | None]]
        self._items = collections.OrderedDict()

    @staticmethod
    def _size(task: tuple, text: str) -> int:
        return len(text) + sum(len(part) for part in task if isinstance(part, str))

    def get(self, task: tuple) -> tuple[bool, str] | None:
        item = self._items.get(task)
        if item is None:
            return None
        ok, text, expires = item
        if expires is not None and time.monotonic() >= expires:
            self._pop(task)
            return None
        self._items.move_to_end(task)
        return ok, text

    def _pop(self, task: tuple) -> None:
        _, text, _ = self._items.pop(task)
        self._bytes -= self._size(task, text)

    def put(self, task: tuple, ok: bool, text: str, ttl_s: float | None = None) -> None:
        size = self._size(task, text)
        if size > self._max_bytes:
            return
        if task in self._items:
            self._pop(task)
        self._items[task] = (ok, text, None if ttl_s is None else time.monotonic() + ttl_s)
        self._bytes += size
        while len(self._items) > self._entries or self._bytes > self._max_bytes:
            self._pop(next(iter(self._items)))

    def __len__(self) -> int:
        return len(self._items)


class GrammarCompiler:
    """The router's grammar compiles (see the module docstring)."""

    def __init__(
        self,
        budget_s: float = 3.0,
        processes: int = 4,
        per_tenant: int = 2,
        wait_s: float | None = None,
        cache_entries: int = 512,
        cache_bytes: int = 64 * 2**20,
        failure_ttl_s: float = 600.0,
        memory_bytes: int = 0,
    ):
        if not budget_s > 0 or processes < 1 or per_tenant < 1:
            raise ValueError("budget_s must be > 0, processes and per_tenant >= 1")
        self.budget_s = budget_s
        self.per_tenant = min(per_tenant, processes)
        self.wait_s = 2 * budget_s if wait_s is None else wait_s
        self.failure_ttl_s = failure_ttl_s
        self.pool = CompilePool(processes, memory_bytes)
        self.cache = _Cache(cache_entries, cache_bytes)
        self._threads = concurrent.futures.ThreadPoolExecutor(processes, thread_name_prefix="grammar-compile")
        self._finalizer = weakref.finalize(self, _close, self.pool, self._threads)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_limits(cls, limits: Limits, results=None) -> GrammarCompiler:
        """`results`: a prometheus Counter labelled `result` (llm_router_grammar_compiles)."""
        compiler = cls(
            budget_s=limits.grammar_compile_timeout_s,
            processes=limits.grammar_compile_processes,
            per_tenant=limits.grammar_compiles_per_tenant,
            memory_bytes=limits.grammar_compile_memory_mb * 2**20,
        )
        compiler.results = results
        return compiler

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        if self.results is not None:
            self.results.labels(result=result).inc()

    def close(self) -> None:
        """Kills the child processes; the compiler is done."""
        self._finalizer()

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._loop = loop
        self._slots = asyncio.Semaphore(self.pool.processes)
        self._tenant_slots: dict[str, asyncio.Semaphore] = {}
        self._tenant_tasks: collections.Counter[str] = collections.Counter()
        self._inflight: dict[tuple, asyncio.Task] = {}
        self.counts: collections.Counter[str] = collections.Counter()  # by result (the metric's)
        self.results = None  # the metric, when the router has one (from_limits)

    async def compile(self, task: tuple, tenant: str) -> str:
        """The grammar of `task` (see the module docstring); ValueError naming the problem,
        Overloaded when the tenant's share or the pool stays busy."""
        hit = self.cache.get(task)
        if hit is not None:
            self._count("cached")
        else:
            self._bind()
            running = self._inflight.get(task)
            if running is not None:
                self._count("shared")
            else:
                self._admit(tenant)
                running = asyncio.get_running_loop().create_task(self._compile(task, tenant))
                self._inflight[task] = running
                running.add_done_callback(functools.partial(_done, self._inflight, task))
            hit = await asyncio.shield(running)
        ok, text = hit
        if not ok:
            raise ValueError(text)
        return text

    def _admit(self, tenant: str) -> None:
        waiting = self._tenant_tasks[tenant] - self.per_tenant
        if waiting >= MAX_WAITING_PER_SLOT * self.per_tenant:
            self._count("busy")
            raise Overloaded(
                f"response_format: {self._tenant_tasks[tenant]} grammar compiles of this API key are in "
                f"flight or waiting, the most it may have (it runs {self.per_tenant} at a time, each "
                f"within {_secs(self.budget_s)} s); retry when they finish",
                int(self.budget_s * 1000),
            )
        self._tenant_tasks[tenant] += 1

    async def _compile(self, task: tuple, tenant: str) -> tuple[bool, str]:
        share = self._tenant_slots.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        try:
            async with asyncio.timeout(self.wait_s):
                await share.acquire()
        except TimeoutError:
            self._left(tenant)
            self._count("busy")
            raise Overloaded(
                f"response_format: this API key's grammar compiles ({self.per_tenant} at a time, each "
                f"within {_secs(self.budget_s)} s) stayed busy for {_secs(self.wait_s)} s; retry later",
                int(self.budget_s * 1000),
            ) from None
        try:
            try:
                async with asyncio.timeout(self.wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                self._count("busy")
                raise Overloaded(
                    f"response_format: the router's {self.pool.processes} grammar-compile processes "
                    f"stayed busy for {_secs(self.wait_s)} s; retry later",
                    int(self.budget_s * 1000),
                ) from None
            try:
                reply = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self.pool.run, task, self.budget_s
                )
            finally:
                self._slots.release()
        finally:
            share.release()
            self._left(tenant)
        return self._outcome(task, reply)

    def _left(self, tenant: str) -> None:
        self._tenant_tasks[tenant] -= 1
        if self._tenant_tasks[tenant] <= 0:
            del self._tenant_tasks[tenant]
            share = self._tenant_slots.get(tenant)
            if share is not None and not share.locked():
                del self._tenant_slots[tenant]

    def _outcome(self, task: tuple, reply: dict) -> tuple[bool, str]:
        if "ok" in reply:
            outcome, ttl = (True, reply["ok"]), None
        elif "error" in reply:
            outcome, ttl = (False, reply["error"]), None
        elif "timeout" in reply:
            log.warning("a grammar compile ran past its budget (%g s): its process was killed", self.budget_s)
            why = f"the grammar did not compile within {_secs(self.budget_s)} s (its compile budget)"
            outcome, ttl = (False, why), self.failure_ttl_s
        elif "crashed" in reply:
            log.warning("a grammar-compile process died on a grammar (exit status %s)", reply["crashed"])
            outcome, ttl = (False, "the grammar compiler failed on this grammar"), self.failure_ttl_s
        elif "unavailable" in reply:  # no process: the router's trouble, not the request's
            raise Unavailable(
                f"response_format: the grammar compiler is unavailable ({reply['unavailable']})"
            )
        else:  # not the request's fault as far as we know: INTERNAL, not remembered
            raise RuntimeError(f"grammar compile: {reply.get('internal', reply)}")
        self._count(next(iter(reply)))  # ok | error | timeout | crashed
        self.cache.put(task, *outcome, ttl_s=ttl)
        return outcome


def _secs(s: float) -> str:
    return f"{s:.1f}" if round(s, 1) == s else f"{s:g}"


def _done(inflight: dict, task: tuple, running: asyncio.Task) -> None:
    inflight.pop(task, None)
    if not running.cancelled():
        running.exception()  # retrieved: every caller may have left (their calls were cancelled)


def _close(pool: CompilePool, threads: concurrent.futures.ThreadPoolExecutor) -> None:
    pool.close()
    threads.shutdown(wait=False, cancel_futures=True)
