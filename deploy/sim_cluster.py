"""A simulated multi-node Ray cluster on one machine, for tests and the router-scale benchmark.

Contract
- `SimulatedCluster(num_nodes, gpus_per_node, cpus_per_node)`: a `ray.cluster_utils.Cluster`
  with a head that takes no work and `num_nodes` nodes advertising `gpus_per_node` `GPU`
  resources each (fake: nothing checks for a device, so workers run on CPU with `device="cpu"`).
  As a context manager it connects this process as a driver and tears everything down on exit.
  `address` is the GCS address other processes (routers) pass to `--ray-address`; with
  `client_port`, the head also serves Ray Client at `client_address` (`ray://127.0.0.1:PORT`), the
  way a router outside the cluster (KubeRay's router Deployment) connects.
- `write_tiny_llama(path)`: a random 2-layer Llama safetensors checkpoint (~13 MB) with the
  embedded tokenizer's vocabulary and that tokenizer's files (tokenizer.json +
  tokenizer_config.json: workers fingerprint their model's tokenizer at start, and routers refuse a
  worker whose fingerprint differs from theirs), so a router tokenizing with SmolLM2 can drive it;
  it loads in well under a second, which keeps four workers cheap on a small machine. Its text is
  noise.
- state: the cluster's processes (Ray's), until exit.
- failure modes: Ray's own (ports, memory). Starting the head is tried `START_ATTEMPTS` times:
  on a loaded 2-vCPU machine with another Ray starting beside it, a head node's raylet once never
  registered with its GCS ("The current node timed out during startup", after Ray's fixed 30 s;
  no raylet log was written); the partial cluster is shut down before the next attempt. With
  `client_port`, an attempt also waits (at most `CLIENT_SERVER_START_S`) for the head's Ray
  Client server to accept connections: once, under a full test suite, that process failed as it
  started (gRPC's "epoll_wait error: Bad file descriptor", nothing listening), and every Ray
  Client connection then timed out; such a head is shut down and started again like one that
  timed out.
"""

from __future__ import annotations

import json
import logging
import pathlib
import socket
import time

from common.ray_names import DEFAULT_NAMESPACE
from deploy.ray_launch import ray_process_env

SMOLLM2_VOCAB_SIZE = 49152
START_ATTEMPTS = 2
CLIENT_SERVER_START_S = 60.0  # the Ray Client server listens ~3 s after its head starts (2 vCPUs)
log = logging.getLogger(__name__)


class SimulatedCluster:
    def __init__(
        self,
        num_nodes: int = 2,
        gpus_per_node: int = 2,
        cpus_per_node: int = 1,
        namespace: str = DEFAULT_NAMESPACE,
        client_port: int | None = None,
    ):
        self.num_nodes = num_nodes
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.namespace = namespace
        self.client_port = client_port
        self.cluster = None

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def client_address(self) -> str:
        return f"ray://127.0.0.1:{self.client_port}"

    def __enter__(self) -> "SimulatedCluster":
        import ray
        from ray.cluster_utils import Cluster

        ray_process_env()
        head = {"num_cpus": 0, "include_dashboard": False}
        if self.client_port:
            head["ray_client_server_port"] = self.client_port
        for attempt in range(1, START_ATTEMPTS + 1):
            cluster = Cluster(initialize_head=False)
            try:
                cluster.add_node(**head)
                if self.client_port:
                    wait_listening(self.client_port, CLIENT_SERVER_START_S)
                break
            except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on a start timeout
                cluster.shutdown()
                if attempt == START_ATTEMPTS:
                    raise
                log.warning(
                    "Ray head did not start (attempt %d of %d: %s); retrying", attempt, START_ATTEMPTS, exc
                )
        self.cluster = cluster
        try:
            for _ in range(self.num_nodes):
                self.cluster.add_node(num_cpus=self.cpus_per_node, num_gpus=self.gpus_per_node)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=self.namespace, log_to_driver=False)
        except BaseException:
            self.cluster.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def wait_listening(port: int, timeout_s: float, poll_s: float = 0.1) -> None:
    """Returns once 127.0.0.1:`port` accepts a TCP connection; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=poll_s).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                message = f"nothing listens on port {port} after {timeout_s:.0f} s ({exc})"
                raise TimeoutError(message) from None
            time.sleep(poll_s)  # a poll of another process's state, bounded by the deadline


def write_tiny_llama(
    path: pathlib.Path,
    vocab_size: int = SMOLLM2_VOCAB_SIZE,
    seed: int = 0,
    sizes: tuple[int, int, int, int, int] = (64, 128, 2, 4, 2),
    name: str = "tiny-llama-sim",
) -> pathlib.Path:
    """`sizes`: hidden, intermediate, layers, query heads, KV heads (head_dim = hidden / heads)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads = sizes
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": rand(vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    config = {
        "model_type": "llama",
        "_name_or_path": name,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_embedded_tokenizer(path)
    return path


def _write_embedded_tokenizer(path: pathlib.Path) -> None:
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    tok._backend.save(str(path / "tokenizer.json"))
    eos = tok._backend.id_to_token(tok.eos_token_id)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
