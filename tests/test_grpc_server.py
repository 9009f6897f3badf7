"""The shared gRPC server skeleton (common/grpc_server.py): in process, bind, health, reflection,
/metrics with extra routes, the drain steps and signals; then through a real `python -m worker`,
which now serves reflection like the router (both servers use the skeleton)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from common.grpc_server import GrpcServer
from common.telemetry import TelemetryConfig
from tests import procs

SERVICE = "llm.v1.Worker"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def list_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        return {s.name for reply in replies for s in reply.list_services_response.service}


def fetch(url: str) -> bytes:
    return urllib.request.urlopen(url, timeout=5).read()


def test_skeleton_serves_health_reflection_and_metrics_then_drains():
    async def scenario() -> None:
        base = GrpcServer(
            component="test",
            service_names=(SERVICE,),
            host="127.0.0.1",
            port=0,
            telemetry=TelemetryConfig(metrics_port=0),
            metrics_registry=CollectorRegistry(),
            metrics_routes={"/targets": lambda: [{"targets": ["a:1"]}]},
        )
        port = base.bind()
        assert port > 0 and base.address == f"127.0.0.1:{port}"
        await base.start()
        await base.set_serving(True)
        async with grpc.aio.insecure_channel(base.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                assert (
                    await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                ).status == SERVING
            names = await asyncio.to_thread(list_services, base.address)
            assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            metrics_url = base.metrics.url
            await asyncio.to_thread(fetch, metrics_url)
            targets = await asyncio.to_thread(fetch, metrics_url.removesuffix("/metrics") + "/targets")
            assert json.loads(targets) == [{"targets": ["a:1"]}]

            stop = base.stop_event()  # SIGTERM/SIGINT set it (this is the main thread)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.wait_for(stop.wait(), timeout=5)
            finally:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            await base.not_serving()
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == NOT_SERVING
        await base.stop(0)
        base.close()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(fetch, metrics_url)

    asyncio.run(scenario())


def test_a_given_stop_event_installs_no_signal_handler():
    async def scenario() -> None:
        mine = asyncio.Event()
        assert GrpcServer.stop_event(mine) is mine
        loop = asyncio.get_running_loop()
        assert not loop.remove_signal_handler(signal.SIGTERM)  # False: none was installed

    asyncio.run(scenario())


def test_a_taken_metrics_port_is_a_clear_exit():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve metrics on port {port}"):
            GrpcServer(
                component="test",
                service_names=(),
                host="127.0.0.1",
                port=0,
                telemetry=TelemetryConfig(metrics_port=port),
                metrics_registry=CollectorRegistry(),
            )


def test_worker_process_serves_reflection_and_drains(tmp_path):
    proc = procs.start_worker(
        tmp_path, "--enforce-eager", "--num-threads", "1", "--max-model-len", "256", kv_cache_mb=8
    )
    try:
        procs.ready(proc)
        assert {"llm.v1.Worker", "grpc.health.v1.Health"} <= list_services(proc.address)
        fetch(procs.metrics_url(proc))
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(60) == 0, proc.log_tail()
        assert "worker stopped" in proc.log_tail()
    finally:
        proc.stop()
