"""Where Ray-launched workers live: the namespace and actor names shared by the launcher
(deploy/ray_launch.py) and the router's Ray discovery (router/ray_registry.py).

Contract
- `worker_name(prefix, i)` -> the actor name of worker `i`; `list_worker_names(namespace, prefix)`
  -> the names of the live named actors in `namespace` that start with `prefix`, sorted.
- state: none; Ray must be connected (a driver, or a Ray Client `ray://` connection, whose
  listing API differs: both are handled here).
- failure modes: not connected -> Ray's own error.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "llm"
DEFAULT_NAME_PREFIX = "worker-"


def worker_name(prefix: str, index: int) -> str:
    return f"{prefix}{index}"


def list_worker_names(namespace: str, prefix: str, ray=None) -> list[str]:
    """`ray`: the Ray module (default: imported here); tests pass a fake."""
    if ray is None:
        import ray
    if ray.util.client.ray.is_connected():  # Ray Client: the listing goes through the client API
        entries = ray.util.client.ray.list_named_actors(True)
    else:
        entries = ray.util.list_named_actors(all_namespaces=True)
    return sorted(e["name"] for e in entries if e["namespace"] == namespace and e["name"].startswith(prefix))
