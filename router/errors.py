"""Errors in one place: domain exceptions and the interceptor that maps them to gRPC status.

Contract
- input: any exception raised by a servicer method of the router.
- output: the call ends with the exception's gRPC status code and message, with every network
  address in the message replaced by "<worker>" (the full message is logged); `Overloaded` also
  carries trailing metadata `retry-after-ms`. A stream whose client takes no response for the
  idle timeout ends DEADLINE_EXCEEDED. Anything unexpected becomes INTERNAL (logged), so a
  handled case never surfaces as UNKNOWN. Request bytes that do not parse as the method's message
  become INVALID_ARGUMENT `request: ...` (grpc itself would answer UNKNOWN).
- state: none.
- proven by: tests/test_router_errors.py (mapping), tests/test_trust_streams.py (idle timeout),
  tests/test_trust_limits.py (no address, never INTERNAL, for heterogeneous workers),
  tests/test_grpc_e2e.py (invalid-request table) (end to end),
  tests/test_fuzz_e2e.py (hostile requests and raw bytes end to end: never UNKNOWN or INTERNAL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from contextlib import aclosing

import grpc

log = logging.getLogger(__name__)


class RouterError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class ValidationError(RouterError):
    """A request field is invalid; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    openai_code: str | None = None  # the HTTP error object's `code` (router/openai/app.py)

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class ContextLengthExceeded(ValidationError):
    """The prompt, or the prompt and max_tokens, cannot fit the model's context. gRPC: still
    INVALID_ARGUMENT; the HTTP front answers OpenAI's `code: "context_length_exceeded"`, which
    clients (LangChain, LiteLLM, agents that trim their history) test for, and the message carries
    OpenAI's wording ("This model's maximum context length is N tokens. However, ...").
    Build one with `context_exceeded`."""

    openai_code = "context_length_exceeded"


def context_exceeded(
    field: str,
    context: int,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
    chars: int | None = None,
    chars_per_token: int | None = None,
    noun: str = "",
) -> ContextLengthExceeded:
    """OpenAI's wording for each case: the prompt alone (`prompt_tokens`), the prompt plus
    `max_tokens`, `max_tokens` alone before tokenizing (`prompt_tokens` None: at least one prompt
    token), or a text longer than the context could hold whatever its tokens (`chars`, with at
    most `chars_per_token` characters a token). `noun`: what the prompt is called, by default
    "messages" for a chat field and "prompt" for the rest."""
    noun = noun or ("messages" if field.startswith("chat") else "prompt")
    head = f"This model's maximum context length is {context} tokens. However, "
    if chars is not None:
        problem = (
            f"{chars} characters of {noun} cannot fit in {context} tokens (a token covers at most "
            f"{chars_per_token} characters). Please reduce the length of the {noun}."
        )
    elif max_tokens is None:
        room = ", leaving no room for the completion" if prompt_tokens == context else ""
        problem = (
            f"your {noun} resulted in {prompt_tokens} tokens{room}. Please reduce the length of the {noun}."
        )
    elif prompt_tokens is None:
        problem = (
            f"you requested at least {max_tokens + 1} tokens ({max_tokens} in the completion, at least 1 "
            "in the input). Please reduce the length of the completion."
        )
    else:
        problem = (
            f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {noun}, "
            f"{max_tokens} in the completion). Please reduce the length of the {noun} or completion."
        )
    return ContextLengthExceeded(field, head + problem)


