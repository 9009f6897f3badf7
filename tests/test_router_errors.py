"""ErrorInterceptor: domain errors -> their status codes (never UNKNOWN), retry-after-ms metadata."""

import asyncio

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from router.errors import (
    AuthError,
    DeadlineExceeded,
    ErrorInterceptor,
    Overloaded,
    Unavailable,
    ValidationError,
)

RAISES = {
    "invalid": (
        ValidationError("sampling.top_p", "bad"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.top_p: bad",
    ),
    "auth": (AuthError("invalid API key"), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
    "busy": (Overloaded("queue full", retry_after_ms=250), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    "down": (Unavailable("no healthy worker"), grpc.StatusCode.UNAVAILABLE, "no healthy worker"),
    "late": (DeadlineExceeded("too late"), grpc.StatusCode.DEADLINE_EXCEEDED, "too late"),
    "bug": (ZeroDivisionError("x"), grpc.StatusCode.INTERNAL, "internal error: ZeroDivisionError"),
}


class Raising(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        yield pb.GenerateResponse(chunk=pb.TokenChunk(text="before"))
        raise RAISES[request.prompt][0]

    async def ListModels(self, request, context):
        raise RAISES["busy"][0]


async def _run() -> dict:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    generation_pb2_grpc.add_GenerationServicer_to_server(Raising(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    results = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for name in RAISES:
                call = stub.Generate(pb.GenerateRequest(prompt=name))
                texts = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for msg in call:
                        texts.append(msg.chunk.text)
                results[name] = (
                    texts,
                    info.value.code(),
                    info.value.details(),
                    info.value.trailing_metadata(),
                )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(pb.ListModelsRequest())
            results["unary"] = (None, info.value.code(), info.value.details(), info.value.trailing_metadata())
    finally:
        await server.stop(None)
    return results


def test_domain_errors_map_to_status_codes():
    results = asyncio.run(_run())
    for name, (_, code, message) in RAISES.items():
        texts, got_code, details, _ = results[name]
        assert texts == ["before"], name
        assert (got_code, details) == (code, message), name
    _, code, _, trailing = results["busy"]
    assert ("retry-after-ms", "250") in list(trailing)
    _, code, details, trailing = results["unary"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "250") in list(trailing)
