"""AsyncEngine.from_config builds the engine off the main thread (worker/async_engine.py says why:
an OpenMP team left on the main thread made every engine step ~2x slower), and build errors still
reach the caller."""

from __future__ import annotations

import threading

import pytest

from worker import async_engine
from worker.config import EngineConfig


def test_engine_is_built_off_the_main_thread(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, config):
            seen.append((threading.current_thread() is threading.main_thread(), config))

    monkeypatch.setattr(async_engine, "LLMEngine", Recorder)
    config = EngineConfig(kv_cache_bytes=2**20)
    engine = async_engine.build_engine_off_main_thread(config)
    assert isinstance(engine, Recorder)
    assert seen == [(False, config)]


def test_build_errors_reach_the_caller(monkeypatch):
    class Broken:
        def __init__(self, config):
            raise ValueError("bad model path")

    monkeypatch.setattr(async_engine, "LLMEngine", Broken)
    with pytest.raises(ValueError, match="bad model path"):
        async_engine.build_engine_off_main_thread(EngineConfig(kv_cache_bytes=2**20))
