"""The daemon threads that run torch steps, and stopping them at interpreter exit.

- `StepThread`: one daemon thread running submitted calls in order (async scheduling's executor,
  worker/engine.py). `submit(fn, *args) -> Future`; `shutdown(timeout_s)` after the calls already
  submitted; a submit after shutdown raises RuntimeError.
- `stop_at_exit(owner, stop, *args)`: `stop(*args)` at interpreter exit while `owner` lives (the
  executor above, AsyncEngine's loop thread). Why: Python's finalization ends a daemon thread that
  is inside a torch call by pthread_exit, whose forced unwind passes pybind11's noexcept GIL
  release, and the process aborts ("terminate called without an active exception").
- Proven by tests/test_engine_exit.py (processes exiting with a step in flight).
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future

from common.structured import start_deep

EXIT_JOIN_S = 10.0  # at interpreter exit, how long a thread's step in flight may take to end


def _call_if_alive(method: weakref.WeakMethod, *args) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


def stop_at_exit(owner: object, stop, *args) -> weakref.finalize:
    """Call `stop(*args)` (a method of `owner`) at interpreter exit if `owner` is still alive;
    nothing once it is collected. For the daemon threads that run torch (the engine loop, the
    executor): one inside a torch call when Python finalizes is ended by a forced unwind through
    pybind11's noexcept GIL release, and the process aborts ("terminate called without an active
    exception"). Exit hooks run newest first: an owner registered after another stops first."""
    return weakref.finalize(owner, _call_if_alive, weakref.WeakMethod(stop), *args)


class StepThread:
    """One daemon thread running submitted calls in order (async scheduling's executor). Daemon, as
    AsyncEngine's loop thread: a step stuck in the model must not keep the process from exiting
    (concurrent.futures' pool threads are joined at interpreter exit); at exit it is stopped after
    its calls (at most EXIT_JOIN_S) by `stop_at_exit`."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="engine-step", daemon=True)
        start_deep(self._thread)  # llguidance's matchers recurse deeply (common/structured.py)
        stop_at_exit(self, self.shutdown, EXIT_JOIN_S)

    def submit(self, fn, *args) -> Future:
        if self._closed:
            raise RuntimeError("the engine's executor thread is shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self, timeout_s: float | None = None) -> None:
        """After the calls already submitted (at most `timeout_s`)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started: nothing to run
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
