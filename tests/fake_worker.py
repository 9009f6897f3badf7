"""A misbehaving worker for fault tests: `python -m tests.fake_worker --info-from HOST:PORT`.

It copies a real worker's `WorkerInfo` (so the router serves it for the same model), reports a
healthy, empty KV pool and passes every health check, but fails every `Generate` call with
INTERNAL ("injected failure"). Each call is logged as "generate call N" so a test can count how
many requests the router still sent it. Prints "worker listening on HOST:PORT" like a real one.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos.llm.v1 import worker_pb2 as wpb
from protos.llm.v1 import worker_pb2_grpc


class FailingWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, info: wpb.WorkerInfo):
        self._info = info
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        print(f"generate call {self.calls}", flush=True)
        await context.abort(grpc.StatusCode.INTERNAL, "injected failure")
        yield wpb.WorkerResponse()  # unreachable; makes this an async generator like the real one

    async def GetLoad(self, request, context):
        return wpb.LoadReport(num_running=0, num_waiting=0, num_free_blocks=64, num_total_blocks=64)

    async def GetInfo(self, request, context):
        return self._info


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--info-from", required=True, help="a real worker to copy WorkerInfo from")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    async with grpc.aio.insecure_channel(a.info_from) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(wpb.GetInfoRequest(), timeout=10)
    info.metrics_address = ""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(FailingWorker(info), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"worker listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
