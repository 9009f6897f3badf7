"""deploy/: the `ray up` config, the KubeRay manifests and the Dockerfile parse and agree with each
other and with the code (issue 5): one image, one Ray version, ports, Service selectors, the head
Service name and Ray Client port, namespaces, GPU resource names and counts, command lines that
the real argument parsers accept, and the shared ConfigMap: every LLM_* variable in it is a flag of
a process that reads it, its values parse, and the OTEL_* telemetry reaches the router and,
through the launcher, the worker actors."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from deploy import ray_launch
from router import config as router_config
from tests.procs import REPO

DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
GPU = "nvidia.com/gpu"


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in docs(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), (path.name, doc.keys())
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


@pytest.fixture(scope="module")
def ray_up() -> dict:
    [config] = docs(DEPLOY / "ray-cluster.yaml")
    return config  # prepare_config below fills defaults into a copy


def one(k8s, kind: str) -> dict:
    [doc] = [d for (k, _), d in k8s.items() if k == kind]
    return doc


def containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def cmdline(container: dict) -> list[str]:
    """What the container runs: command, then args."""
    return [*container["command"], *container.get("args", [])]


def env_of(k8s, container: dict) -> dict[str, str]:
    """The container's environment: its envFrom ConfigMaps, then its env entries."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(k8s[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for e in container.get("env", []):  # a Secret's value stands in as a placeholder
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        env[e["name"]] = e["value"] if ref is None else f"secret-{ref['name']}-{ref['key']}"
    return env


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def module_args(command: list[str], module: str) -> list[str]:
    assert command[:3] == ["python", "-m", module], command
    return command[3:]


def test_manifests_hold_the_expected_objects(k8s):
    kinds = {"RayCluster", "Deployment", "Service", "Job", "ConfigMap", "NetworkPolicy"}
    assert {k for k, _ in k8s} == kinds
    assert one(k8s, "RayCluster")["apiVersion"] == "ray.io/v1"


def test_one_image_everywhere(k8s, ray_up):
    cluster = one(k8s, "RayCluster")["spec"]
    images = {c["image"] for c in containers(cluster["headGroupSpec"]["template"])}
    for group in cluster["workerGroupSpecs"]:
        images |= {c["image"] for c in containers(group["template"])}
    for kind in ("Deployment", "Job"):
        images |= {c["image"] for c in containers(one(k8s, kind)["spec"]["template"])}
    images.add(ray_up["docker"]["image"])
    assert len(images) == 1, images
    readme = (DEPLOY / "README.md").read_text()
    assert f"-t {images.pop()} ." in readme  # the build command tags that image