class AuthError(RouterError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(RouterError):
    """No healthy worker, the router is draining, or a worker was lost mid-stream."""

    code = grpc.StatusCode.UNAVAILABLE


class RequestFailed(RouterError):
    """Workers failed the request with an internal error before its first token, on every worker
    it was tried on (router/relay.py): it may be the request that triggers a worker bug, so it is
    not tried on more and the client sees INTERNAL, not a status that invites a retry."""


class DeadlineExceeded(RouterError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StreamIdle(DeadlineExceeded):
    """The client took no response for the stream idle timeout."""


class PermissionDenied(RouterError):
    """The tenant is not allowed what the request asks (e.g. a priority above its max_priority)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class WorkerRejected(RouterError):
    """A worker refused the request with a status that is not the worker's fault. The client sees
    INVALID_ARGUMENT for the request's own faults and UNAVAILABLE for the rest (a worker that
    refuses the router's credentials, say): never INTERNAL."""

    CLIENT_FAULTS = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    )

    def __init__(self, worker_code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = (
            grpc.StatusCode.INVALID_ARGUMENT
            if worker_code in self.CLIENT_FAULTS
            else grpc.StatusCode.UNAVAILABLE
        )


class Overloaded(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", str(self.retry_after_ms)),)


# host:port and bare IP addresses (IPv4, bracketed IPv6, gRPC's URL-encoded "ipv6:%5B::1%5D:50051",
# names with a port, underscores included as in docker-compose service names): what a worker's
# address looks like in an internal message.
_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?"
    r"|%5B[0-9A-Fa-f:.%]*%5D(?::\d+)?"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
    r"|(?<![\w.-])[A-Za-z0-9_][\w.-]*:\d{2,5}\b(?![.\d])"
)


def scrub_addresses(message: str) -> str:
    """The message with every network address replaced by "<worker>": internal addresses are for
    the router's log, never for clients."""
    return _ADDRESS.sub("<worker>", message)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    if isinstance(exc, RouterError):
        message = scrub_addresses(exc.message)
        if message != exc.message:
            log.info("%s (sent to the client as: %s)", exc.message, message)
        return exc.code, message, exc.trailing_metadata()
    log.exception("unhandled error in router", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", ()


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can answer for it."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    if deserializer is None:
        return None

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Undecodable(exc)

    return deserialize


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise ValidationError("request", f"not a valid protobuf message ({type(request.error).__name__})")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message, trailing = status_of(exc)
    if context.done():
        return  # the client's deadline or cancel already ended the call: no status to send
    try:
        await context.abort(code, message, trailing_metadata=trailing)
    except grpc.aio.AbortError:
        raise
    except Exception as send_error:  # noqa: BLE001
        # The call ended (deadline, cancel) between the check above and the send: grpc's core
        # refuses the status batch (ExecuteBatchError). Anything else is a real failure.
        if type(send_error).__name__ != "ExecuteBatchError" and not context.done():
            raise


# The calls whose message a tenant sends: checked by the interceptor's gate before they are parsed
GATED = frozenset(
    {"/llm.v1.Generation/Generate", "/llm.v1.Generation/Tokenize", "/llm.v1.Generation/Detokenize"}
)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary-unary and unary-stream handler so domain errors become statuses; each
    streamed response must be taken by the client within `stream_idle_timeout_s` (0: no limit),
    else the call ends DEADLINE_EXCEEDED and the handler's generator is closed, which releases
    everything the request held (worker sequence, KV reservation, admission ticket)."""

    def __init__(self, stream_idle_timeout_s: float = 0.0, gate=None):
        self._idle_s = stream_idle_timeout_s or None
        # `gate(method, raw, context, deserialize)` -> the request: the service's checks before a
        # message of GATED is parsed (the key, the tenant's rate; a large one's counts off the
        # loop: router/service.py `gate_message`); given by the server, which builds the service first
        self.gate = gate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/llm.v1."):
            return handler  # health and reflection handle their own errors
        deserializer = _lenient(handler.request_deserializer)
        gate = self.gate if method in GATED else None

        async def decoded(request, context):
            """The request: parsed by grpc, or (gated) raw bytes the gate checks, then parses."""
            if gate is not None:
                request = await gate(method, request, context, deserializer)
            _check_decoded(request)
            return request

        wire_deserializer = None if gate is not None else deserializer  # None: grpc hands the raw bytes
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    request = await decoded(request, context)
                    return await inner(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # noqa: BLE001 - this is the one mapping point
                    await _abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, wire_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            idle_s = self._idle_s

            async def unary_stream(request, context):
                # context.write instead of yield: a write that the client's flow control holds
                # back longer than idle_s is a stalled reader (one that never reads keeps its
                # stream's window full), which must not hold a worker slot forever.
                try:
                    request = await decoded(request, context)
                    async with aclosing(inner_stream(request, context)) as responses:
                        async for response in responses:
                            try:
                                async with asyncio.timeout(idle_s):
                                    await context.write(response)
                            except TimeoutError:
                                idle = StreamIdle(f"stream idle: no response taken for {idle_s:g} s")
                                with contextlib.suppress(StreamIdle):  # the handler observes it, then ends
                                    await responses.athrow(idle)
                                raise idle from None
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # noqa: BLE001 - this is the one mapping point
                    await _abort(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, wire_deserializer, handler.response_serializer
            )
        return handler
