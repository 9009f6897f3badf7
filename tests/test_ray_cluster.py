"""Ray-managed workers on a simulated cluster (issue 5, acceptance 1-3).

One `ray.cluster_utils.Cluster` for the module: a head that takes no work and two nodes that each
advertise 2 fake `GPU`s. Four worker actors (one GPU each, so placement must be 2 per node) serve
a tiny random Llama with the embedded tokenizer's vocabulary on CPU: the tests are about placement,
discovery, restarts and routing, not text, and four SmolLM2 loads would take minutes on a small
machine. Routers are real `python -m router --ray-address ...` processes: one a driver of the
cluster (GCS address), the second through Ray Client (`ray://`), as KubeRay's router Deployment.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest

from common.auth import METADATA_KEY
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc
from tests import procs

ray = pytest.importorskip("ray")

from deploy.ray_launch import LaunchConfig, launch_workers  # noqa: E402
from deploy.sim_cluster import SimulatedCluster, write_tiny_llama  # noqa: E402
from worker.config import EngineConfig  # noqa: E402

NUM_NODES, GPUS_PER_NODE = 2, 2
NUM_WORKERS = NUM_NODES * GPUS_PER_NODE
# One running sequence per worker: a second request to the same worker waits in its queue.
MAX_NUM_SEQS = 1
REDISCOVERY_S = 5.0  # restarted worker serving -> the router routes to it again


@pytest.fixture(scope="module")
def sim():
    with SimulatedCluster(
        NUM_NODES, GPUS_PER_NODE, cpus_per_node=1, client_port=procs.free_port()
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def workers(sim, model):
    engine = EngineConfig(
        model=str(model), device="cpu", kv_cache_bytes=8 * 2**20, num_threads=1, max_num_seqs=MAX_NUM_SEQS
    )
    # Half a CPU each: four fit the two one-CPU nodes; the GPU bundle decides placement.
    return launch_workers(
        LaunchConfig(num_workers=NUM_WORKERS, engine=engine, cpus_per_worker=0.5, drain_grace_s=1.0)
    )


def start_router(ray_address: str, logs, token: str, model: str) -> procs.Proc:
    os.environ["LLM_WORKER_TOKEN"] = token  # the launch's worker token (issue 17); Proc copies the env
    try:
        proc = procs.Proc(
            "router",
            [
                "-m",
                "router",
                "--port",
                "0",
                "--ray-address",
                ray_address,
                "--model",  # the workers' model: its id and tokenizer fingerprint must match theirs
                model,
                "--health-poll-s",
                "0.2",
                "--drain-grace-s",
                "20",
            ],
            logs,
        )
    finally:
        del os.environ["LLM_WORKER_TOKEN"]
    try:
        procs.ready(proc)
        procs.wait_for_workers(proc.address, NUM_WORKERS, timeout_s=60)
    except BaseException:
        print(proc.log_tail())
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="module")
def router(sim, workers, logs, model):
    proc = start_router(sim.address, logs, workers.token, model)  # a driver of the cluster
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(router):
    with grpc.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"r{i}",
        prompt=f"Story number {i}:",
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


def generate_all(stub, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(req, timeout=60))


def addresses(workers) -> dict[str, str]:
    return dict(zip(workers.handles, ray.get([h.address.remote() for h in workers.handles.values()])))


class Streams:
    """Concurrent streaming requests on threads; records tokens seen and how each ended."""

    def __init__(self, stub, num_requests: int, max_tokens: int):
        self.first_token = [threading.Event() for _ in range(num_requests)]
        self.outcomes: list = [None] * num_requests
        self._threads = [
            threading.Thread(target=self._run, args=(stub, i, max_tokens), daemon=True)
            for i in range(num_requests)
        ]
        for t in self._threads:
            t.start()

    def _run(self, stub, i: int, max_tokens: int) -> None:
        tokens = 0
        try:
            for msg in stub.Generate(request(i, max_tokens), timeout=120):
                if msg.HasField("chunk") and msg.chunk.token_ids:
                    tokens += len(msg.chunk.token_ids)
                    self.first_token[i].set()
                elif msg.HasField("finished"):
                    self.outcomes[i] = ("ok", tokens, msg.finished.usage.completion_tokens)
        except grpc.RpcError as exc:
            self.outcomes[i] = (exc.code(), tokens, exc.details())

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a request hung"


def wait_all_busy(
    addrs: list[str],
    streams: Streams,
    num_streaming: int,
    router: procs.Proc,
    num_queued: int,
    timeout_s: float = 60.0,
    token: str = "",
):
    """Until `num_streaming` requests stream, every worker runs one (its only slot) and the
    router's queue holds `num_queued` (the router fills only free sequence slots)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [procs.worker_load(a, ((METADATA_KEY, token),)) for a in addrs]
        streaming = sum(e.is_set() for e in streams.first_token)
        queued = procs.scrape(router)[("llm_router_queue_length", ())]
        if (
            streaming == num_streaming
            and queued == num_queued
            and all(load.num_running == 1 and load.num_waiting == 0 for load in loads)
        ):
            return
        assert time.monotonic() < deadline, (streaming, queued, loads, streams.outcomes)
        time.sleep(0.02)