def test_one_ray_version(k8s):
    pinned = re.search(r"^ray==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert one(k8s, "RayCluster")["spec"]["rayVersion"] == pinned
    base = re.search(r"^FROM rayproject/ray:(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    assert base.startswith(f"{pinned}-"), base


def test_routers_and_launcher_find_the_head_through_ray_client(k8s):
    cluster = one(k8s, "RayCluster")
    head = containers(cluster["spec"]["headGroupSpec"]["template"])[0]
    client_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "client")
    expected = f"ray://{cluster['metadata']['name']}-head-svc:{client_port}"  # KubeRay's naming
    router = cmdline(containers(one(k8s, "Deployment")["spec"]["template"])[0])
    launcher = cmdline(containers(one(k8s, "Job")["spec"]["template"])[0])
    assert flag(router, "--ray-address") == flag(launcher, "--ray-address") == expected
    assert flag(router, "--ray-namespace") == flag(launcher, "--ray-namespace")


def test_router_ports_probes_and_service_agree(k8s):
    deployment, service = one(k8s, "Deployment"), one(k8s, "Service")
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    [router] = containers(template)
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports["grpc"] == int(flag(cmdline(router), "--port"))
    assert ports["metrics"] == int(flag(cmdline(router), "--metrics-port"))
    assert ports["http"] == int(flag(cmdline(router), "--http-port"))  # the OpenAI API, on the Service
    assert flag(cmdline(router), "--http-host") == "0.0.0.0"
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "http"}
    assert router["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert router["livenessProbe"]["tcpSocket"]["port"] == ports["grpc"]
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
    mount = router["volumeMounts"][0]
    assert flag(cmdline(router), "--tenants").startswith(mount["mountPath"] + "/")
    assert template["spec"]["volumes"][0]["name"] == mount["name"]
    drain_s = router_config.RouterConfig.drain_grace_s
    assert template["spec"]["terminationGracePeriodSeconds"] > drain_s


def test_gpu_workers_and_launcher_agree(k8s, monkeypatch):
    cluster = one(k8s, "RayCluster")["spec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no worker on the head
    [group] = cluster["workerGroupSpecs"]
    [worker] = containers(group["template"])
    resources = worker["resources"]
    gpus = int(resources["limits"][GPU])
    assert gpus >= 1 and resources["requests"][GPU] == resources["limits"][GPU]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    job = containers(one(k8s, "Job")["spec"]["template"])[0]
    _, launch = parse_with_env(
        monkeypatch, env_of(k8s, job), ray_launch.parse_args, module_args(cmdline(job), "deploy.ray_launch")
    )
    assert launch.num_workers == group["replicas"] * gpus  # one worker per GPU
    assert launch.cpus_per_worker * gpus <= float(resources["limits"]["cpu"])
    assert launch.detached and launch.use_gpus is None and launch.engine.device == "auto"


def parse_with_env(monkeypatch, env: dict[str, str], parse, argv: list[str]):
    """`parse(argv)` in the container's environment (and none of this process's LLM_*/OTEL_*)."""
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith(("LLM_", "OTEL_"))]:
            m.delenv(name)
        for name, value in env.items():
            m.setenv(name, value)
        return parse(argv)


def test_command_lines_parse_with_the_real_parsers(k8s, monkeypatch):
    deployment = containers(one(k8s, "Deployment")["spec"]["template"])[0]
    config = parse_with_env(
        monkeypatch,
        env_of(k8s, deployment),
        router_config.parse_args,
        module_args(cmdline(deployment), "router"),
    )
    assert config.ray_address.startswith("ray://") and config.tenants_file
    # Each router enforces 1/N of the shared limits: N must be the Deployment's replica count.
    assert config.router_replicas == one(k8s, "Deployment")["spec"]["replicas"]
    job = containers(one(k8s, "Job")["spec"]["template"])[0]
    command, _ = parse_with_env(
        monkeypatch, env_of(k8s, job), ray_launch.parse_args, module_args(cmdline(job), "deploy.ray_launch")
    )
    assert not command.stop


def test_shared_config_reaches_router_launcher_and_actors(k8s, monkeypatch):
    """Every LLM_* variable of the ConfigMap is a flag of the router or the launcher, all parse,
    and the router, the launcher's actor settings and the actors' environment get the same
    OTLP endpoint and log format."""
    [configmap] = [d for (kind, _), d in k8s.items() if kind == "ConfigMap"]
    data = configmap["data"]
    deployment = containers(one(k8s, "Deployment")["spec"]["template"])[0]
    job = containers(one(k8s, "Job")["spec"]["template"])[0]
    for container in (deployment, job):
        assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in container["envFrom"]
    known = set(router_config.parser()[1].env_names())
    for flags in ray_launch.parser()[1:]:
        known |= set(flags.env_names())
    assert {n for n in data if n.startswith("LLM_")} <= known, sorted(set(data) - known)
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"

    router = parse_with_env(
        monkeypatch,
        env_of(k8s, deployment),
        router_config.parse_args,
        module_args(cmdline(deployment), "router"),
    )
    _, launch = parse_with_env(
        monkeypatch, env_of(k8s, job), ray_launch.parse_args, module_args(cmdline(job), "deploy.ray_launch")
    )
    endpoint = data["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert router.telemetry.otlp_endpoint == endpoint
    assert router.telemetry.log_format == data["LLM_LOG_FORMAT"]
    worker = launch.worker_values("10.0.0.1")
    assert worker["telemetry"]["otlp_endpoint"] == endpoint
    assert worker["telemetry"]["log_format"] == data["LLM_LOG_FORMAT"]
    assert launch.engine.dtype == data["LLM_DTYPE"]
    assert launch.engine.gpu_memory_utilization == float(data["LLM_GPU_MEMORY_UTILIZATION"])
    assert ray_launch.actor_env(launch, env_of(k8s, job))["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint


def test_ray_up_config(ray_up):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(ray_up))  # what `ray up` runs first (schema + node types)
    types = ray_up["available_node_types"]
    assert ray_up["head_node_type"] in types
    assert types[ray_up["head_node_type"]]["resources"] == {"CPU": 0}
    gpu_types = [t for t in types.values() if t.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu_types and all(t["max_workers"] <= ray_up["max_workers"] for t in gpu_types)
    head_cmd = " ".join(ray_up["head_start_ray_commands"])
    worker_cmd = " ".join(ray_up["worker_start_ray_commands"])
    gcs_port = re.search(r"ray start --head --port=(\d+)", head_cmd).group(1)
    assert f"--address=$RAY_HEAD_IP:{gcs_port}" in worker_cmd
    assert "--num-cpus=0" in head_cmd and "--ray-client-server-port=" in head_cmd


def test_ray_launch_on_node_ips_needs_mutual_tls_or_the_explicit_flag(tmp_path):
    with pytest.raises(SystemExit):
        ray_launch.parse_args(["--num-workers", "1"])  # node IPs, no TLS
    with pytest.raises(SystemExit):
        ray_launch.parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem"])  # no client CA
    _, config = ray_launch.parse_args(
        ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]
    )
    assert config.tls == ("c.pem", "k.pem", "ca.pem")
    _, plain = ray_launch.parse_args(["--allow-insecure-public"])
    assert plain.tls is None


def secret_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if "valueFrom" in e}


def test_workers_authenticate_routers_and_only_routers_reach_them(k8s, monkeypatch):
    """Issue 17: routers and the launcher read the worker token from one Secret, the launcher hands
    it to the actors (so they need no --allow-insecure-public), a NetworkPolicy admits only router
    pods (and Ray's own) to the gpu pods, and the client Service does not expose /metrics."""
    router = containers(one(k8s, "Deployment")["spec"]["template"])[0]
    job = containers(one(k8s, "Job")["spec"]["template"])[0]
    token_ref = secret_env(router)["LLM_WORKER_TOKEN"]
    assert secret_env(job)["LLM_WORKER_TOKEN"] == token_ref and not token_ref.get("optional")
    assert "--allow-insecure-public" not in cmdline(job)
    _, launch = parse_with_env(
        monkeypatch, env_of(k8s, job), ray_launch.parse_args, module_args(cmdline(job), "deploy.ray_launch")
    )
    worker = launch.worker_values("10.0.0.1")
    assert worker["worker_token"] == f"secret-{token_ref['name']}-{token_ref['key']}"
    config = parse_with_env(
        monkeypatch, env_of(k8s, router), router_config.parse_args, module_args(cmdline(router), "router")
    )
    assert config.worker_token == worker["worker_token"]
    # metrics: never on the client Service; optional bearer token for router and workers alike
    service_ports = {p["targetPort"] for p in one(k8s, "Service")["spec"]["ports"]}
    assert "metrics" not in service_ports
    assert secret_env(router)["LLM_METRICS_BEARER_TOKEN"] == secret_env(job)["LLM_METRICS_BEARER_TOKEN"]
    assert config.telemetry.metrics_bearer_token and worker["telemetry"]["metrics_bearer_token"]
    # the gpu pods: ingress from router pods and the Ray cluster's pods (and monitoring) only
    policy = k8s[("NetworkPolicy", "llm-workers")]["spec"]
    cluster = one(k8s, "RayCluster")
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert policy["podSelector"]["matchLabels"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/group": group["groupName"],
    }
    sources = [peer for rule in policy["ingress"] for peer in rule["from"]]
    router_labels = one(k8s, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert {"podSelector": {"matchLabels": router_labels}} in sources
    assert {"podSelector": {"matchLabels": {"ray.io/cluster": cluster["metadata"]["name"]}}} in sources
    assert all(set(peer) <= {"podSelector", "namespaceSelector"} and peer for peer in sources)
    router_policy = k8s[("NetworkPolicy", "llm-router")]["spec"]
    client_rule = next(r for r in router_policy["ingress"] if "from" not in r)
    assert client_rule["ports"] == [{"port": "grpc"}, {"port": "http"}]  # the Service's two ports
    metrics_rule = next(r for r in router_policy["ingress"] if r.get("ports") == [{"port": "metrics"}])
    assert "namespaceSelector" in metrics_rule["from"][0]  # only the monitoring namespace
