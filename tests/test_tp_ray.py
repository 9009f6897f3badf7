"""Tensor-parallel workers placed by Ray (issue 20) on a `ray.cluster_utils.Cluster`: a head that
takes no work and two nodes with 2 fake GPUs each. Two TP=2 workers (deploy/ray_launch.py) serve a
tiny random Llama (4 q / 2 KV heads) on CPU over gloo.

- Each group reserves its two GPUs on one node (the actor sees both), its rank 1 is a live child
  process of the actor, and the two groups land on the two nodes (one per node: 2 GPUs each).
- Each worker answers a request through its TP group, with the same tokens as the other.
"""

from __future__ import annotations

import grpc
import pytest

from common.auth import METADATA_KEY
from protos.llm.v1 import worker_pb2 as wpb
from protos.llm.v1 import worker_pb2_grpc
from tests import procs

ray = pytest.importorskip("ray")

from deploy.ray_launch import LaunchConfig, launch_workers, stop_workers  # noqa: E402
from deploy.sim_cluster import SimulatedCluster, write_tiny_llama  # noqa: E402
from worker.config import EngineConfig  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    engine = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        kv_cache_bytes=8 * 2**20,
        num_threads=1,
        tensor_parallel_size=TP,
        enforce_eager=True,
    )
    with SimulatedCluster(2, 2, cpus_per_node=1, client_port=procs.free_port()) as sim:
        launched = launch_workers(
            LaunchConfig(
                num_workers=2,
                engine=engine,
                cpus_per_worker=0.5,
                drain_grace_s=1.0,
            )
        )
        try:
            yield sim, launched
        finally:
            stop_workers(LaunchConfig.namespace)


def actor_view(handle) -> dict:
    """The actor's node, the GPUs Ray gave it and its live rank processes, asked inside it."""

    def view(actor) -> dict:  # nested: pickled by value (this test module is not importable there)
        import multiprocessing

        import ray as ray_in_actor

        return {
            "node": ray_in_actor.get_runtime_context().get_node_id(),
            "gpus": sorted(str(g) for g in ray_in_actor.get_gpu_ids()),
            "ranks": [p.pid for p in multiprocessing.active_children() if p.name.startswith("tp-rank-")],
        }

    return ray.get(handle.__ray_call__.remote(view), timeout=60)


def greedy(address: str, token: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = wpb.WorkerRequest(
            request_id="tp-ray",
            prompt_token_ids=[5, 9, 17, 33, 2, 8],
            sampling=wpb.WorkerSampling(temperature=0.0, top_p=1.0, max_tokens=6, ignore_eos=True),
        )
        msgs = list(stub.Generate(request, timeout=60, metadata=[(METADATA_KEY, token)]))
    return [t for m in msgs for t in m.token_ids]


# slow: a simulated 3-node Ray cluster and two TP groups (4 processes loading): ~50 s on 2 vCPUs.
@pytest.mark.slow
def test_each_tp_group_on_one_node_and_two_groups_on_two_nodes(groups):
    sim, launched = groups
    views = [actor_view(h) for h in launched.handles.values()]
    worker_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")}
    for view in views:
        assert len(view["gpus"]) == TP, view  # the group's two GPUs, on the actor's node
        assert len(view["ranks"]) == TP - 1, view  # rank 1: a process of the actor, same node
        assert view["node"] in worker_nodes
    assert len({v["node"] for v in views}) == 2, views
    tokens = [greedy(address, launched.token) for address in launched.addresses.values()]
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
