"""Process-level guards: the router never imports torch; neither server binds a public address
without keys / an explicit flag; the CLI builds the config it says it does."""

import subprocess
import sys

import pytest

from router.config import Limits, RouterConfig, parse_args
from tests.procs import REPO

pytestmark = pytest.mark.usefixtures("clean_llm_env")  # tests/conftest.py: no LLM_*/OTEL_* leaks in


def test_router_modules_do_not_import_torch():
    code = (
        "import sys, router.__main__, router.server, devtools.client, devtools.local; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'worker'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.mark.parametrize("module", ["router", "worker"])
def test_public_bind_without_keys_is_refused(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--host", "0.0.0.0", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "refusing" in out.stderr


def test_parse_args():
    config = parse_args(
        [
            "--workers",
            "127.0.0.1:1, 127.0.0.1:2",
            "--port",
            "0",
            "--max-tokens-limit",
            "100",
            "--default-max-tokens",
            "50",
            "--drain-grace-s",
            "3",
        ]
    )
    assert config.workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert (config.port, config.drain_grace_s, config.host) == (0, 3.0, "127.0.0.1")
    assert config.limits == Limits(default_max_tokens=50, max_tokens_limit=100)
    assert config.binds_loopback


@pytest.mark.parametrize("kwargs", [{"workers": ("nohost",)}, {"port": 70000}, {"drain_grace_s": -1}])
def test_bad_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


def test_parse_fairness_args():
    config = parse_args(
        [
            "--fair-queue",
            "fcfs",
            "--max-queued",
            "7",
            "--max-tokens-in-flight",
            "5000",
            "--affinity-imbalance",
            "0.5",
            "--tenants-poll-s",
            "0",
            "--no-worker-grace-s",
            "2",
        ]
    )
    assert (config.fair_queue, config.max_queued, config.max_tokens_in_flight) == ("fcfs", 7, 5000)
    assert (config.affinity_imbalance, config.tenants_poll_s, config.no_worker_grace_s) == (0.5, 0.0, 2.0)
    defaults = parse_args(["--max-queued", "0"])
    assert (defaults.fair_queue, defaults.max_queued, defaults.max_tokens_in_flight) == ("vtc", None, None)
    assert defaults.router_replicas == 1 and parse_args(["--router-replicas", "3"]).router_replicas == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fair_queue": "lifo"},
        {"max_queued": 0},
        {"max_tokens_in_flight": -5},
        {"affinity_imbalance": -0.1},
        {"tenants_poll_s": -1},
        {"no_worker_grace_s": -1},
        {"lora_autoload_retry_s": -1},
        {"lora_autoload_retry_s": float("nan")},
        {"router_replicas": 0},
        {"router_replicas": 1.5},
    ],
)
def test_bad_fairness_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


@pytest.mark.parametrize("poll_s, max_backoff_ms", [(0.2, 400), (1.0, 2000), (5.0, 2000), (0.01, 200)])
def test_worker_reconnect_backoff_follows_the_health_probe_period(poll_s, max_backoff_ms):
    from router.server import channel_options

    options = dict(channel_options(4 * 2**20, poll_s))
    assert options["grpc.max_reconnect_backoff_ms"] == max_backoff_ms
    assert options["grpc.min_reconnect_backoff_ms"] == 200
