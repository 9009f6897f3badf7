"""AsyncEngine: runs LLMEngine on its own thread and streams outputs to asyncio consumers.

Contract:
- `generate(request_id, prompt_token_ids, sampling, priority, salt)` is an async iterator of
  `RequestOutput`; the last one has `finished=True`. If the consumer stops early (cancelled
  task, closed generator) the request is aborted in the engine and its blocks freed in the next
  step. Engine-side rejections (ValueError: duplicate id, prompt too long, bad token id) are raised
  from the iterator.
- Threads: only the engine thread touches LLMEngine. Other threads post commands to a queue; the
  engine thread hands a step's outputs back with one `loop.call_soon_threadsafe` for all its
  streams (one wake-up of the event loop per step, not one per stream), so the event loop never
  blocks on torch.
- Stream interval (`stream_interval`, the worker's --stream-interval, default 1): a stream's first
  tokens are delivered at once; after that its tokens are held on the engine thread and delivered
  `stream_interval` at a time (one RequestOutput carrying them all, logprobs included); the
  output that finishes the sequence, or an error, is delivered at once with whatever is held.
  Fewer, larger messages per stream: less CPU per token in the worker's event loop, the router and
  the client, at the price of burstier inter-token gaps (docs/serving.md).
- Backpressure: each stream buffers at most `stream_buffer` outputs its reader has not taken;
  while it is full the sequence is parked in the scheduler (`Scheduler.park`/`unpark` around each
  step): left out of the engine's steps, it keeps its KV blocks and slot, so a reader that stops
  reading stops its generation instead of growing a queue.
- `stats()` returns the snapshot taken after the latest step (immutable; safe from any thread).
- `AsyncEngine.from_config(config)` builds and starts one for a single-rank config; a config with
  `tensor_parallel_size > 1` is refused (ValueError): its caller (worker/server.py) builds a
  `worker.tp.engine.TPAsyncEngine` instead, so this module never imports its subclass.
- State: `engine`, the LLMEngine, read afresh by the loop each turn: a subclass may replace it
  between steps (worker/tp/engine.py, after a group restart).
- `call(fn)` runs fn(engine) on the engine thread between steps and returns its result (LoRA
  loads and unloads, worker/server.py).
- Fails how: an exception inside `step()` fails every in-flight stream with that error, aborts
  them, and the loop goes on serving new requests.
- Async scheduling (EngineConfig.async_scheduling): a parked sequence may still finish, from the
  step already in flight when it was parked; its stream gets that output (one past the buffer).
- Proven by tests/test_grpc_e2e.py (it drives an AsyncEngine directly) and the other gRPC
  end-to-end tests; backpressure by tests/test_trust_streams.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from common.structured import start_deep
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.scheduler import Parked
from worker.step_thread import EXIT_JOIN_S, stop_at_exit
from worker.types import EngineStats, ModelInfo, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
DEFAULT_STREAM_BUFFER = 64  # outputs per stream (WorkerServerConfig.stream_buffer_messages)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    limit: int  # outputs buffered for the reader before the engine stops generating for it
    produced: int = 0  # written by the engine thread only
    consumed: int = 0  # written by the event loop only
    paused: bool = False

    interval: int = 1  # tokens per delivery after the first (stream_interval)
    held: RequestOutput | None = None  # engine thread only: tokens not delivered yet
    started: bool = False  # engine thread only: tokens were delivered already
    added: bool = False  # engine thread only: its request is in the engine (outputs are its own)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Delivers `item` now (errors: anything held is dropped with the failed stream)."""
        self.produced += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def take(self, out: RequestOutput) -> RequestOutput | None:
        """Engine thread: `out` merged with what is held; returns what to deliver now, or None
        while the stream interval holds it back."""
        if self.held is not None:
            out = _merge(self.held, out)
            self.held = None
        if out.finished or self.interval <= 1:
            return out
        if not self.started:
            self.started = bool(out.new_token_ids)
            return out
        if len(out.new_token_ids) < self.interval:
            self.held = out
            return None
        return out

    @property
    def full(self) -> bool:
        return self.produced - self.consumed >= self.limit


def _merge(held: RequestOutput, out: RequestOutput) -> RequestOutput:
    """`out` with the tokens (and logprobs) of `held` in front: one message for both."""
    logprobs = out.new_logprobs
    if held.new_logprobs is not None or logprobs is not None:
        logprobs = [*(held.new_logprobs or ()), *(logprobs or ())]
    prompt = held.prompt_logprobs if held.prompt_logprobs is not None else out.prompt_logprobs
    return dataclasses.replace(
        out,
        new_token_ids=held.new_token_ids + out.new_token_ids,
        new_logprobs=logprobs,
        prompt_logprobs=prompt,
        embedding=held.embedding if held.embedding is not None else out.embedding,
    )


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Event loop: one step's outputs into their streams' queues."""
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """Event loop: an engine-thread call's outcome into its future (unless the caller gave up)."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


