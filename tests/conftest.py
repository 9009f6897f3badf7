"""Shared fixtures: one loaded model per test session (loading takes seconds), --runslow."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Triton reads this once, at its first import: without a GPU its kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run tests marked slow (long soaks, sweeps)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow soak: runs with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def logs(tmp_path_factory, request):
    """A log directory per test module, for the processes its fixtures start (tests/procs.py)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="session")
def runner():
    """The embedded SmolLM2 in float32 (the exact reference path) with a 256 MiB KV pool, shared by
    the engine tests."""
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner

    # One intra-op thread: on these shared 2-vCPU machines OpenMP barriers under CPU steal made
    # two threads 1-5x slower than one (measured), and test processes run side by side.
    # cpu_compile: the engine tests (logits vs transformers included) run the compiled step;
    # tests/test_cpu_compile.py checks it against the eager forward.
    return ModelRunner(
        EngineConfig(
            dtype="float32",
            kv_cache_bytes=256 * 2**20,
            attention_backend="torch",
            num_threads=1,
            cpu_compile=True,
        )
    )


@pytest.fixture
def make_engine(runner):
    """Build an LLMEngine over the shared runner; keyword args override EngineConfig fields."""
    from worker.engine import LLMEngine

    engines = []

    def make(**overrides):
        config = dataclasses.replace(runner.config, **overrides)
        engine = LLMEngine(config, runner=runner)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:  # every test leaves the pool whole
        engine.scheduler.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="session")
def tokenizer():
    from common.model_files import default_model_path
    from common.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM on the same GGUF, float32: the reference no one here wrote."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_files import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()