def test_four_workers_placed_two_per_node_discovered_and_all_serve(sim, workers, stub, router):
    nodes = collections.Counter(ray.get([h.node_id.remote() for h in workers.handles.values()]))
    assert sorted(nodes.values()) == [2, 2], nodes
    head = ray.get_runtime_context().get_node_id()  # this driver is attached to the head
    assert head not in nodes
    assert ray.available_resources().get("GPU", 0) == 0  # each worker holds one (fake) GPU

    # 2 requests per worker: the balancer gives each idle worker one; the rest wait in the router.
    addrs = list(addresses(workers).values())
    streams = Streams(stub, 2 * NUM_WORKERS, max_tokens=200)
    wait_all_busy(
        addrs, streams, NUM_WORKERS, router, num_queued=NUM_WORKERS, token=workers.token
    )  # one each
    streams.join(120)
    assert streams.outcomes == [("ok", 200, 200)] * (2 * NUM_WORKERS)


def test_killed_worker_is_restarted_and_rediscovered_in_flight_as_in_grpc_issue(workers, stub, router):
    before = addresses(workers)
    victim_name = "worker-0"
    victim = workers.handles[victim_name]
    old_pid = ray.get(victim.pid.remote())
    streams = Streams(stub, 2 * NUM_WORKERS, max_tokens=200)
    wait_all_busy(
        list(before.values()), streams, NUM_WORKERS, router, num_queued=NUM_WORKERS, token=workers.token
    )

    os.kill(old_pid, signal.SIGKILL)
    killed_s = time.monotonic()
    streams.join(120)
    failed = [o for o in streams.outcomes if o[0] != "ok"]
    # the request streaming on the victim: UNAVAILABLE naming it; the ones queued in the router
    # went to the surviving workers and completed like all the others
    assert len(failed) == 1, streams.outcomes
    code, tokens, details = failed[0]
    assert code == grpc.StatusCode.UNAVAILABLE, failed[0]
    # the worker is named in the router's log, never to clients (issue 17)
    assert tokens > 0 and "lost mid-stream" in details and before[victim_name] not in details
    assert [o for o in streams.outcomes if o[0] == "ok"] == [("ok", 200, 200)] * (2 * NUM_WORKERS - 1)

    # Ray restarts the actor (new process, model reloaded, new port)
    while True:
        try:
            new_pid = ray.get(victim.pid.remote(), timeout=120)
            if new_pid != old_pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass  # still restarting: ask again until the bound below
        assert time.monotonic() - killed_s < 120, "Ray did not restart the worker"
        time.sleep(0.1)
    new_address = ray.get(victim.address.remote())
    restarted_s = time.monotonic()
    assert new_address != before[victim_name]
    procs.wait_for_workers(router.address, NUM_WORKERS, timeout_s=REDISCOVERY_S)
    print(
        f"restart took {restarted_s - killed_s:.1f} s; rediscovered "
        f"{time.monotonic() - restarted_s:.1f} s after it served"
    )

    # and it takes requests again
    streams = Streams(stub, 2 * NUM_WORKERS, max_tokens=200)
    busy = list(addresses(workers).values())
    wait_all_busy(busy, streams, NUM_WORKERS, router, num_queued=NUM_WORKERS, token=workers.token)
    streams.join(120)
    assert streams.outcomes == [("ok", 200, 200)] * (2 * NUM_WORKERS)


