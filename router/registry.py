"""Worker registry: which workers exist, whether they are healthy, what they serve.

Contract
- input: worker addresses from a discovery source (`discover()`; `StaticRegistry` returns the
  --workers list; a Ray-backed registry will override it).
- output: `healthy(model)` -> `WorkerHandle`s with a channel, stub, model info and load counters;
  `models()` -> served models as `ModelSpec`s.
- state: one `WorkerHandle` per address; a probe task refreshes health (grpc.health.v1 Check),
  info (once, again when the worker comes back or its LoadReport.info_version moves: LoRA
  adapters loaded at run time) and load (`Worker.GetLoad`) every `poll_s`, each probe call bounded by
  `probe_timeout_s`. With `check_info` (router.models.ModelTable.check) each worker's
  `WorkerInfo` is vetted: a worker serving a model the router has no tokenizer for, or whose
  tokenizer fingerprint differs from the router's, is never routed to (`refused` says why, logged
  once; re-checked every probe). `mark_failed` takes a worker out of rotation at once when its
  connection fails; the next good probe brings it back. Each handle has a `CircuitBreaker` fed by call
  outcomes (`call_failed` / `call_succeeded`): a worker that passes probes but fails calls is left
  out for the breaker's cool-down. Open streams register on their handle (`track`).
- failure modes: unreachable / NOT_SERVING / too-slow workers are unhealthy; a worker that fails
  `down_after_probes` probes in a row (dead, or hung: alive but not answering) is declared down and
  its open streams are cancelled with the reason, so no client waits on a hung worker past
  about `down_after_probes * (poll_s + probe_timeout_s)`; `on_change(any_healthy)` fires when the
  router goes from no healthy worker to some or back (drives the router's health).
- proven by: tests/test_grpc_two_workers.py (spread, worker killed), tests/test_models_e2e.py
  (mismatched tokenizer refused),
  tests/test_faults.py (hung worker, circuit breaking).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import worker_pb2, worker_pb2_grpc
from router.circuit import CircuitBreaker
from router.validation import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo | None = None
    load: worker_pb2.LoadReport | None = None
    healthy: bool = False
    outstanding_tokens: int = 0  # router-side accounting, see balancer.Lease
    num_inflight: int = 0
    last_error: str = field(default="")
    probe_failures: int = 0  # consecutive failed probes
    draining: bool = False  # answered NOT_SERVING since its last good probe
    refused: str = ""  # why the router does not route here (model / tokenizer mismatch); "" = it does
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    streams: set = field(default_factory=set)  # open `TrackedStream`s on this worker


class TrackedStream:
    """An open worker call that the registry may cancel when its worker is declared down."""

    def __init__(self, call: grpc.aio.Call):
        self.call = call
        self.down_reason = ""  # set when the registry cancelled it

    def cancel_down(self, reason: str) -> None:
        self.down_reason = reason
        self.call.cancel()


class WorkerRegistry(abc.ABC):
    def __init__(
        self,
        poll_s: float = 1.0,
        channel_options: tuple = (),
        probe_timeout_s: float = 1.0,
        down_after_probes: int = 2,
        breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
        credentials: grpc.ChannelCredentials | None = None,
        interceptors: tuple = (),
        check_info: Callable[[worker_pb2.WorkerInfo], str] | None = None,
    ):
        self._poll_s = poll_s
        self._probe_timeout_s = probe_timeout_s
        self._down_after = down_after_probes
        self._breaker_factory = breaker_factory
        self._options = channel_options
        self._credentials = credentials  # TLS to workers (common.tls); None = plaintext
        self._interceptors = list(interceptors)  # e.g. the worker token (common.auth) on every call
        self._check_info = check_info  # WorkerInfo -> "" or why not to route there (router.models)
        self._handles: dict[str, WorkerHandle] = {}
        self._task: asyncio.Task | None = None
        self._listeners: list[Callable[[bool], None]] = []
        self._any_healthy = False
        # called after each WorkerInfo read (router/lora_admin.py: run-time adapters a worker that
        # joined or came back lacks are loaded onto it)
        self.on_info: Callable[[WorkerHandle], None] | None = None

    @abc.abstractmethod
    async def discover(self) -> list[str]:
        """Addresses (host:port) of the workers that should exist now."""

    def on_change(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(self._probe_forever(), name="worker-registry")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(h.channel.close() for h in self._handles.values()))

    def all(self) -> list[WorkerHandle]:
        return list(self._handles.values())

    def healthy(self, model: str | None = None) -> list[WorkerHandle]:
        # a snapshot: the tokenize pool's threads resolve adapters through here (router/models.py)
        return [
            h
            for h in tuple(self._handles.values())
            if h.healthy
            and h.info is not None
            and not h.refused
            and h.breaker.allows()
            and (model is None or h.info.model == model or model in h.info.adapters)
        ]

    def models(self) -> dict[str, ModelSpec]:
        """Each served model with the longest context among its healthy workers: a request longer
        than one worker's context may still fit another's (placement picks one that holds it)."""
        specs: dict[str, ModelSpec] = {}
        for h in self.healthy():
            names = [(h.info.model, "")] + [(a, h.info.model) for a in h.info.adapters]  # LoRA: its base
            for name, base in names:
                known = specs.get(name)
                if known is None or h.info.max_model_len > known.max_model_len:
                    specs[name] = ModelSpec(name, h.info.max_model_len, h.info.vocab_size, base)
        return specs

    def adapter_bases(self) -> dict[str, set[str]]:
        """LoRA adapter -> the base models of the vetted (not refused) workers reporting it, healthy
        or not: what a new worker's adapters must not contradict (router/models.py check)."""
        bases: dict[str, set[str]] = {}
        for h in tuple(self._handles.values()):
            if h.info is not None and not h.refused:
                for adapter in h.info.adapters:
                    bases.setdefault(adapter, set()).add(h.info.model)
        return bases

    def mark_failed(self, handle: WorkerHandle, reason: str) -> None:
        if handle.healthy:
            log.warning("worker %s out of rotation: %s", handle.address, reason)
        handle.healthy = False
        handle.last_error = reason
        self._notify()

    def call_failed(self, handle: WorkerHandle, reason: str, at_s: float | None = None) -> None:
        """A call failed on the worker's side (at `at_s`, now by default): feeds its circuit breaker."""
        if handle.breaker.record_failure(reason, at_s):
            log.warning(
                "worker %s circuit open for %.1f s after %d failure(s): %s",
                handle.address,
                handle.breaker.cooldown_s,
                handle.breaker.consecutive_failures,
                reason,
            )
            self._notify()

    def call_succeeded(self, handle: WorkerHandle) -> None:
        if handle.breaker.state != "closed":
            log.info("worker %s circuit closed", handle.address)
        handle.breaker.record_success()

    def track(self, handle: WorkerHandle, call: grpc.aio.Call) -> TrackedStream:
        """Registers an open stream on `handle` (remove it with `untrack`)."""
        stream = TrackedStream(call)
        handle.streams.add(stream)
        return stream

    def untrack(self, handle: WorkerHandle, stream: TrackedStream) -> None:
        handle.streams.discard(stream)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                await self._refresh()
            except Exception:  # noqa: BLE001 - a bug in one round must not end probing for good
                log.exception("a worker probe round failed; probing goes on")

    async def _refresh(self) -> None:
        addresses = await self.discover()
        for address in addresses:
            if address not in self._handles:
                channel = (
                    grpc.aio.secure_channel(
                        address, self._credentials, options=self._options, interceptors=self._interceptors
                    )
                    if self._credentials
                    else grpc.aio.insecure_channel(
                        address, options=self._options, interceptors=self._interceptors
                    )
                )
                self._handles[address] = WorkerHandle(
                    address, channel, worker_pb2_grpc.WorkerStub(channel), breaker=self._breaker_factory()
                )
        for address in set(self._handles) - set(addresses):
            gone = self._handles.pop(address)
            # Its open streams end as lost (UNAVAILABLE to their clients); closing the channel
            # alone would cancel them like a client's cancel, and their clients would get no
            # status at all until their own deadlines.
            for stream in list(gone.streams):
                stream.cancel_down(f"worker {address} left the registry (no longer discovered)")
            await gone.channel.close()
        await asyncio.gather(*(self._probe(h) for h in self._handles.values()))
        self._notify()

    async def _probe(self, h: WorkerHandle) -> None:
        timeout = self._probe_timeout_s
        try:
            health = health_pb2_grpc.HealthStub(h.channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise ConnectionError("worker reports NOT_SERVING")
            # A refused worker may have been restarted with another model; one coming back may have
            # been restarted with other LoRA adapters.
            if h.info is None or h.refused or not h.healthy:
                await self._read_info(h)
            h.load = await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout)
            if h.load.info_version != h.info.info_version:  # adapters loaded or unloaded since
                await self._read_info(h)
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
            reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            if h.healthy:
                log.warning("worker %s unhealthy: %s", h.address, reason)
            h.healthy, h.last_error = False, reason
            # A NOT_SERVING answer is a draining worker: its open streams may finish, also after it
            # stops accepting calls (probes then fail too). Only a worker that stops answering
            # without having announced a drain (dead or hung) counts towards being declared down.
            if isinstance(exc, ConnectionError):
                h.draining = True
            h.probe_failures = 0 if h.draining else h.probe_failures + 1
            if h.probe_failures >= self._down_after and h.streams:
                message = (
                    f"worker {h.address} stopped answering ({h.probe_failures} health probes "
                    f"failed, last: {reason})"
                )
                log.warning("%s; cancelling %d open stream(s)", message, len(h.streams))
                for stream in list(h.streams):
                    stream.cancel_down(message)
            return
        h.probe_failures = 0
        h.draining = False
        if not h.healthy:
            log.info("worker %s healthy (model %s)", h.address, h.info.model)
        h.healthy, h.last_error = True, ""

    async def _read_info(self, h: WorkerHandle) -> None:
        h.info = await h.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self._probe_timeout_s)
        self._vet(h)
        if self.on_info is not None:
            self.on_info(h)

    def _vet(self, h: WorkerHandle) -> None:
        refused = self._check_info(h.info) if self._check_info is not None else ""
        if refused and refused != h.refused:
            log.warning("worker %s not routed: %s", h.address, refused)
        elif h.refused and not refused:
            log.info("worker %s routed again: its model and tokenizer now match", h.address)
        h.refused = refused

    def _notify(self) -> None:
        any_healthy = bool(self.healthy())
        if any_healthy != self._any_healthy:
            self._any_healthy = any_healthy
            for listener in self._listeners:
                listener(any_healthy)


class StaticRegistry(WorkerRegistry):
    """A fixed list of worker addresses (the --workers flag)."""

    def __init__(self, addresses: tuple[str, ...], **kwargs):
        super().__init__(**kwargs)
        self._addresses = list(addresses)

    async def discover(self) -> list[str]:
        return self._addresses
