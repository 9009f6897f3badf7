"""One config source, through the real entry points (common/config_cli.py's helper itself:
tests/test_config_cli.py): every engine flag and LLM_* variable reaches the engine through every
launcher (worker, make serve, llm-serve, Ray actors); the defaults are the same everywhere; every
worker-server, router and telemetry setting arrives; a bad variable is a usage error naming it;
the non-loopback rule is one function. No process is started here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common import config_cli
from common.config_cli import Flags
from common.telemetry import TelemetryConfig
from deploy import local as deploy_local
from deploy import ray_launch
from devtools import local as devtools_local
from router import config as router_config
from router.config import RouterConfig
from worker import __main__ as worker_main
from worker.config import EngineConfig
from worker.server_config import WorkerServerConfig

pytestmark = pytest.mark.usefixtures("clean_llm_env")  # tests/conftest.py: no LLM_*/OTEL_* leaks in


def engine_settings():
    p = argparse.ArgumentParser()
    return Flags(p, EngineConfig).settings


# A valid non-default value for each engine option whose automatic one (below) would be refused.
ENGINE_SAMPLES = {
    "block_size": "32",
    "kv_cache_bytes": "64",
    "kv_cache_memory_fraction": "0.5",
    "gpu_memory_utilization": "0.5",
    "device": "cpu",
    "model": "/models/m.gguf",
    "fp8_group_size": "64",  # a power of two >= 16 (or 0)
    "tensor_parallel_size": "3",  # must divide the embedded model's heads (9 / 3 kv), vocab and MLP
    "prompt_lookup_min": "2",  # at most prompt_lookup_max (5)
}


@pytest.fixture(autouse=True, scope="module")
def lora_sample(tmp_path_factory):
    """--lora-modules' sample names a directory with an adapter_config.json, --lora-dir's a
    directory (python -m worker checks both before anything loads)."""
    adapter = tmp_path_factory.mktemp("lora-sample")
    (adapter / "adapter_config.json").write_text("{}")
    ENGINE_SAMPLES["lora_modules"] = f"tuned={adapter}"
    ENGINE_SAMPLES["lora_dir"] = str(adapter.parent)
    yield
    del ENGINE_SAMPLES["lora_modules"], ENGINE_SAMPLES["lora_dir"]


def non_default(s) -> list[str]:
    """Flags that set the option `s` to a valid value other than its default."""
    name = s.path[-1]
    if s.switch:
        return [s.flag] if not s.default else [s.negative[0]]
    if name in ENGINE_SAMPLES:
        return [s.flag, ENGINE_SAMPLES[name]]
    if s.spec.choices:
        return [s.flag, next(c for c in s.spec.choices if c != s.default)]
    if s.kind is int:
        return [s.flag, str((s.default or 0) + 7)]
    if s.kind is float:
        return [s.flag, str((s.default or 1.0) / 2)]
    return [s.flag, "x"]


def expected(s, argv) -> EngineConfig:
    """The engine config `argv` (from `non_default`) asks for."""
    value = argv[0] == s.flag if s.switch else s.to_field(s.cli_type()(argv[1]))
    return EngineConfig(**{s.path[-1]: value})


def engine_of_every_launcher(argv: list[str]) -> dict[str, EngineConfig]:
    """The EngineConfig that each entry point builds from the same engine flags."""
    worker_args = devtools_local.plan(argv).worker_args
    assert worker_args[:2] == ["-m", "worker"]
    return {
        "python -m worker": worker_main.parse_args(argv).engine,
        "deploy.ray_launch": ray_launch.parse_args(["--allow-insecure-public", *argv])[1].engine,
        "deploy.local (make serve)": deploy_local.parse_args(argv).engine,
        "devtools.local -> python -m worker": worker_main.parse_args(worker_args[2:]).engine,
    }


@pytest.mark.parametrize("setting", engine_settings(), ids=lambda s: s.flag)
def test_every_engine_flag_reaches_the_engine_through_every_launcher(setting):
    argv = non_default(setting)
    want = expected(setting, argv)
    assert want != EngineConfig(), f"{argv} does not change the engine config"
    for launcher, engine in engine_of_every_launcher(argv).items():
        assert engine == want, launcher


@pytest.mark.parametrize("setting", engine_settings(), ids=lambda s: s.env)
def test_every_engine_variable_reaches_the_engine_through_every_launcher(setting, monkeypatch):
    argv = non_default(setting)
    if setting.switch:
        monkeypatch.setenv(setting.env, "true" if argv[0] == setting.flag else "false")
    else:
        monkeypatch.setenv(setting.env, argv[1])
    want = expected(setting, argv)
    for launcher, engine in engine_of_every_launcher([]).items():
        assert engine == want, launcher


def test_defaults_are_the_same_everywhere():
    engines = engine_of_every_launcher([])
    assert all(engine == EngineConfig() for engine in engines.values()), engines
    worker = worker_main.parse_args([])
    assert worker == WorkerServerConfig(engine=EngineConfig())
    _, launch = ray_launch.parse_args(["--allow-insecure-public"])
    actor = config_cli.construct(WorkerServerConfig, launch.worker_values("127.0.0.1"))
    assert dataclasses.replace(actor, allow_insecure_public=False) == worker
    plan = deploy_local.parse_args([])
    assert plan.router == RouterConfig() and plan.worker_options == {"telemetry": {}}
    assert router_config.parse_args([]) == RouterConfig()
    assert devtools_local.plan([]).router_args == ["-m", "router"]


def test_worker_server_flags_reach_ray_actors_and_make_serve_workers(monkeypatch):
    argv = [
        "--allow-insecure-public",
        "--drain-grace-s",
        "3",
        "--drain-announce-s",
        "0.5",
        "--max-message-mb",
        "2",
        "--log-format",
        "json",
        "--trace-sample-ratio",
        "0.5",
        "--metrics-port",
        "-1",
        "--otlp-endpoint",
        "http://collector:4317",
    ]
    _, launch = ray_launch.parse_args(argv)
    actor = config_cli.construct(WorkerServerConfig, launch.worker_values("10.0.0.1"))
    assert (actor.drain_grace_s, actor.drain_announce_s, actor.max_message_bytes) == (3.0, 0.5, 2 * 2**20)
    # stopping waits for the whole drain (it cut open streams at a fixed 30 s before)
    assert launch.stop_timeout_s == 0.5 + 3.0 + 15.0
    _, long_drain = ray_launch.parse_args(["--allow-insecure-public", "--drain-grace-s", "60"])
    assert long_drain.stop_timeout_s == WorkerServerConfig.drain_announce_s + 60.0 + 15.0 > 30.0
    assert actor.telemetry == TelemetryConfig(
        otlp_endpoint="http://collector:4317", sample_ratio=0.5, metrics_port=-1, log_format="json"
    )
    assert actor.port == 0 and actor.allow_insecure_public
    plan = deploy_local.parse_args(
        [
            "--worker-drain-grace-s",
            "3",
            "--worker-drain-announce-s",
            "0.5",
            "--worker-max-message-mb",
            "2",
            "--worker-stream-interval",
            "4",
            "--log-format",
            "json",
            "--otlp-endpoint",
            "http://collector:4317",
            "--metrics-port",
            "9999",
        ]
    )
    assert plan.worker_options == {
        "drain_grace_s": 3.0,
        "drain_announce_s": 0.5,
        "max_message_bytes": 2 * 2**20,
        "stream_interval": 4,
        "telemetry": {"otlp_endpoint": "http://collector:4317", "log_format": "json"},
    }
    assert plan.router.telemetry.metrics_port == 9999 and plan.router.drain_grace_s == 30.0
    monkeypatch.setenv("LLM_WORKER_DRAIN_ANNOUNCE_S", "0.25")
    assert deploy_local.parse_args([]).worker_options["drain_announce_s"] == 0.25


def test_otlp_endpoint_flag_beats_llm_variable_beats_otel_variables(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317")
    assert router_config.parse_args([]).telemetry.otlp_endpoint == "http://otel:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert worker_main.parse_args([]).telemetry.otlp_endpoint == "http://traces:4317"
    monkeypatch.setenv("LLM_OTLP_ENDPOINT", "http://llm:4317")
    assert deploy_local.parse_args([]).router.telemetry.otlp_endpoint == "http://llm:4317"
    assert (
        router_config.parse_args(["--otlp-endpoint", "http://flag:1"]).telemetry.otlp_endpoint
        == "http://flag:1"
    )
    _, launch = ray_launch.parse_args(["--allow-insecure-public"])
    assert launch.worker_values("h")["telemetry"]["otlp_endpoint"] == "http://llm:4317"
    assert ray_launch.actor_env(launch)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"


def test_router_flags_and_variables(monkeypatch):
    monkeypatch.setenv("LLM_WORKERS", "10.0.0.1:1,10.0.0.2:2")
    monkeypatch.setenv("LLM_MAX_TOKENS_IN_FLIGHT", "5000")
    monkeypatch.setenv("LLM_QUEUE", "0")
    config = router_config.parse_args(["--max-queued", "0", "--max-message-mb", "1"])
    assert config.workers == ("10.0.0.1:1", "10.0.0.2:2") and config.max_tokens_in_flight == 5000
    assert not config.queue_requests and config.max_queued is None and config.max_message_bytes == 2**20
    assert router_config.parse_args(["--queue"]).queue_requests
    plan = devtools_local.plan(
        [
            "--port",
            "0",
            "--no-queue",
            "--log-format",
            "json",
            "--metrics-port",
            "9999",
            "--num-workers",
            "2",
            "--model",
            "/m.gguf",
            "--max-num-seqs",
            "4",
        ]
    )
    assert plan.num_workers == 2
    assert plan.router_args == [
        "-m",
        "router",
        "--model",
        "/m.gguf",
        "--port",
        "0",
        "--no-queue",
        "--metrics-port",
        "9999",
        "--log-format",
        "json",
    ]
    assert plan.worker_args == [
        "-m",
        "worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--model",
        "/m.gguf",
        "--max-num-seqs",
        "4",
        "--log-format",
        "json",
    ]


@pytest.mark.parametrize(
    "parse",
    [
        worker_main.parse_args,
        router_config.parse_args,
        deploy_local.parse_args,
        lambda argv: ray_launch.parse_args(["--allow-insecure-public", *argv]),
        devtools_local.plan,
    ],
)
def test_bad_variables_are_usage_errors_naming_them(parse, monkeypatch, capsys):
    monkeypatch.setenv("LLM_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit) as exit_:
        parse([])
    assert exit_.value.code == 2
    assert "LLM_LOG_FORMAT='xml': must be one of text, json" in capsys.readouterr().err


def test_bad_engine_variable_in_make_serve_names_it(monkeypatch, capsys):
    monkeypatch.setenv("LLM_MAX_NUM_SEQS", "0")
    with pytest.raises(SystemExit):
        deploy_local.parse_args([])
    assert "(from the environment: LLM_MAX_NUM_SEQS=0)" in capsys.readouterr().err


def test_attention_backends_have_one_source():
    from worker.config import ATTENTION_BACKENDS

    [setting] = [s for s in engine_settings() if s.path == ("attention_backend",)]
    assert setting.spec.choices == ATTENTION_BACKENDS and "cpu" in ATTENTION_BACKENDS
    assert worker_main.parse_args(["--attention-backend", "cpu"]).engine.attention_backend == "cpu"


def test_the_public_bind_rule_is_one_function(capsys):
    """The worker, the Ray launcher (node IPs) and the router refuse with the same rule's words."""
    with pytest.raises(SystemExit):
        worker_main.parse_args(["--host", "0.0.0.0"])
    worker_err = capsys.readouterr().err
    with pytest.raises(SystemExit):
        ray_launch.parse_args([])
    launcher_err = capsys.readouterr().err
    for err, host in ((worker_err, "0.0.0.0"), (launcher_err, ray_launch.NODE_IP)):
        assert (
            f"refusing to bind {host} without mutual TLS (missing --tls-cert, --tls-key, --tls-client-ca)"
            in err
            and "--allow-insecure-public" in err
        )
    router = RouterConfig(host="0.0.0.0")
    assert router.public_bind_refusal().startswith("refusing to serve 0.0.0.0 without API keys")
    assert RouterConfig(host="0.0.0.0", allow_insecure_public=True).public_bind_refusal() is None
    with pytest.raises(ValueError, match="refusing to bind 10.1.2.3"):
        WorkerServerConfig(engine=EngineConfig(), host="10.1.2.3")
    assert WorkerServerConfig(engine=EngineConfig(), host="::1").host == "::1"
