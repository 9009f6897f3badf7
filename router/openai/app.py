"""The FastAPI application: POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings
(router/openai/embeddings.py), POST /v1/responses (router/openai/responses_api.py), GET /v1/models
(and /v1/models/{id}), POST /tokenize and /detokenize (router/openai/tokens.py).

Contract
- input: OpenAI JSON over HTTP; `Authorization: Bearer <key>` (the same tenants and keys as
  gRPC), optional `X-Request-Id`, W3C `traceparent`. `GET /health` (no key): 200 while the
  router's gRPC health is SERVING (a healthy worker, not draining), else 503.
- output: OpenAI JSON, or server-sent events with `stream: true` (router/openai/responses.py).
  Each request runs the gRPC pipeline itself, `GenerationService.generate` (auth, validation,
  admission, fair queue, relay), with `HttpCallContext` standing in for the gRPC context, under a
  `RequestObservation` labelled protocol="http" (the same spans, metrics and log line).
- failure modes: one OpenAI error object per failure, its status from the domain error: invalid
  -> 400 naming the OpenAI parameter, bad or missing key -> 401, refused by admission -> 429 with
  `Retry-After` (seconds, rounded up) and `retry-after-ms`, no worker or draining -> 503, deadline
  -> 504, a body over --max-message-mb -> 413, anything unexpected -> 500 (logged; the client sees
  only the exception's type). Worker addresses in a message become "<worker>" (as for gRPC). A
  stream's first event is awaited before the status line is sent, so a refusal is a status, not an
  event; a failure after that is an `error` event then [DONE]. Several choices (`n`, a batch of
  prompts) are one pipeline call each (router/openai/choices.py): every call's first event is
  awaited before the answer starts, a refusal or failure of any before then is the answer's
  status (the others are cancelled), and a failure of any later ends the stream with an `error`
  event.
  A client that disconnects (while queued, while streaming, or while waiting for a whole
  response) cancels the call: the worker stream is cancelled and its KV blocks freed.
- state: none of its own.
- proven by: tests/test_openai_e2e.py (the openai SDK against real router and worker processes),
  tests/test_openai_serving_e2e.py (503, drain, HTTPS, a client gone while queued),
  tests/test_openai_requests.py (error mapping, call context, body limits).
"""

from __future__ import annotations

import functools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from protos.llm.v1 import generation_pb2 as pb
from router.config import Limits
from router.decode_pool import Busy
from router.errors import Overloaded, RouterError, ValidationError, scrub_addresses
from router.fanout import ChoiceOf, Fanout
from router.metrics import RouterMetrics
from router.observe import RequestObservation
from router.openai import embeddings, responses_api, tokens
from router.openai.choices import Choices
from router.openai.http import (
    ClientGone,
    EventStream,
    Outbound,
    decoded,
    json_answer,
    read_body,
    until_disconnected,
)
from router.openai.reasoning import Reasoning
from router.openai.requests import ApiError, Parsed, param_of, parse
from router.openai.responses import Chunk, Done, Responder

log = logging.getLogger(__name__)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
TRACE_HEADERS = ("traceparent", "tracestate")


class HttpCallContext:
    """What `GenerationService` reads of a gRPC context, from an HTTP request."""

    def __init__(self, request: Request):
        metadata = [("authorization", v) for v in request.headers.getlist("authorization")]
        metadata += [(k, request.headers[k]) for k in TRACE_HEADERS if k in request.headers]
        self._metadata = tuple(metadata)
        host, port = request.client or ("", 0)
        self._peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None  # HTTP carries no deadline: the client's disconnect cancels instead