def test_two_routers_serve_the_same_workers_and_stopping_one_spares_the_other(
    sim, workers, router, stub, logs, model
):
    second = start_router(sim.client_address, logs, workers.token, model)  # via Ray Client
    try:
        with grpc.insecure_channel(second.address) as channel:
            second_stub = generation_pb2_grpc.GenerationStub(channel)
            with cf.ThreadPoolExecutor(2) as pool:  # both serve at once
                both = [
                    pool.submit(generate_all, s, request(i, 32)) for i, s in enumerate((stub, second_stub))
                ]
                assert [f.result()[-1].finished.usage.completion_tokens for f in both] == [32, 32]

            on_first = Streams(stub, 1, max_tokens=300)  # in flight on the router that stays
            assert on_first.first_token[0].wait(30)
            assert second.stop() == 0  # drains (nothing in flight), exits 0
            on_first.join(60)
            assert on_first.outcomes == [("ok", 300, 300)]
            msgs = list(stub.Generate(request(7, 16), timeout=60))
            assert msgs[-1].finished.usage.completion_tokens == 16
            procs.wait_for_workers(router.address, NUM_WORKERS, timeout_s=5)
    finally:
        second.stop()


# A head-only cluster (its own process: this one is a driver of `sim`) with one named actor that
# answers address() with argv[2]; a file at argv[3] makes it restart the head (a new cluster on the
# same Ray Client port, the actor relaunched answering argv[4]). SIGTERM tears the cluster down.
HEAD_OWNER = """
import pathlib, signal, sys, time
import ray
from deploy.sim_cluster import SimulatedCluster

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, address):
        self._address = address

    def address(self):
        return self._address

port, restart = int(sys.argv[1]), pathlib.Path(sys.argv[3])
for phase, address in ((1, sys.argv[2]), (2, sys.argv[4])):
    with SimulatedCluster(0, 0, client_port=port):
        actor = Worker.options(name="worker-0", lifetime="detached").remote(address)
        ray.get(actor.address.remote(), timeout=120)
        print("head ready", phase, flush=True)
        while phase == 2 or not restart.exists():
            time.sleep(0.2)
    print("head down", flush=True)
"""

# A RayRegistry through Ray Client, probing (nothing listens at the actor's address: probes fail,
# so the actor is asked again each round, as for a relaunched worker) and printing what it holds.
CLIENT_REGISTRY = """
import asyncio, json, logging, sys
from router.ray_registry import RayRegistry

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

async def main():
    registry = RayRegistry(sys.argv[1], poll_s=0.5, probe_timeout_s=0.2)
    await registry.start()
    while True:
        print("workers", json.dumps(sorted(h.address for h in registry.all())), flush=True)
        await asyncio.sleep(0.5)

asyncio.run(main())
"""


@pytest.mark.slow
def test_ray_client_router_reconnects_after_a_head_restart_and_finds_relaunched_workers(logs, tmp_path):
    """Slow (about 2 min of both cores on a 2-core machine: two head starts, Ray Client's give-up
    and reconnects), so it runs with --runslow only. A router discovering through Ray Client
    (`ray://`, as KubeRay's) whose head restarts: the client gives up (grace period shortened to
    5 s here; 30 s by default), the registry reconnects and finds the worker relaunched at its new
    address (before, it kept the old one and never found the new: restart the router)."""
    port = procs.free_port()
    old, new = f"127.0.0.1:{procs.free_port()}", f"127.0.0.1:{procs.free_port()}"
    restart = tmp_path / "restart"
    owner = procs.Proc("head-owner", ["-c", HEAD_OWNER, str(port), old, str(restart), new], logs)
    registry = None
    try:
        owner.wait_for_line("head ready 1", 240)
        registry = procs.Proc(
            "client-registry",
            ["-c", CLIENT_REGISTRY, f"ray://127.0.0.1:{port}"],
            logs,
            env={"RAY_CLIENT_RECONNECT_GRACE_PERIOD": "5"},
        )
        registry.wait_for_line(f'workers \\["{old}"\\]', 120)
        restart.touch()
        owner.wait_for_line("head ready 2", 240)
        registry.wait_for_line(f'workers \\["{new}"\\]', 180)
        registry.wait_for_line("reconnected", 1)
    except BaseException:
        print(owner.log_tail(), registry.log_tail() if registry else "")
        raise
    finally:
        procs.stop_all(*(p for p in (registry, owner) if p is not None), timeout_s=60)
