"""The `llm.v1.Generation` servicer: protobuf in, one call per stage, protobuf out.

Contract
- input: `GenerateRequest` + call metadata (API key) + deadline; `ListModelsRequest`;
  `TokenizeRequest` / `DetokenizeRequest` (router/token_api.py); `LoraAdapterRequest`
  (router/lora_admin.py: LoRA adapters loaded / unloaded at run time); the served models
  (`router.models.ModelTable`: tokenizer, chat template and generation defaults per id).
- output: a stream of `GenerateResponse` (chunks, then `Finished`); `ListModelsResponse`;
  `TokenizeResponse` / `DetokenizeResponse`. Fronts that are not gRPC call the public
  `generate(request, context, obs, choice=None)` (the pipeline `Generate` runs; `context` need only
  have `invocation_metadata()`, `peer()` and `time_remaining()`), `gate(context)` (the checks before
  a body is read) and `tenant_of(context)`.
- construction: everything it uses is passed in, including `reasoning` (model id -> its reasoning
  mode or None; router/server.py derives it from the served models); nothing is set afterwards.
- state: none of its own (drain counter, registry, tenants, admission and dispatcher are
  injected).
- failure modes: raises `router.errors` exceptions; `ErrorInterceptor` turns them into statuses.
  `model` must name a served model (INVALID_ARGUMENT listing them; it may be left empty when one
  is served) with a healthy worker whose tokenizer matches (else UNAVAILABLE); sampling fields
  left unset take the model's generation defaults.
  Stage order: drain check -> auth -> validate (priority above the tenant's max_priority:
  PERMISSION_DENIED) -> early shedding (the tenant's request rate and the admission caps, after
  which the request counts against its tenant's concurrency; with `queue_requests=False` also "no
  worker has a free slot") -> tokenize (router.tokenize_pool: off the event loop, bounded) -> fit
  to context -> admit (refusal: RESOURCE_EXHAUSTED + retry-after-ms; a deadline it cannot meet:
  DEADLINE_EXCEEDED) -> wait in the fair queue until dispatched to a worker with room (with
  `queue_requests=False`: placed at once or refused, never queued) -> relay. A request's priority
  0 means the tenant's `default_priority`; a call without a deadline gets the tenant's
  `default_deadline_s`, and none runs past its `max_deadline_s`.
- observability: `router.observe` spans each stage (auth, validate, admission, queue, route),
  hands the route span's trace context to the worker call, records metrics and the log line.
- proven by: tests/test_grpc_e2e.py (and its invalid-request table), tests/test_observability_e2e.py,
  tests/test_trust_admission.py, tests/test_admission_refunds.py (tokens/min of requests that never ran).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import jinja2

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.admission import AdmissionController, AdmissionError, Claim
from router.affinity import prefix_hashes
from router.config import Limits
from router.decode_pool import Busy, DecodePool, message_problem
from router.dispatcher import Dispatcher, Pending
from router.drain import Drain
from router.errors import DeadlineExceeded, Overloaded, Unavailable, ValidationError, context_exceeded
from router.fair_queue import OUTPUT_COST
from router.fanout import ChoiceOf
from router.grammar_compile import GrammarCompiler
from router.lora_admin import AdapterAdmin
from router.lora_autoload import Autoloader
from router.metrics import RouterMetrics
from router.models import ModelTable
from router.observe import RequestObservation
from router.registry import WorkerRegistry
from router.relay import Chunk, Done, Relay
from router.tenants import TenantsFile
from router.token_api import TokenApi
from router.tokenize_pool import TokenizePool
from router.validation import (
    ValidRequest,
    after_think_block,
    compile_response_format,
    fit_to_context,
    validate,
)

# A chat of more messages than this, or a request of more bytes, is validated on a thread (10,000
# messages: ~66 ms of Python, which would hold the event loop; on a thread the loop runs between
# the GIL's switches)
INLINE_MESSAGES = 256
INLINE_BYTES = 64 * 1024  # so is a larger request (a tool call's 960k-character arguments: json.loads)
_VALIDATION = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="validate")
# the largest max_tokens a request's pre-validation cost estimate counts (retry-after estimates only)
MAX_COST_TOKENS = 1 << 20
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}


def _to_pb(event: Chunk | Done) -> pb.GenerateResponse:
    if isinstance(event, Chunk):
        chunk = pb.TokenChunk(
            token_ids=event.token_ids,
            text=event.text,
            logprobs=event.logprobs,
            top_logprobs=[
                pb.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs) for t in event.top_logprobs
            ],
        )
        if event.prompt_logprobs is not None:
            ids, scored = event.prompt_logprobs
            chunk.prompt_logprobs.SetInParent()
            chunk.prompt_logprobs.token_ids.extend(ids)
            chunk.prompt_logprobs.logprobs.extend(scored.logprobs)
            for t in scored.top_logprobs:
                chunk.prompt_logprobs.top_logprobs.add(token_ids=t.token_ids, logprobs=t.logprobs)
        if event.embedding is not None:
            chunk.embedding.extend(event.embedding)
        return pb.GenerateResponse(chunk=chunk)
    reason, stop = event.stop_reason, {}
    if reason is not None:
        stop = {"stop_string" if isinstance(reason, str) else "stop_token_id": reason}
    return pb.GenerateResponse(
        finished=pb.Finished(
            **stop,
            reason=FINISH_REASONS[event.reason],
            request_id=event.request_id,
            usage=pb.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_prompt_tokens=event.cached_prompt_tokens,
            ),
            timing=pb.Timing(queue_ms=event.queue_ms, ttft_ms=event.ttft_ms, total_ms=event.total_ms),
        )
    )


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        registry: WorkerRegistry,
        models: ModelTable,
        tenants: TenantsFile,
        limits: Limits,
        drain: Drain,
        admission: AdmissionController,
        dispatcher: Dispatcher,
        metrics: RouterMetrics | None = None,
        queue_requests: bool = True,
        lora_autoload_retry_s: float | None = None,
        reasoning: Callable[[str], object | None] = lambda model: None,
    ):
        self._registry = registry
        self._metrics = metrics
        self._models = models  # the served models: tokenizer, template and defaults per model id
        self._tenants = tenants
        self._limits = limits
        self._drain = drain
        self._admission = admission
        self._dispatcher = dispatcher
        self._relay = Relay(registry, models.tokenizer)
        self.decode_pool = DecodePool()  # large request bodies, decoded off the loop (both fronts)
        self._tokenize_pool = TokenizePool(registry=metrics.registry if metrics else None)  # off the loop
        self._token_api = TokenApi(models, registry, limits)  # Tokenize / Detokenize
        counter = metrics.grammar_compiles if metrics else None  # llm_router_grammar_compiles_total
        self._grammars = GrammarCompiler.from_limits(
            limits, counter
        )  # response_format: budget, cache, shares
        self._queue_requests = queue_requests  # False (--no-queue): admit only what a worker can start now
        self.adapters = AdapterAdmin(registry, models, tenants)  # LoRA adapters loaded at run time
        self.autoload = None  # --lora-autoload: adapters loaded on demand (router/lora_autoload.py)
        if lora_autoload_retry_s is not None:
            counter = metrics.lora_autoloads if metrics else None
            self.autoload = Autoloader(self.adapters, lora_autoload_retry_s, counter)
        # model id -> its reasoning mode (router/openai/reasoning.py), None for most: a reasoning
        # model's structured output holds after its think block (common.structured.after_thinking)
        self._reasoning = reasoning

    async def Generate(self, request: pb.GenerateRequest, context):
        obs = RequestObservation(self._metrics, context.invocation_metadata())
        try:
            async with aclosing(self.generate(request, context, obs)) as responses:
                async for response in responses:
                    yield response
        except BaseException as exc:  # observed, then handled by ErrorInterceptor
            obs.fail(exc)
            raise
        finally:
            obs.finish()

    def tenant_of(self, context):
        """The tenant a call's key names (AuthError otherwise): the limits a front that fans one
        request out into several calls sizes itself to (router/openai/embeddings.py)."""
        return self._tenants.current.authenticate(context.invocation_metadata() or (), context.peer())

    async def gate_message(self, method: str, raw: bytes, context, deserialize):
        """The gRPC front's gate (router/errors.py `ErrorInterceptor`), before the message is
        parsed: `gate` (a wrong key costs no parse; a throttled tenant is refused), then, for a
        large Generate message, its counts checked in the decode pool (a million logit_bias
        entries take ~0.3 s to parse: not on the event loop), then the parse."""
        tenant = self.gate(context, observe_as="grpc" if method.endswith("/Generate") else None)
        if method.endswith("/Generate"):
            try:
                problem = await self.decode_pool.run(
                    tenant.name, len(raw), message_problem, raw, self._limits
                )
            except Busy as exc:
                raise Unavailable(str(exc)) from None
            if problem is not None:
                raise ValidationError(*problem)
        return deserialize(raw)

    def close(self) -> None:
        """Stops the processes it started (body decoding, grammar compiles)."""
        self.decode_pool.close()
        self._grammars.close()

    def gate(self, context, observe_as: str | None = None):
        """What a front checks before it reads a request's body: the key (AuthError) and the
        refusals that need nothing but the tenant (request rate, concurrency, queue caps: 429),
        taking nothing (each generation claims its own). -> the tenant. `observe_as` ("grpc",
        "http"): a generation's front; its refusal here is observed as a request (its span, log
        line and metrics), as one refused later in the pipeline is."""
        try:
            tenant = self.tenant_of(context)
            try:
                self._admission.gate(tenant, OUTPUT_COST * self._limits.default_max_tokens)
            except AdmissionError as err:
                raise Overloaded(err.message, err.retry_after_ms) from None
        except Exception as exc:
            if observe_as is not None:
                obs = RequestObservation(self._metrics, context.invocation_metadata(), protocol=observe_as)
                obs.stage("auth")
                obs.fail(exc)
                obs.finish()
            raise
        return tenant

    async def generate(
        self, request: pb.GenerateRequest, context, obs: RequestObservation, choice: ChoiceOf | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The pipeline of one Generate call, for every front (`Generate` for gRPC; the HTTP front,
        router/openai/app.py): drain check, auth, validation, admission, fair queue, relay. ->
        `GenerateResponse`s (chunks, then one `Finished`); raises `router.errors` exceptions.
        `context`: what it reads of a gRPC context (`invocation_metadata()`, `peer()`,
        `time_remaining()`); `obs`: the caller's `RequestObservation`, which it stages and labels
        (the caller records the failure and finishes it); `choice`: one of several choices of
        `request` (OpenAI `n`) that share its preparation."""
        arrival_s = time.monotonic()
        self._drain.enter()
        try:
            naming = self.autoload.naming(request.model) if self.autoload else contextlib.nullcontext()
            with naming:
                inner = self._generate_inner(request, context, obs, arrival_s, choice)
                async with aclosing(inner):
                    async for response in inner:
                        yield response
        finally:
            self._drain.exit()

    async def _generate_inner(self, request: pb.GenerateRequest, context, obs, arrival_s: float, choice):
        obs.stage("auth")
        tenant = self.tenant_of(context)
        obs.stage("validate")
        obs.response_format = request.response_format.WhichOneof("kind")
        obs.tools = len(request.chat.tools) if request.HasField("chat") else 0
        models = self._registry.models()
        if not models:
            raise Unavailable("no healthy worker is connected to this router")
        deadline_s = tenant.deadline_at(arrival_s, context.time_remaining())  # tenant default / cap
        models, claim = await self._autoload(request.model, tenant, models, deadline_s)
        # the tenant's rate and concurrency are charged before any work that grows with the request
        # (validation, grammar compiles, template rendering, tokenizing): a throttled tenant costs O(1)
        claim = claim or self._claim(tenant, request)
        try:
            self._check_model(request.model, models)
            if choice is None:
                req, prompt_ids, max_tokens = await self._prepare(request, tenant, models)
            else:  # the first of the choices prepares, the others wait for it
                req, prompt_ids, max_tokens = await choice.fanout.once(
                    lambda: self._prepare(request, tenant, models)
                )
                req = choice.applied(req, self._limits)
            obs.model = req.model.name
            self._refuse_when_full(tenant, req)
        except BaseException:
            claim.release()
            raise
        obs.request(
            req.request_id,
            tenant.name,
            req.model.name,
            len(prompt_ids),
            max_tokens,
            req.temperature,
            req.top_p,
        )
        salt = f"{tenant.name}\x1f{req.model.name}" if req.model.base else tenant.name  # LoRA: its own KV
        pending = Pending(req.model.name, prefix_hashes(prompt_ids, salt))
        obs.stage("admission")
        try:
            ticket = self._admission.admit(
                tenant,
                len(prompt_ids),
                max_tokens,
                priority=req.priority,
                deadline_s=deadline_s,
                payload=pending,
                claim=claim,
            )
        except AdmissionError as err:  # DEADLINE_EXCEEDED for a deadline it cannot meet
            raise err.router_error() from None
        # placed now where a worker has room: a burst admitted in one turn would otherwise count
        # itself as queued (tenant_queue_full on an idle worker) until the dispatcher's next turn
        self._dispatcher.dispatch_ready()
        if not self._queue_requests and not pending.future.done():  # no room now: refuse, no queue
            pending.discard()
            ticket.refused()  # it took nothing: its tokens/min go back
            full = "no worker has room for this request now (the router does not queue: --no-queue)"
            err = self._admission.refuse(tenant, "no_capacity", ticket.item.max_cost, full)
            raise Overloaded(err.message, err.retry_after_ms)
        num_out, placed, failed = 0, False, False
        try:
            obs.stage("queue")
            placement = await self._dispatcher.wait_placed(pending, deadline_s, time.monotonic())
            placed = placement is not None
            obs.stage("route", worker=placement.worker.address if placement else None)
            events = self._relay.run(
                req,
                prompt_ids,
                max_tokens,
                tenant,
                arrival_s,
                deadline_s,
                placement,
                retry=lambda tried: self._dispatcher.place_retry(ticket.item, tried),
                metadata=obs.metadata,
            )
            async with aclosing(events):  # closing the call closes the worker stream at once
                async for event in events:
                    if isinstance(event, Chunk):
                        num_out += len(event.token_ids)
                    obs.event(event)
                    yield _to_pb(event)
        except DeadlineExceeded:
            raise  # the client's deadline, like its cancel: charged once a worker took the prompt
        except Exception:
            failed = num_out == 0  # the service's failure before any output (no worker, all failed)
            raise
        finally:
            pending.discard()
            # what never reached a worker, or failed before any output, takes no tokens/min
            ticket.release(num_output_tokens=num_out, refund_prompt=not placed or failed)

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        self._drain.enter()
        try:
            tenant = self._tenants.current.authenticate(context.invocation_metadata() or (), context.peer())
            cards = []
            for name, spec in sorted(self._registry.models().items()):
                if spec.base and not tenant.may_use(name):  # an adapter outside its `adapters` list
                    continue
                cards.append(
                    pb.ModelCard(
                        id=name,
                        max_model_len=spec.max_model_len,
                        num_workers=len(self._registry.healthy(name)),
                        parent=spec.base,
                    )
                )
            return pb.ListModelsResponse(models=cards)
        finally:
            self._drain.exit()

    async def LoadLoraAdapter(self, request: pb.LoraAdapterRequest, context) -> pb.LoraAdapterReply:
        return await self._admin_call(self.adapters.load, request, context)

    async def UnloadLoraAdapter(self, request: pb.LoraAdapterRequest, context) -> pb.LoraAdapterReply:
        return await self._admin_call(self.adapters.unload, request, context)

    async def _admin_call(self, call, request, context):
        self._drain.enter()
        try:
            return await call(request, context)
        finally:
            self._drain.exit()

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        return await self._token_call(self._token_api.tokenize, request, context)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        return await self._token_call(self._token_api.detokenize, request, context)

    async def _token_call(self, call, request, context):
        """Tokenize / Detokenize behind the tenant's key and admission claim (request rate and
        concurrency, as Generate's before it tokenizes), in the token API's own pool."""
        self._drain.enter()
        try:
            tenant = self._tenants.current.authenticate(context.invocation_metadata() or (), context.peer())
            try:
                claim = self._admission.claim(tenant, 0.0)
            except AdmissionError as err:
                raise Overloaded(err.message, err.retry_after_ms) from None
            try:
                return await call(request)
            finally:
                claim.release()
        finally:
            self._drain.exit()

    def _check_model(self, name: str, healthy: dict) -> None:
        """`model` names one this router serves (INVALID_ARGUMENT listing them otherwise), and one
        with a healthy worker that agrees on its tokenizer (else UNAVAILABLE)."""
        served = self._models.ids()
        if name and self._models.get(name) is None:
            raise ValidationError("model", f"unknown model {name!r}; this router serves {served}")
        if not name and len(served) > 1:
            raise ValidationError("model", f"required: this router serves several models, {served}")
        name = name or served[0]
        if name not in healthy:
            raise Unavailable(f"no healthy worker with a matching tokenizer serves model {name!r}")

    def _refuse_hopeless_text(self, req: ValidRequest) -> None:
        """A text too long to fit the context whatever its tokens is refused without tokenizing it
        (tokenizing 1M characters costs the router up to seconds of CPU)."""
        per_token = self._models.tokenizer(req.model.name).max_chars_per_token
        if per_token is None or req.prompt_token_ids is not None:
            return
        field, chars = (
            ("chat.messages", req.chat_chars) if req.chat is not None else ("prompt", len(req.prompt))
        )
        if chars > req.model.max_model_len * per_token:  # a context overflow: context_length_exceeded
            raise context_exceeded(field, req.model.max_model_len, chars=chars, chars_per_token=per_token)

    async def _autoload(self, name: str, tenant, models: dict, deadline_s: float | None):
        """A model to load on demand (router/lora_autoload.py) claims the request first (rate, caps,
        open while it waits): a tenant over its limits causes no load. -> (served models, claim).
        Any model but a base model is a LoRA adapter, checked first against the tenant's
        `adapters` patterns (PERMISSION_DENIED, with or without --lora-autoload)."""
        if name and tenant.adapters is not None and name not in self._models.ids():
            tenant.check_adapter(name)
        if not (self.autoload and self.autoload.would_load(name, models)):
            return models, None
        try:
            claim = self._admission.claim(tenant, OUTPUT_COST * self._limits.default_max_tokens)
        except AdmissionError as err:
            raise Overloaded(err.message, err.retry_after_ms) from None
        try:
            if await self.autoload.ensure(name, models, deadline_s, tenant):
                models = self._registry.models()
        except BaseException:
            claim.release()
            raise
        return models, claim

    def _claim(self, tenant, request: pb.GenerateRequest) -> Claim:
        """The refusals that need nothing of the request but its tenant (request rate, concurrency,
        queue caps), before any work on it; the request then counts as open until it ends."""
        asked = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else 0
        cost = OUTPUT_COST * min(asked or self._limits.default_max_tokens, MAX_COST_TOKENS)
        try:
            return self._admission.claim(tenant, cost)
        except AdmissionError as err:
            raise Overloaded(err.message, err.retry_after_ms) from None

    def _refuse_when_full(self, tenant, req: ValidRequest) -> None:
        """--no-queue: a request no worker can start now is refused before it is tokenized."""
        if self._queue_requests or self._dispatcher.can_start_now(req.model.name):
            return
        cost = OUTPUT_COST * (req.max_tokens or self._limits.default_max_tokens)
        busy = "every worker is busy (the router does not queue: --no-queue)"
        err = self._admission.refuse(tenant, "no_capacity", cost, busy)
        raise Overloaded(err.message, err.retry_after_ms)

    async def _prepare(self, request: pb.GenerateRequest, tenant, models: dict):
        """validate (and compile a grammar) -> the model's defaults -> the tenant's priority ->
        tokenize -> fit to the context. -> (ValidRequest, prompt ids, max_tokens)."""
        if len(request.chat.messages) > INLINE_MESSAGES or request.ByteSize() > INLINE_BYTES:  # off the loop
            check = functools.partial(validate, request, self._limits, models, compile_grammar=False)
            req = await asyncio.get_running_loop().run_in_executor(_VALIDATION, check)
        else:
            req = validate(request, self._limits, models, compile_grammar=False)
        # the format's grammar: in the compile processes, within a budget (router/grammar_compile.py)
        req = await compile_response_format(req, self._grammars, tenant.name)
        req = self._models.apply_defaults(req, request.sampling)  # the model's own, where unset
        req = dataclasses.replace(req, priority=req.priority or tenant.default_priority)
        tenant.check_priority(req.priority)  # PERMISSION_DENIED above the tenant's max_priority
        self._refuse_hopeless_text(req)
        prompt_ids = await self._tokenize_pool.run(self._tokenize, req)
        max_tokens = fit_to_context(req, len(prompt_ids), self._limits)
        if req.grammar and (mode := self._reasoning(req.model.name)) is not None:
            req = await after_think_block(req, mode, prompt_ids, self._grammars, tenant.name)
        return req, prompt_ids, max_tokens

    def _tokenize(self, req: ValidRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        tokenizer = self._models.tokenizer(req.model.name)
        if req.chat is not None:
            try:
                limit = self._limits.max_prompt_chars
                return tokenizer.encode_chat(
                    list(req.chat),
                    tools=list(req.tools),
                    max_chars=limit,
                    # control-token text in messages stays text unless the operator opted out
                    parse_special_in_messages=self._limits.parse_special_tokens_in_messages,
                )
            # the template refused these messages (TypeError: one that adds a string and an object;
            # RecursionError: tools nested as deep as validation allows, written by a recursive template)
            except (ValueError, TypeError, RecursionError, jinja2.TemplateError) as exc:
                raise ValidationError("chat.messages", str(exc)) from None
        return tokenizer.encode(req.prompt, add_special_tokens=True)  # the model's BOS, if it adds one