def api_error(exc: BaseException, parsed: Parsed | None) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        param = param_of(exc.field, parsed)
        problem = exc.message.split(": ", 1)[1] if ": " in exc.message else exc.message
        if exc.field == "model" and problem.startswith("unknown model"):  # OpenAI's and vLLM's 404
            return ApiError(404, f"{param}: {problem}", param=param, code="model_not_found")
        # OpenAI's code where the error has one: context_length_exceeded for a prompt (or prompt +
        # max_tokens) the context cannot hold, which clients test for before trimming a history
        # (router/errors.py ContextLengthExceeded)
        return ApiError(400, f"{param}: {problem}", param=param, code=exc.openai_code)
    if isinstance(exc, RouterError):
        status, kind = STATUS.get(exc.code, (500, "internal_error"))
        headers = {}
        if isinstance(exc, Overloaded):
            headers = {
                "Retry-After": str(max(1, math.ceil(exc.retry_after_ms / 1000))),
                "retry-after-ms": str(exc.retry_after_ms),
            }
        code = "invalid_api_key" if status == 401 else None
        message = scrub_addresses(exc.message)  # worker addresses are for the log, not for clients
        if message != exc.message:
            log.info("%s (sent to the client as: %s)", exc.message, message)
        return ApiError(status, message, type_=kind, code=code, headers=headers)
    log.exception("unhandled error in the HTTP front", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type_="internal_error")


