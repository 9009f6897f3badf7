"""`python -m worker` flags reach the engine config; bad values are usage errors, not tracebacks."""

import os
import subprocess
import sys

import pytest

from tests.procs import REPO
from worker.__main__ import parse_args

pytestmark = pytest.mark.usefixtures("clean_llm_env")  # tests/conftest.py: no LLM_*/OTEL_* leaks in


def test_engine_flags():
    config = parse_args(
        [
            "--attention-backend",
            "reference",
            "--enforce-eager",
            "--no-prefix-caching",
            "--gpu-memory-utilization",
            "0.5",
            "--kv-cache-mb",
            "64",
            "--max-num-seqs",
            "8",
        ]
    )
    engine = config.engine
    assert engine.attention_backend == "reference" and engine.enforce_eager
    assert not engine.enable_prefix_caching and engine.gpu_memory_utilization == 0.5
    assert engine.kv_cache_bytes == 64 * 2**20 and engine.max_num_seqs == 8
    defaults = parse_args([]).engine
    assert defaults.attention_backend == "auto" and not defaults.enforce_eager
    assert defaults.enable_prefix_caching and defaults.gpu_memory_utilization == 0.85


def test_bad_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--attention-backend", "cuda"])
    assert exit_.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_bad_value_exits_with_a_message():
    out = subprocess.run(
        [sys.executable, "-m", "worker", "--gpu-memory-utilization", "1.5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "gpu_memory_utilization must be in (0, 1], got 1.5" in out.stderr
    assert "Traceback" not in out.stderr


def test_defaults_are_engine_configs_and_variables_apply(monkeypatch):
    """The worker's defaults are EngineConfig's (device and dtype auto, resolved in the model
    runner; `--device auto` once crashed); an LLM_* variable sets a flag; the flag wins."""
    from worker.config import EngineConfig

    assert parse_args([]).engine == EngineConfig()
    assert parse_args(["--device", "auto", "--dtype", "auto"]).engine == EngineConfig()
    monkeypatch.setenv("LLM_KV_CACHE_MB", "32")
    monkeypatch.setenv("LLM_ENFORCE_EAGER", "yes")
    engine = parse_args([]).engine
    assert engine.kv_cache_bytes == 32 * 2**20 and engine.enforce_eager
    assert parse_args(["--kv-cache-mb", "8", "--no-enforce-eager"]).engine.kv_cache_bytes == 8 * 2**20
    assert not parse_args(["--no-enforce-eager"]).engine.enforce_eager


def test_bad_variable_exits_naming_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_")}
    out = subprocess.run(
        [sys.executable, "-m", "worker"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "LLM_ATTENTION_BACKEND": "cuda"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "LLM_ATTENTION_BACKEND='cuda': must be one of auto, cpu, torch, reference, triton" in out.stderr
