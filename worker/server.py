"""Worker gRPC service: `llm.v1.Worker` around an `AsyncEngine`, in the shared server skeleton
(common/grpc_server.py: TLS, grpc.health.v1, reflection, /metrics, tracing, signals).

Contract
- input: `WorkerRequest` (token ids + fully resolved sampling) from a router.
- output: a stream of `WorkerResponse` (new token ids, logprobs, cached/queue stats on every
  message; `finished` on the last); `LoadReport` from `engine.stats()`; `WorkerInfo` from
  `engine.info`, plus the id it serves under (--served-model-name, else
  `common.model_files.model_id`) and its tokenizer's fingerprint (computed from its own model
  files). Protobuf stops here: the engine sees only `worker.types`.
- state: the engine (its loop runs on its own thread; this side only awaits its outputs).
- authentication: with `worker_token` set (the launchers set one per deployment) every
  llm.v1.Worker call must carry it (common.auth) or gets UNAUTHENTICATED before anything runs, so
  the tenant salt (`cache_salt`) and priority come only from this deployment's routers.
  Health and reflection stay open.
- stalled readers: each response waits at most `stream_idle_timeout_s` to be taken, else the call
  ends DEADLINE_EXCEEDED and the sequence is aborted; the engine buffers at most
  `stream_buffer_messages` outputs per stream and stops generating for a full one.
- failure modes: bad sampling values or an engine-rejected prompt -> INVALID_ARGUMENT; a cancelled
  call (router cancel, deadline, lost connection) aborts the sequence in the engine, freeing its KV
  blocks in the next step; SIGTERM -> health NOT_SERVING while new calls are still accepted for
  `drain_announce_s` (routers see it and stop routing here), then new calls are refused and open
  streams get `drain_grace_s` to finish, then the engine shuts down. A stop before `serve`'s
  handlers are in (`stop_requested`: python -m worker records SIGTERM/SIGINT from its first line)
  ends start-up after the step under way (the model load runs to its end): 0, never served.
- observability: each Generate is a span continuing the router's trace (`worker.observe`);
  Prometheus `/metrics` (`worker.metrics`) on --metrics-port, its address in `WorkerInfo`.
- proven by: tests/test_trust_auth.py, tests/test_trust_streams.py,
  tests/test_grpc_e2e.py (cancel frees blocks, load report),
  tests/test_grpc_two_workers.py (worker killed), tests/test_observability_e2e.py,
  tests/test_early_signals.py (a stop during start-up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from common.auth import TokenServerInterceptor
from common.grpc_server import GrpcServer, message_options
from common.model_files import model_id as default_model_id
from common.model_files import resolve_model_source
from common.tokenizer import Fingerprint, Tokenizer
from protos.llm.v1 import worker_pb2 as wpb
from protos.llm.v1 import worker_pb2_grpc
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.lora_files import AdapterError
from worker.metrics import WorkerMetrics
from worker.observe import RequestObservation
from worker.server_config import WorkerServerConfig
from worker.tp.engine import TPAsyncEngine
from worker.tp.errors import GroupUnavailable
from worker.types import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger(__name__)
SERVICE_NAME = wpb.DESCRIPTOR.services_by_name["Worker"].full_name
FINISH_REASONS = {
    FinishReason.STOP: wpb.WORKER_FINISH_REASON_STOP,
    FinishReason.LENGTH: wpb.WORKER_FINISH_REASON_LENGTH,
    FinishReason.ABORT: wpb.WORKER_FINISH_REASON_ABORT,
}
POOLINGS = {wpb.WORKER_POOLING_NONE: "", wpb.WORKER_POOLING_LAST: "last", wpb.WORKER_POOLING_MEAN: "mean"}


def to_sampling(s: wpb.WorkerSampling, adapter: str = "") -> SamplingParams:
    return SamplingParams(
        adapter=adapter,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs,
        max_tokens=s.max_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        top_logprobs=s.top_logprobs,
        grammar=s.grammar,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        pooling=POOLINGS.get(s.pooling, f"<enum value {s.pooling}>"),  # unknown: refused
    )


def _add_tops(field, logprobs) -> None:
    """The top-N of each `worker.types.Logprob` (sampler.py) into a repeated WorkerTopLogprobs."""
    for lp in logprobs:
        if top := getattr(lp, "top", None):
            field.add(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])


def to_response(out: RequestOutput) -> wpb.WorkerResponse:
    msg = wpb.WorkerResponse(
        token_ids=out.new_token_ids,
        logprobs=out.new_logprobs or (),
        num_cached_tokens=out.num_cached_tokens,
        queue_ms=out.queue_s * 1e3,
    )
    _add_tops(msg.top_logprobs, out.new_logprobs or ())
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.SetInParent()  # set even for a one-token prompt (no entries)
        msg.prompt_logprobs.logprobs.extend(out.prompt_logprobs)
        _add_tops(msg.prompt_logprobs.top_logprobs, out.prompt_logprobs)
    if out.embedding is not None:
        msg.embedding.extend(out.embedding)
    if out.finished:
        msg.finished.CopyFrom(
            wpb.WorkerFinished(
                reason=FINISH_REASONS[out.finish_reason],
                num_prompt_tokens=out.num_prompt_tokens,
                num_output_tokens=out.num_output_tokens,
                ttft_ms=out.ttft_s * 1e3,
            )
        )
    return msg


MAX_STATUS_CHARS = 2000  # gRPC's metadata limit is 16 KiB: a longer status becomes RESOURCE_EXHAUSTED


def _status_message(message: str) -> str:
    """A status message within MAX_STATUS_CHARS (a grammar's parse error repeats its input line)."""
    return message if len(message) <= MAX_STATUS_CHARS else message[: MAX_STATUS_CHARS - 3] + "..."


ADAPTER_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exists": grpc.StatusCode.ALREADY_EXISTS,  # a router treats it as served there (router/lora_admin.py)
    "off": grpc.StatusCode.FAILED_PRECONDITION,
    "busy": grpc.StatusCode.FAILED_PRECONDITION,
    "full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "missing": grpc.StatusCode.NOT_FOUND,
}


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, engine: AsyncEngine, metrics: WorkerMetrics | None = None, stream_idle_timeout_s: float = 0.0
    ):
        self._engine = engine
        self._metrics = metrics
        self._load_lock = asyncio.Lock()  # run-time LoRA loads, one at a time
        self._idle_s = stream_idle_timeout_s or None  # None: a reader may take any time
        self.worker_id = ""  # this worker's gRPC address, once bound
        self.metrics_address = ""  # host:port of /metrics, reported in WorkerInfo
        self.model_id = ""  # the id it serves under (WorkerInfo.model); empty = the engine's name
        self.fingerprint: Fingerprint | None = None  # of its tokenizer, from its own model files

    async def Generate(self, request: wpb.WorkerRequest, context: grpc.aio.ServicerContext):
        obs = RequestObservation(
            self._metrics,
            worker_id=self.worker_id,
            model=self._engine.info.name,
            request_id=request.request_id,
            tenant=request.cache_salt,
            num_prompt_tokens=len(request.prompt_token_ids),
            max_tokens=request.sampling.max_tokens,
            temperature=request.sampling.temperature,
            metadata=context.invocation_metadata(),
        )
        try:
            try:
                sampling = to_sampling(request.sampling, request.adapter)
            except ValueError as exc:
                obs.fail("invalid_argument", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _status_message(f"sampling: {exc}"))
            outputs = self._engine.generate(
                request.request_id,
                list(request.prompt_token_ids),
                sampling,
                priority=request.priority,
                salt=request.cache_salt,
            )
            try:
                async for out in outputs:
                    obs.output(out)
                    try:
                        async with asyncio.timeout(self._idle_s):
                            await context.write(to_response(out))
                    except TimeoutError:
                        message = f"stream idle: the reader took nothing for {self._idle_s:g} s"
                        obs.fail("deadline_exceeded", message)
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
            except ValueError as exc:  # the engine refused the request (duplicate id, prompt too long)
                obs.fail("invalid_argument", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _status_message(str(exc)))
            except GroupUnavailable as exc:  # tensor parallel: the worker's rank group is restarting
                obs.fail("unavailable", str(exc))
                await context.abort(grpc.StatusCode.UNAVAILABLE, _status_message(str(exc)))
            except RuntimeError as exc:  # an engine step failed; the engine keeps serving others
                obs.fail("internal", str(exc))
                await context.abort(grpc.StatusCode.INTERNAL, _status_message(str(exc)))
            finally:
                await outputs.aclose()  # on cancellation this aborts the sequence in the engine
        finally:
            obs.finish()

    async def GetLoad(self, request, context) -> wpb.LoadReport:
        s = self._engine.stats()
        return wpb.LoadReport(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            info_version=self._engine.info.info_version,
        )

    async def LoadAdapter(self, request: wpb.LoadAdapterRequest, context) -> wpb.WorkerInfo:
        name, path = request.name, request.path
        # One load at a time, until its work is done even when the caller gives up: a second one
        # for the last free slot is then refused before it allocates.
        await self._load_lock.acquire()
        load = asyncio.create_task(self._load_adapter(name, path))
        load.add_done_callback(self._load_done)
        await self._adapter_call("load", asyncio.shield(load), context)
        log.info("LoRA adapter %s loaded from %s", name, path)
        return await self.GetInfo(None, context)

    async def _load_adapter(self, name: str, path: str) -> None:
        # Read and checked beside the steps (seconds for a large adapter), served between two.
        adapter = await asyncio.to_thread(self._engine.engine.read_adapter, name, path)
        await self._engine.call(lambda e: e.install_adapter(name, adapter))

    def _load_done(self, load: asyncio.Task) -> None:
        self._load_lock.release()
        if not load.cancelled() and load.exception() is not None:  # read here if its caller left
            log.debug("LoRA adapter load ended with %r", load.exception())

    async def UnloadAdapter(self, request: wpb.UnloadAdapterRequest, context) -> wpb.WorkerInfo:
        name = request.name
        unload = self._engine.call(lambda engine: engine.unload_adapter(name))
        await self._adapter_call("unload", unload, context)
        log.info("LoRA adapter %s unloaded", name)
        return await self.GetInfo(None, context)

    async def _adapter_call(self, operation: str, work, context) -> None:
        """Awaits `work`; its refusals as gRPC statuses (their messages name the adapter and the
        problem, nothing else of this process), anything else INTERNAL, logged. Counted in
        `llm_lora_adapter_operations_total`."""
        try:
            await work
        except asyncio.CancelledError:  # the caller went away; work under way may still complete
            self._count_adapter_call(operation, "cancelled")
            raise
        except AdapterError as exc:
            self._count_adapter_call(operation, exc.kind)
            await context.abort(ADAPTER_CODES[exc.kind], _status_message(str(exc)))
        except ValueError as exc:  # the loader's checks (worker/lora_files.py)
            self._count_adapter_call(operation, "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _status_message(str(exc)))
        except Exception:  # out of memory, a bug: not the caller's business beyond that it failed
            self._count_adapter_call(operation, "internal")
            log.exception("LoRA adapter load / unload failed")
            await context.abort(grpc.StatusCode.INTERNAL, "the worker failed to load or unload the adapter")
        self._count_adapter_call(operation, "ok")

    def _count_adapter_call(self, operation: str, result: str) -> None:
        if self._metrics is not None:
            self._metrics.lora_operations.labels(operation, result).inc()

    async def GetInfo(self, request, context) -> wpb.WorkerInfo:
        i = self._engine.info
        info = wpb.WorkerInfo(
            model=self.model_id or i.name,
            block_size=i.block_size,
            max_model_len=i.max_model_len,
            vocab_size=i.vocab_size,
            eos_token_ids=i.eos_token_ids,
            metrics_address=self.metrics_address,
            max_num_seqs=i.max_num_seqs,
            adapters=i.adapters,
            info_version=i.info_version,
        )
        if self.fingerprint is not None:
            f = self.fingerprint
            info.tokenizer.CopyFrom(
                wpb.TokenizerFingerprint(
                    vocab_size=f.vocab_size, eos_token_ids=f.eos_token_ids, vocab_sha256=f.vocab_sha256
                )
            )
        return info


def _identity(engine: EngineConfig) -> tuple[str, Fingerprint | None]:
    """The id this worker serves under and its tokenizer's fingerprint, from its own model files (a
    hub id is fetched into the local cache first when --allow-download says so)."""
    path = resolve_model_source(engine.model, allow_download=engine.allow_download)
    model_id = engine.served_model_name or default_model_id(engine.model, path)
    try:
        return model_id, Tokenizer.from_model(path).fingerprint
    except (ValueError, OSError, KeyError) as exc:  # routers will not route here; say why
        log.warning("model %s: no tokenizer fingerprint (%s); routers will refuse this worker", path, exc)
        return model_id, None


def _stopped_early(stop_requested: Callable[[], bool]) -> bool:
    requested = stop_requested()
    if requested:
        log.info("stop requested during start-up: not serving")
    return requested


async def serve(
    config: WorkerServerConfig,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[int], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> int:
    """Serves until SIGTERM/SIGINT, or until `stop` is set when one is given (a server on a thread
    other than the main one, e.g. inside a Ray actor, cannot install signal handlers).
    `on_listening(port)` runs once the server is SERVING. `stop_requested()`: whether a stop
    arrived before this function's handlers are installed (python -m worker records SIGTERM/SIGINT
    from its first line); start-up then ends after the step under way, without serving, and
    returns 0."""
    model_id, fingerprint = await asyncio.to_thread(_identity, config.engine)
    if _stopped_early(stop_requested):
        return 0
    log.info("loading model %s", model_id)
    # --tensor-parallel-size > 1: one worker over N ranks (worker/tp/); this is where the class is chosen
    engine_class = TPAsyncEngine if config.engine.tensor_parallel_size > 1 else AsyncEngine
    engine = engine_class.from_config(config.engine, config.stream_buffer_messages, config.stream_interval)
    # The event loop's handlers replace the start-up recorder only now: the load above blocks this
    # thread, so they could not have run during it, and the recorder holds what came meanwhile.
    stop = GrpcServer.stop_event(stop)
    if _stopped_early(stop_requested):
        engine.shutdown()
        return 0
    metrics = WorkerMetrics(engine)
    try:
        base = GrpcServer(
            component="worker",
            service_names=(SERVICE_NAME,),
            host=config.host,
            port=config.port,
            telemetry=config.telemetry,
            metrics_registry=metrics.registry,
            tls=(config.tls_cert, config.tls_key, config.tls_client_ca),
            options=message_options(config.max_message_bytes),
            interceptors=[TokenServerInterceptor(config.worker_token)] if config.worker_token else [],
        )
        service = WorkerService(engine, metrics, config.stream_idle_timeout_s)
        worker_pb2_grpc.add_WorkerServicer_to_server(service, base.server)
        port = base.bind()
    except SystemExit:
        engine.shutdown()
        raise
    service.worker_id = base.address
    service.model_id, service.fingerprint = model_id, fingerprint
    service.metrics_address = base.metrics.address if base.metrics else ""
    await base.start()
    await base.set_serving(True)
    if hasattr(engine, "bind_health"):  # tensor parallel: NOT_SERVING while its rank group restarts
        engine.bind_health(asyncio.get_running_loop(), lambda ok: base.set_serving(ok and not stop.is_set()))
    base.announce()
    if on_listening is not None:
        on_listening(port)
    info = engine.info
    log.info(
        "model %s, block size %d, max model len %d, %d KV blocks",
        info.name,
        info.block_size,
        info.max_model_len,
        engine.stats().num_total_blocks,
    )
    await stop.wait()

    # Drain: health NOT_SERVING first while still accepting calls, so that routers stop routing
    # here before the port refuses anything; then refuse new calls and let open streams finish.
    log.info(
        "draining: NOT_SERVING, accepting calls for %.1f s more, then grace %.1f s for %d open stream(s)",
        config.drain_announce_s,
        config.drain_grace_s,
        engine.stats().num_running,
    )
    await base.not_serving()
    await asyncio.sleep(config.drain_announce_s)
    await base.stop(config.drain_grace_s)
    engine.shutdown()
    base.close()
    log.info("worker stopped")
    return 0