def error_response(err: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = dict(err.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def create_app(
    service,
    models: Callable[[], dict],
    metrics: RouterMetrics | None,
    decoder: Callable[[str], Callable[[list[int]], str]],
    max_body_bytes: int,
    stream_idle_timeout_s: float = 0.0,
    serving: Callable[[], bool] = lambda: True,
    reasoning: Callable[[str], Reasoning | None] = lambda model: None,
    limits: Limits = Limits(),
    max_streams_per_tenant: int = 0,
    max_unsent_mb_per_tenant: float = 0.0,
) -> FastAPI:
    """`service`: the router's `GenerationService`; `models()`: the served models (name -> spec);
    `decoder(model)`: token ids -> text under that model's tokenizer (logprobs, echo);
    `reasoning(model)`: how a reasoning model's chat answers split (router/openai/reasoning.py);
    `stream_idle_timeout_s`: a stream whose client takes nothing that long is closed (0 = never);
    `serving()`: the gRPC health of "" (GET /health answers it over HTTP); `limits`: the router's
    request limits, whose counts are checked on the JSON before any protobuf is built;
    `max_streams_per_tenant`, `max_unsent_mb_per_tenant`: a tenant's open SSE streams and unread
    whole answers at most (router/openai/http.py `Outbound`; 0 = no cap)."""
    app = FastAPI(
        title="llm-serve router (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None
    )
    bodies = service.decode_pool  # large bodies decoded off the loop (router/decode_pool.py)
    outbound = Outbound(max_streams_per_tenant, int(max_unsent_mb_per_tenant * 1e6))
    app.state.outbound = outbound

    async def body_of(request: Request, then: Callable, *args, generation: bool = True):
        """The key first (401 before a byte of the body is read), then the refusals that need
        nothing but the tenant (429: request rate, concurrency, queue caps), then the body, read up
        to its limit and decoded and parsed by `then(json, *args)` (large bodies off the loop).
        `generation`: a refusal here is observed as a request (span, log line, metrics).
        -> (the call context, the tenant's name, the parse)."""
        ctx = HttpCallContext(request)
        tenant = service.gate(ctx, observe_as="http" if generation else None).name
        outbound.check(tenant)  # its clients' unread answers
        body = await read_body(request, max_body_bytes)
        try:
            return ctx, tenant, await bodies.run(tenant, len(body), decoded, body, then, args)
        except Busy as exc:
            raise ApiError(503, str(exc), type_="service_unavailable") from None

    def answer_name(requested: str) -> str:
        """The model name an answer shows: the request's, or the one served when it left it empty."""
        bases = [name for name, spec in models().items() if not spec.base]  # LoRA adapters are named
        return requested or (bases[0] if len(bases) == 1 else "")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown paths (404) and methods (405) get OpenAI error objects too."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            ApiError(exc.status_code, message, type_=kind).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def observed(
        request: pb.GenerateRequest, ctx: HttpCallContext, choice: ChoiceOf | None = None
    ) -> AsyncIterator[Chunk | Done]:
        """The gRPC pipeline's responses, unwrapped: `TokenChunk`s, then one `Finished`."""
        obs = RequestObservation(metrics, ctx.invocation_metadata(), protocol="http")
        try:
            async with aclosing(service.generate(request, ctx, obs, choice)) as events:
                async for response in events:
                    yield getattr(response, response.WhichOneof("kind"))
        except BaseException as exc:  # observed here, answered by the caller
            obs.fail(exc)
            raise
        finally:
            obs.finish()

    def choice_calls(parsed: Parsed, ctx: HttpCallContext) -> list[AsyncIterator[Chunk | Done]]:
        """One pipeline call per choice; several share one preparation (`Fanout`: validated,
        compiled and tokenized once, not once per choice)."""
        if len(parsed.choices) == 1:
            return [observed(parsed.request, ctx)]
        fanouts = [Fanout() for _ in parsed.prompt_requests]
        return [
            observed(
                parsed.request_of(c.index), ctx, ChoiceOf(fanouts[c.prompt], c.request_id, c.seed_offset)
            )
            for c in parsed.choices
        ]

    async def generate(request: Request, chat: bool) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        parsed = None
        try:
            ctx, tenant, parsed = await body_of(request, parse, chat, request_id, limits)
            name = answer_name(parsed.request.model)
            end_stream = outbound.open_stream(tenant) if parsed.stream else None
            calls = Choices(choice_calls(parsed, ctx))
            streaming = False
            try:
                await until_disconnected(request, calls.start())
                # validated: the model is served; texts are needed only for logprobs and echo
                need = parsed.logprobs or parsed.echo
                responder = Responder(parsed, name, decoder(name) if need else str, reasoning(name))
                if parsed.stream:
                    streaming = True  # from here the response closes `calls`, however it ends
                    return EventStream(
                        _stream(responder, calls),
                        {"x-request-id": request_id},
                        calls,
                        stream_idle_timeout_s,
                        on_end=end_stream,
                    )
                collected = await until_disconnected(request, _collected(calls))
                return await until_disconnected(
                    request,
                    json_answer(
                        lambda: responder.complete(collected),
                        _entries(collected, parsed.top_logprobs if parsed.logprobs else -1),
                        {"x-request-id": request_id},
                        functools.partial(outbound.owe, tenant),
                    ),
                )
            finally:
                if not streaming:
                    await calls.aclose()  # closes the worker calls if anything above stopped early
                    if end_stream is not None:
                        end_stream()
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except Exception as exc:  # noqa: BLE001 - the one mapping point of the HTTP front
            return error_response(api_error(exc, parsed), request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            ctx, _, parsed = await body_of(request, embeddings.parse_embeddings, request_id)
            name = answer_name(parsed.model)
            limit = embeddings.in_flight(service.tenant_of(ctx), len(parsed.requests))
            work = embeddings.embed(lambda r: observed(r, ctx), parsed, limit)
            results = await until_disconnected(request, work)
            vectors = await embeddings.checked(parsed, results)
            body = embeddings.answer(parsed, name, vectors, sum(n for _, n in results))
            headers = {"x-request-id": request_id}
            return StreamingResponse(body, media_type="application/json", headers=headers)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - the one mapping point of the HTTP front
            return error_response(api_error(exc, None), request_id)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API over the chat pipeline (router/openai/responses_api.py)."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        parsed = None
        try:
            ctx, tenant, parsed = await body_of(request, responses_api.parse_responses, request_id)
            name = answer_name(parsed.request.model)
            end_stream = outbound.open_stream(tenant) if parsed.stream else None
            calls = Choices(choice_calls(parsed, ctx))
            streaming = False
            try:
                await until_disconnected(request, calls.start())
                builder = responses_api.ResponseBuilder(parsed, name, reasoning(name))
                headers = {"x-request-id": request_id}
                if parsed.stream:
                    streaming = True  # from here the response closes `calls`, however it ends
                    body = builder.stream(calls.events(), lambda exc: api_error(exc, parsed))
                    return EventStream(body, headers, calls, stream_idle_timeout_s, on_end=end_stream)
                collected = await until_disconnected(request, _collected(calls))
                [(chunks, done)] = collected
                entries = _entries(collected, parsed.top_logprobs if parsed.logprobs else -1)
                owe = functools.partial(outbound.owe, tenant)
                return await json_answer(lambda: builder.whole(chunks, done), entries, headers, owe)
            finally:
                if not streaming:
                    if end_stream is not None:
                        end_stream()
                    await calls.aclose()
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - the one mapping point of the HTTP front
            return error_response(api_error(exc, parsed), request_id)

    async def unary(request: Request, read, call, answer) -> Response:
        """/tokenize and /detokenize: the body -> the service's unary call -> the JSON answer."""
        try:
            ctx, _, message = await body_of(request, read, generation=False)
            return JSONResponse(answer(await call(message, ctx)))
        except Exception as exc:  # noqa: BLE001 - the one mapping point of the HTTP front
            return error_response(api_error(exc, None))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await unary(request, tokens.tokenize_request, service.Tokenize, tokens.tokenize_answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await unary(request, tokens.detokenize_request, service.Detokenize, tokens.detokenize_answer)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's body, {"lora_name", "lora_path"} (+ "base_model" when several are served)."""
        return await unary(request, tokens.lora_request, service.LoadLoraAdapter, tokens.lora_answer)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await unary(request, tokens.lora_request, service.UnloadLoraAdapter, tokens.lora_answer)

    @app.get("/health")
    async def health() -> Response:
        """For probes that speak HTTP(S), not gRPC (kubelet with TLS): no API key needed."""
        up = serving()
        return JSONResponse({"status": "SERVING" if up else "NOT_SERVING"}, status_code=200 if up else 503)

    async def model_cards(request: Request) -> list[dict]:
        reply = await service.ListModels(pb.ListModelsRequest(), HttpCallContext(request))
        return [
            {
                "id": card.id,
                "object": "model",
                "created": 0,
                "owned_by": "llm-serve",
                "max_model_len": card.max_model_len,
                **({"parent": card.parent} if card.parent else {}),  # a LoRA adapter: its base model
            }
            for card in reply.models
        ]

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": await model_cards(request)})
        except Exception as exc:  # noqa: BLE001
            return error_response(api_error(exc, None))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> Response:
        """The SDK's `client.models.retrieve(id)` (ids may hold "/": hub ids)."""
        try:
            card = next((c for c in await model_cards(request) if c["id"] == model), None)
        except Exception as exc:  # noqa: BLE001
            return error_response(api_error(exc, None))
        if card is None:
            return error_response(
                ApiError(404, f"model {model!r} is not served here", "model", "not_found_error")
            )
        return JSONResponse(card)

    return app


async def _collected(calls: Choices) -> list[tuple[list[Chunk], Done]]:
    """Every choice's chunks and Finished, in index order."""
    chunks: list[list[Chunk]] = [[] for _ in range(len(calls))]
    dones: list[Done | None] = [None] * len(chunks)
    async with aclosing(calls.events()) as events:
        async for i, event in events:
            if isinstance(event, Done):
                dones[i] = event
            else:
                chunks[i].append(event)
    if any(done is None for done in dones):
        raise RouterError("the generation stream ended without a finish")
    return list(zip(chunks, dones))


def _entries(collected: list[tuple[list[Chunk], Done]], top_logprobs: int) -> int:
    """About how many entries an answer of these chunks holds: its tokens (prompt tokens scored for
    echo included), each with 1 + `top_logprobs` entries when logprobs are asked for (-1: none)."""
    tokens = sum(
        len(c.token_ids) + len(c.prompt_logprobs.token_ids) for chunks, _ in collected for c in chunks
    )
    return tokens * (2 + top_logprobs)


async def _stream(responder: Responder, calls: Choices) -> AsyncIterator[bytes]:
    yield responder.start()
    dones: list[Done | None] = [None] * len(calls)
    try:
        async with aclosing(calls.events()) as events:
            async for i, event in events:
                if isinstance(event, Done):
                    dones[i] = event
                    yield responder.finish_choice(event, i)
                else:
                    yield responder.delta(event, i)
        if any(done is None for done in dones):
            raise RouterError("the generation stream ended without a finish")
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report it in the stream
        err = api_error(exc, responder.parsed)
        yield responder.error(err.status, err.body())
        return
    yield responder.end(dones)
