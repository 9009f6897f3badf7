"""`make serve` (issue 5, acceptance 4): local Ray in-process, a worker actor with the embedded
model and the router, from one command; a streamed generation; SIGTERM stops it all cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import grpc
import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests import procs

pytest.importorskip("ray")


def test_make_serve_runs_the_ray_launcher():
    dry = subprocess.run(
        ["make", "-n", "serve", "WORKERS=3"], cwd=procs.REPO, capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"python -m deploy\.local .*--workers 3", dry), dry


def wait_router(proc: procs.Proc, timeout_s: float) -> str:
    """The router's address from its "router listening on" line (a worker's comes first)."""
    return proc.wait_for_line(r"router listening on (\S+)", timeout_s).group(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_streams_a_generation_and_stops_cleanly(tmp_path):
    # float32: the greedy answer checked below is float32's (make serve's default dtype is auto = bfloat16)
    proc = procs.Proc(
        "serve",
        [
            "-m",
            "deploy.local",
            "--port",
            "0",
            "--workers",
            "1",
            "--dtype",
            "float32",
            "--kv-cache-mb",
            str(procs.TEST_KV_CACHE_MB),
            # as procs.start_worker: its SIGTERM drain announces NOT_SERVING 0.5 s, not 2 s (the
            # router here is this process's own, stopped first)
            "--worker-drain-announce-s",
            "0.5",
        ],
        tmp_path,
    )
    try:
        address = wait_router(proc, procs.START_TIMEOUT_S)
        procs.wait_for_workers(address, 1, timeout_s=60)
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            question = pb.ChatMessage(role="user", content="What is the capital of France?")
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(
                        chat=pb.Chat(messages=[question]),
                        sampling=pb.SamplingParams(temperature=0.0),
                        stopping=pb.StoppingCriteria(max_tokens=12),
                    ),
                    timeout=120,
                )
            )
        chunks = [m.chunk for m in msgs if m.HasField("chunk")]
        assert len(chunks) > 1 and msgs[-1].HasField("finished")  # streamed, then finished
        assert "Paris" in "".join(c.text for c in chunks)
        worker_pids = {int(p) for p in re.findall(r"WorkerActor pid=(\d+)", proc.log_tail(100_000))}
        assert worker_pids

        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(90) == 0, proc.log_tail()
        assert "stopped: router, workers worker-0, Ray" in proc.log_tail()
        # Ray reaps its workers as it shuts down
        procs.wait_until(lambda: not any(alive(p) for p in worker_pids), 15, "worker processes gone")
    finally:
        proc.stop()
