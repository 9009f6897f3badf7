"""TPAsyncEngine: the AsyncEngine of a tensor-parallel worker; a failed rank restarts the group.

Contract
- `TPAsyncEngine.from_config(config)` (tensor_parallel_size > 1): builds rank 0's runner and the
  group (worker/tp/runner.py) off the main thread, then the usual LLMEngine over them; serves
  exactly like AsyncEngine (one gRPC endpoint per group: worker/server.py).
- failure: a step that raises `GroupFailed` (a rank died, a collective failed or timed out) ends
  every stream in flight with `GroupUnavailable` (the server answers UNAVAILABLE), turns the
  worker's health NOT_SERVING (`bind_health`: routers route around it), restarts the whole group
  (ranks 1..N-1 stopped within a deadline and started afresh, a new process group), replaces the
  engine by a fresh one over the same rank-0 runner (`restarted`: a new scheduler and block
  manager, since the restarted ranks' KV pools hold nothing and no prefix may be served from them;
  the loop picks it up at its next turn), and turns health SERVING again. Requests that arrive
  during the restart wait in the command queue and run after it. A restart that fails is retried
  (`MAX_RESTART_ATTEMPTS`), then the process ends itself with SIGTERM (the usual drain), so its
  supervisor (Ray's max_restarts, Kubernetes, deploy/local.py) starts it again. Other step errors
  are AsyncEngine's (INTERNAL, the group keeps serving).
- every wait is bounded: collectives by their timeout, rank stop by join deadlines, rank start by
  its start-up deadline (worker/tp/group.py, worker/tp/runner.py).
- proven by tests/test_tp_serve.py (a rank SIGKILLed mid-stream: UNAVAILABLE, restart, the router
  serves through the worker again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from worker.async_engine import DEFAULT_STREAM_BUFFER, AsyncEngine, on_new_thread
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.tp.errors import GroupFailed, GroupUnavailable

log = logging.getLogger(__name__)
MAX_RESTART_ATTEMPTS = 3


class TPAsyncEngine(AsyncEngine):
    def __init__(
        self, engine: LLMEngine, group, stream_buffer: int = DEFAULT_STREAM_BUFFER, stream_interval: int = 1
    ):
        super().__init__(engine, stream_buffer, stream_interval)
        self.group = group
        self._health = None  # callable(bool), set by bind_health
        self.num_restarts = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, stream_buffer: int = DEFAULT_STREAM_BUFFER, stream_interval: int = 1
    ) -> TPAsyncEngine:
        from worker.tp.runner import build_runner

        def build() -> tuple[LLMEngine, object]:  # off the main thread: see build_engine_off_main_thread
            runner, group = build_runner(config)
            try:
                return LLMEngine(config, runner), group
            except BaseException:
                group.stop()
                raise

        built, group = on_new_thread(build)
        engine = cls(built, group, stream_buffer, stream_interval)
        engine.start()
        return engine

    def bind_health(self, loop: asyncio.AbstractEventLoop, set_serving) -> None:
        """`set_serving(bool)`: the server's async health setter, called on `loop`."""

        def health(serving: bool) -> None:
            try:
                asyncio.run_coroutine_threadsafe(set_serving(serving), loop).result(timeout=5.0)
            except Exception:  # noqa: BLE001 - a closing loop; the restart goes on regardless
                log.warning("could not set health %s", "SERVING" if serving else "NOT_SERVING")

        self._health = health

    def shutdown(self, timeout_s: float = 10.0) -> None:
        super().shutdown(timeout_s)
        self.group.stop()

    def _fail_all(self, exc: Exception) -> None:
        if not isinstance(exc, GroupFailed):
            super()._fail_all(exc)
            return
        log.error("tensor-parallel group failed: %s; restarting the group", exc)
        if self._health is not None and not self._stopping:
            self._health(False)
        error = GroupUnavailable("tensor-parallel worker group failed; it is restarting, retry")
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error)
        self.engine.step()  # drains the abort outputs; runs no forward
        for attempt in range(1, MAX_RESTART_ATTEMPTS + 1):
            if self._stopping:
                return
            try:
                self.group.restart()
                break
            except Exception:  # noqa: BLE001 - logged; retried, then the process ends (docstring)
                log.exception("group restart %d/%d failed", attempt, MAX_RESTART_ATTEMPTS)
        else:
            log.critical("tensor-parallel group could not restart; ending the worker")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        # The loop reads `self.engine` afresh each turn (worker/async_engine.py).
        self.engine = restarted(self.engine, self.group.rank_blocks)
        self.num_restarts += 1
        self._stats = self.engine.stats()
        log.info("tensor-parallel group restarted (%d restart(s))", self.num_restarts)
        if self._health is not None:
            self._health(True)


def restarted(engine: LLMEngine, rank_blocks: list[int]) -> LLMEngine:
    """The LLMEngine that serves after a group restart: a fresh scheduler and block manager over
    `engine`'s rank-0 runner, sized to the smallest KV pool of the restarted ranks (`rank_blocks`).
    Their pools are empty, so nothing cached before may be reused; its step counters carry on
    (`num_steps`, `step_s_total`: the metrics' step index and totals)."""
    runner = engine.runner
    runner.num_blocks = min([runner.num_blocks, *rank_blocks])
    fresh = LLMEngine(engine.config, runner)
    fresh.num_steps, fresh.step_s_total = engine.num_steps, engine.step_s_total
    return fresh
