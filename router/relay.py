"""Stream relay: one validated, tokenized request -> a worker stream -> text chunks.

Contract
- input: (once) the registry and `tokenizer_for(model id)`; per call: `ValidRequest`, prompt token
  ids, resolved max_tokens, the tenant, the arrival time, the
  client's deadline, the `Placement` the dispatcher chose (worker + lease) and `retry(tried)`,
  which places a retry at once (retries do not queue again); gRPC `metadata` for the worker call
  (the W3C trace context of the router's route span).
- output: an async stream of `Chunk` (token ids, text delta, logprobs; the first also the prompt's
  logprobs when asked for) then one `Done`
  (reason stop / length / cancelled, usage, timings).
- state: per request only (detokenizer, stop-string matcher); each attempt's `Placement` is
  charged as tokens arrive (balancer lease and the tenant's fair-queue counter) and released when
  the attempt ends, however it ends.
- failure modes: the worker fails before the first token -> it is taken out of rotation and the
  request is retried on another worker (each worker at most once); worker-side failures feed the
  worker's circuit breaker and a final message resets it. INTERNAL / UNKNOWN before the first
  token may be the request's own doing (input that breaks the engine): such a failure counts
  against its worker only once another worker served the request, and a request that failed so on
  two workers is not tried on more (`RequestFailed`, INTERNAL): one bad request neither opens
  every circuit nor fails every worker's batch; a stream on a worker the registry
  declares down (hung) is cancelled and handled like a broken stream; no worker left or a failure
  after tokens were sent -> `Unavailable` naming the worker; the deadline passes ->
  `DeadlineExceeded`. The worker call is cancelled whenever this generator stops early (client
  cancel, deadline, stop string), which aborts the sequence on the worker.
- proven by: tests/test_grpc_e2e.py (text == engine output), tests/test_grpc_two_workers.py (worker killed).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from protos.llm.v1 import worker_pb2
from router.dispatcher import Placement
from router.errors import DeadlineExceeded, RequestFailed, Unavailable, WorkerRejected
from router.registry import WorkerHandle, WorkerRegistry
from router.stop_strings import StopStringMatcher
from router.tenants import Tenant
from router.validation import ValidRequest


def decode_message(
    ids: list[int], detok: IncrementalDetokenizer, stops: StopStringMatcher
) -> tuple[list[int], str, bool, int]:
    """One worker message's tokens -> (ids kept, text delta, stopped, number kept). A message can
    carry several tokens (the worker's --stream-interval); when a stop string ends inside one, the
    tokens after the one that completed it are dropped (with their logprobs, by the caller), as
    they would have been one token per message: never returned, never counted in usage."""
    if not ids:
        return ids, "", False, 0
    if len(ids) == 1 or not stops.active:
        text, stopped = stops.push(detok.push(ids))
        return ids, text, stopped, len(ids)
    text = ""
    for kept, token in enumerate(ids, 1):
        piece, stopped = stops.push(detok.push([token]))
        text += piece
        if stopped:
            return ids[:kept], text, True, kept
    return ids, text, False, len(ids)


# Failures before the first token that another worker may not repeat.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Failures before the first token the request itself may cause (it triggers a worker bug): counted
# against the worker only once another worker served the request; tried on this many workers at most.
SUSPECT = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MAX_SUSPECT_WORKERS = 2
# Failures that count against the worker's circuit breaker (not the request's own fault).
WORKER_FAULTS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS,
}
FINISH_REASONS = {
    worker_pb2.WORKER_FINISH_REASON_STOP: "stop",
    worker_pb2.WORKER_FINISH_REASON_LENGTH: "length",
    worker_pb2.WORKER_FINISH_REASON_ABORT: "cancelled",
}


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list = ()  # worker_pb2.WorkerTopLogprobs per token when asked for
    # the first chunk, when asked for: (prompt token ids, worker_pb2.WorkerPromptLogprobs)
    prompt_logprobs: tuple[list[int], object] | None = None
    embedding: list[float] | None = None  # the first chunk, with sampling.pooling


@dataclass
class Done:
    request_id: str
    reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


class WorkerLost(Exception):
    """The worker stream broke; `retryable` when no token had been relayed yet."""

    def __init__(self, message: str, retryable: bool, code: grpc.StatusCode):
        super().__init__(message)
        self.retryable = retryable
        self.code = code


def _worker_request(req: ValidRequest, prompt_ids: list[int], max_tokens: int, tenant: Tenant):
    sampling = worker_pb2.WorkerSampling(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        logprobs=req.logprobs,
        max_tokens=max_tokens,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=dict(req.logit_bias),
        top_logprobs=req.top_logprobs,
        grammar=req.grammar,
    )
    if req.seed is not None:
        sampling.seed = req.seed
    if req.prompt_logprobs is not None:
        sampling.prompt_logprobs = req.prompt_logprobs
    sampling.pooling = req.pooling  # pb.Pooling and worker_pb2.WorkerPooling share their numbers
    return worker_pb2.WorkerRequest(
        request_id=f"{req.request_id}/{uuid.uuid4().hex[:12]}",
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        priority=req.priority,
        cache_salt=tenant.name,
        adapter=req.model.name if req.model.base else "",
    )


class Relay:
    def __init__(self, registry: WorkerRegistry, tokenizer_for: Callable[[str], Tokenizer]):
        self._registry = registry
        self._tokenizer_for = tokenizer_for  # model id -> its tokenizer (router.models.ModelTable)

    async def run(
        self,
        req: ValidRequest,
        prompt_ids: list[int],
        max_tokens: int,
        tenant: Tenant,
        arrival_s: float,
        deadline_s: float | None,
        placement: Placement | None,
        retry: Callable[[list[str]], Placement | None],
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> AsyncIterator[Chunk | Done]:
        wreq = _worker_request(req, prompt_ids, max_tokens, tenant)
        tried: list[str] = []
        errors: list[str] = []
        suspects: list[tuple[WorkerHandle, str, float]] = []  # SUSPECT failures: (worker, reason, when)
        while True:
            if placement is None:
                detail = f"; tried: {'; '.join(errors)}" if errors else ""
                raise Unavailable(f"no healthy worker for model {req.model.name!r}{detail}")
            worker = placement.worker
            tried.append(worker.address)
            try:
                attempt = self._attempt(placement, wreq, req, arrival_s, deadline_s, metadata, suspects)
                async with aclosing(attempt) as events:
                    async for event in events:
                        yield event
                return
            except WorkerLost as lost:
                if lost.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self._registry.mark_failed(worker, str(lost))
                if lost.retryable and lost.code in SUSPECT:
                    suspects.append((worker, str(lost), time.monotonic()))
                    if len(suspects) >= MAX_SUSPECT_WORKERS:
                        raise RequestFailed(
                            f"the request failed on {len(suspects)} workers before its first token "
                            f"({'; '.join(r for _, r, _ in suspects)}); not tried on more"
                        ) from None
                elif lost.code in WORKER_FAULTS:
                    self._registry.call_failed(worker, str(lost))
                if not lost.retryable:
                    raise Unavailable(str(lost)) from None
                errors.append(str(lost))
            finally:
                placement.release()
            placement = retry(tried)

    async def _attempt(
        self,
        placement: Placement,
        wreq,
        req: ValidRequest,
        arrival_s: float,
        deadline_s: float | None,
        metadata: tuple = (),
        suspects: list = (),
    ) -> AsyncIterator[Chunk | Done]:
        worker = placement.worker
        timeout = None if deadline_s is None else deadline_s - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("deadline passed before the request reached a worker")
        detok = IncrementalDetokenizer(self._tokenizer_for(req.model.name), skip_special_tokens=True)
        stops = StopStringMatcher(req.stop)
        dispatch_s = time.monotonic()
        first_token_s = None
        num_out = 0
        try:
            call = worker.stub.Generate(wreq, timeout=timeout, metadata=metadata)  # metadata: trace context
        except grpc.aio.UsageError as exc:  # the worker left discovery since it was placed: channel closed
            raise WorkerLost(
                f"worker {worker.address} left before the call began ({exc})",
                retryable=True,
                code=grpc.StatusCode.UNAVAILABLE,
            ) from None
        stream = self._registry.track(worker, call)  # the registry cancels it if the worker goes down
        try:
            async for msg in call:
                ids, text, stopped, kept = decode_message(list(msg.token_ids), detok, stops)
                lps, tops = list(msg.logprobs)[:kept], list(msg.top_logprobs)[:kept]
                finished = msg.HasField("finished")
                if finished and not stopped:
                    tail, stopped = stops.push(detok.flush())
                    text += tail if stopped else tail + stops.flush()
                if ids or text or msg.embedding:  # an embedding's token may be an EOS, not shown
                    placement.progress(len(ids), first=num_out == 0)
                    if first_token_s is None and ids:
                        first_token_s = time.monotonic()
                    num_out += len(ids)
                    prompt = None
                    if msg.HasField("prompt_logprobs"):
                        prompt = (list(wreq.prompt_token_ids), msg.prompt_logprobs)
                    yield Chunk(ids, text, lps, tops, prompt, list(msg.embedding) or None)
                if stopped or finished:
                    self._registry.call_succeeded(worker)  # before the yield: a reader may stop at Done
                    for failed, reason, at_s in suspects:  # served here, so those workers were at fault
                        self._registry.call_failed(failed, reason, at_s)
                    now = time.monotonic()
                    reason = "stop" if stopped else FINISH_REASONS.get(msg.finished.reason, "cancelled")
                    yield Done(
                        request_id=req.request_id,
                        reason=reason,
                        prompt_tokens=len(wreq.prompt_token_ids),
                        completion_tokens=num_out,
                        cached_prompt_tokens=msg.num_cached_tokens,
                        queue_ms=(dispatch_s - arrival_s) * 1e3 + msg.queue_ms,
                        ttft_ms=((first_token_s or now) - arrival_s) * 1e3,
                        total_ms=(now - arrival_s) * 1e3,
                        stop_reason=stops.matched
                        if stopped
                        else (
                            ids[-1] if reason == "stop" and ids and ids[-1] in req.stop_token_ids else None
                        ),
                    )
                    return
            raise WorkerLost(
                f"worker {worker.address} closed the stream without finishing",
                retryable=num_out == 0,
                code=grpc.StatusCode.UNAVAILABLE,
            )
        except asyncio.CancelledError:
            if not stream.down_reason or asyncio.current_task().cancelling():
                # the client's cancellation (or the deadline), not the worker's: also when the
                # registry cancelled the worker call in the same turn (no retry for a gone client)
                raise
            raise WorkerLost(
                f"worker {worker.address} was lost mid-stream after {num_out} tokens ({stream.down_reason})",
                retryable=num_out == 0,
                code=grpc.StatusCode.UNAVAILABLE,
            ) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"deadline exceeded after {num_out} tokens") from None
            if num_out:
                raise WorkerLost(
                    f"worker {worker.address} was lost mid-stream after {num_out} tokens "
                    f"({code.name}: {exc.details()})",
                    retryable=False,
                    code=code,
                ) from None
            if code not in RETRYABLE:
                raise WorkerRejected(
                    code, f"worker {worker.address} rejected the request ({code.name}: {exc.details()})"
                ) from None
            raise WorkerLost(
                f"worker {worker.address} failed before the first token ({code.name}: {exc.details()})",
                retryable=True,
                code=code,
            ) from None
        finally:
            self._registry.untrack(worker, stream)
            call.cancel()
