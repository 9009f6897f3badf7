"""Router -> worker authentication by a per-deployment shared token.

Contract
- input: the token (`new_token()` makes one: 256 random bits, URL-safe text), given to the worker
  and to its routers as `--worker-token` / `LLM_WORKER_TOKEN` (the variable is preferred: a flag
  shows in `ps`). The launchers make one per deployment (deploy/local.py, deploy/ray_launch.py);
  on Kubernetes it is the `llm-worker-token` Secret (deploy/kuberay/).
- worker side: `TokenServerInterceptor(token)` admits a call to a protected method
  (`/llm.v1.Worker/*`) only with metadata `x-llm-worker-token: <token>`, compared in constant time
  (sha256 digests, so the length is not revealed either); any other call ends UNAUTHENTICATED
  "worker token missing or invalid" before the servicer runs (it names neither the expected nor the
  presented token). grpc.health.v1 and reflection stay open: they reveal only serving status and
  the schema, and Kubernetes' gRPC probes cannot send metadata.
- router side: `token_client_interceptors(token)` -> aio client interceptors that add the token to
  every unary-unary and unary-stream call on a worker channel (Generate, GetInfo, GetLoad).
- state: none beyond the token's digest.
- failure modes: an empty token is refused (ValueError) so that "auth on" never means "any token".
- proven by: tests/test_trust_auth.py (direct calls without or with a wrong token: UNAUTHENTICATED,
  for `python -m worker` and for workers the Ray launcher starts; the router's own calls pass).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import grpc

METADATA_KEY = "x-llm-worker-token"
PROTECTED_PREFIX = "/llm.v1.Worker/"
REFUSAL = "worker token missing or invalid: only this deployment's routers may call a worker"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _digest(value: str | bytes) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    return hashlib.sha256(value).digest()


def check_token(token: str | None) -> None:
    if token is not None and not token.strip():
        raise ValueError("worker token must not be empty (unset it to turn worker authentication off)")


def presented_token_ok(metadata, expected_digest: bytes) -> bool:
    """Exactly one token entry, equal to the expected one (constant-time compare of digests)."""
    values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
    if len(values) != 1:
        return False
    return hmac.compare_digest(_digest(values[0]), expected_digest)


def _refuse_unary(request, context):
    return context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


async def _refuse_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    yield  # pragma: no cover - abort raises; this only makes the function a generator


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, protected_prefix: str = PROTECTED_PREFIX):
        check_token(token)
        self._digest = _digest(token)
        self._prefix = protected_prefix

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if presented_token_ok(handler_call_details.invocation_metadata, self._digest):
            return handler
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _refuse_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _refuse_unary, handler.request_deserializer, handler.response_serializer
            )
        raise RuntimeError(f"{handler_call_details.method}: streaming requests are not protected here")


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY]
    metadata.append((METADATA_KEY, token))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._token), request)


def token_client_interceptors(token: str | None) -> tuple:
    """Interceptors for a worker channel (none when `token` is None: authentication off)."""
    if token is None:
        return ()
    check_token(token)
    return (_UnaryUnary(token), _UnaryStream(token))