def on_new_thread(fn: Callable[[], T], name: str = "engine-build") -> T:
    """fn() run on a short-lived thread, waited for; its result, or its exception re-raised here."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def build_engine_off_main_thread(config: EngineConfig) -> LLMEngine:
    """LLMEngine(config), built in a short-lived thread so that the process's main thread never
    runs an OpenMP parallel region. If it did (loading the weights does), libgomp would keep that
    thread's idle team alive next to the engine thread's own; with more OpenMP threads than cores
    it throttles its spin-waits, and every parallel region on the engine thread then waits for a
    futex wake-up: a decode step of SmolLM2 on 2 cores took 15.5 ms instead of 8.8 ms."""
    return on_new_thread(lambda: LLMEngine(config))


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, stream_buffer: int = DEFAULT_STREAM_BUFFER, stream_interval: int = 1
    ):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.stream_buffer = stream_buffer
        self.stream_interval = stream_interval
        self._commands: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._stats = engine.stats()
        self.step_observers: list[Callable[[LLMEngine, list[RequestOutput]], None]] = []
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # A process that exits without shutdown(): the loop ends its step first (worker/step_thread.py).
        stop_at_exit(self, self.shutdown, EXIT_JOIN_S)

    @classmethod
    def from_config(
        cls, config: EngineConfig, stream_buffer: int = DEFAULT_STREAM_BUFFER, stream_interval: int = 1
    ) -> "AsyncEngine":
        if config.tensor_parallel_size > 1:  # its caller builds worker.tp.engine.TPAsyncEngine
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size}: a tensor-parallel worker is a "
                "worker.tp.engine.TPAsyncEngine, not an AsyncEngine"
            )
        engine = cls(build_engine_off_main_thread(config), stream_buffer, stream_interval)
        engine.start()
        return engine

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        start_deep(self._thread)  # llguidance's matchers recurse deeply (common/structured.py)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()  # the executor thread of async scheduling, if any

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise ValueError(f"duplicate request_id {request_id!r}")
        stream = _Stream(
            asyncio.get_running_loop(), asyncio.Queue(), self.stream_buffer, interval=self.stream_interval
        )
        self._streams[request_id] = stream
        self._post(("add", request_id, list(prompt_token_ids), sampling, priority, salt))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                stream.consumed += 1
                if stream.paused and not stream.full:
                    self._wakeup.set()  # room again: the engine resumes this sequence
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) run on the engine thread between steps (LoRA loads and unloads); its result,
        or its exception raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._post(("call", fn, loop, future))
        return await future

    def _post(self, command: tuple) -> None:
        self._commands.append(command)
        self._wakeup.set()

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            engine = self.engine  # read each turn: a subclass may replace it (worker/tp/engine.py)
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            parked = self._park()
            scheduler = engine.scheduler
            if parked and not (
                scheduler.running or scheduler.waiting or engine.has_pending_aborts or engine.has_in_flight
            ):
                self._unpark(parked)  # every stream's reader is behind: wait for one to read
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            steps = engine.num_steps
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug or OOM: fail in-flight, keep serving
                log.exception("engine step failed")
                self._unpark(parked)
                try:
                    self._fail_all(exc)
                except Exception:  # noqa: BLE001 - its streams have their errors; keep the thread
                    log.exception("draining the failed requests failed too")
                continue
            self._unpark(parked)
            # The load report and the step observers (the step histograms) first: a reader that got
            # this step's token must not then read the load or metrics as they were before the step.
            self._stats = engine.stats()
            for observer in self.step_observers:
                try:
                    observer(engine, outputs)
                except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine thread
                    log.exception("a step observer failed")
            self._hand_back(outputs)
            if parked and engine.num_steps == steps and not engine.has_in_flight:
                # Nothing ran: what waits needs the slots or KV blocks of parked sequences. Only a
                # reader taking something (or a command) changes that: wait for one, not spin.
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()

    def _hand_back(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs to their streams: one call_soon_threadsafe per event loop (a write to
        its wake-up socket each), not one per stream."""
        ready: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            # not added yet: the output is an earlier request's under the same id (a client's retry)
            if stream is not None and stream.added and (item := stream.take(out)) is not None:
                stream.produced += 1
                ready.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in ready.items():
            with contextlib.suppress(RuntimeError):  # its event loop closed: nobody reads them
                loop.call_soon_threadsafe(_deliver, items)

    def _park(self) -> Parked:
        """Parks the sequences whose stream buffer is full in the scheduler for one step
        (backpressure, `Scheduler.park`): they keep their KV blocks and slots but get no compute
        until their reader takes something; the idle timeout of the server ends a reader that never
        does. Returns the sequences parked."""
        full = {rid for rid, stream in list(self._streams.items()) if stream.full}
        if not full:
            return Parked()
        parked = self.engine.scheduler.park(full)
        for rid in full:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.paused = True
        return parked

    def _unpark(self, parked: Parked) -> None:
        """Puts the sequences `_park` parked back in the scheduler's queues (`Scheduler.unpark`)."""
        if not parked:
            return
        self.engine.scheduler.unpark()
        for seq in parked.running + parked.waiting:
            stream = self._streams.get(seq.request_id)
            if stream is not None:
                stream.paused = stream.full

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prompt, sampling, priority, salt = command
                # An earlier request of this id aborted (its client gone, this one its retry): its
                # abort output would end this stream, and this request would run on unread.
                self.engine.forget_aborted(request_id)
                if (added := self._streams.get(request_id)) is not None:
                    added.added = True
                try:
                    self.engine.add_request(request_id, prompt, sampling, priority, salt)
                except Exception as exc:  # noqa: BLE001 - this request fails, the engine loop goes on
                    if not isinstance(exc, ValueError):
                        log.exception("adding request %s failed", request_id)
                        exc = RuntimeError(f"the request could not be added ({type(exc).__name__})")
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(exc)
            elif command[0] == "call":
                _, fn, loop, future = command
                if future.cancelled():  # the caller gave up before it ran (a racy read: a hint)
                    continue
                try:
                    result, error = fn(self.engine), None
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    result, error = None, exc
                with contextlib.suppress(RuntimeError):  # its event loop closed (shutting down)
                    loop.call_soon_threadsafe(_settle, future, result, error)
            else:
                self.engine.abort(command[1])
        self._stats = self.engine.stats()

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                # its type only: torch / CUDA messages carry file paths and memory figures (logged)
                stream.put(RuntimeError(f"engine step failed ({type(exc).__name__})"))
        self.engine.step()  # drain the abort outputs
        self._stats = self.engine.stats()
