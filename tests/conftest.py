"""Shared fixtures: one loaded model per test session (loading takes seconds), one worker process
per session for the end-to-end modules that need only a normal worker (`plain_worker`, see
tests/procs.py), --runslow."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Triton reads this once, at its first import: without a GPU its kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test processes: `make test` runs two of them side by side on two
# cores, and two threads each (OpenMP barriers under contention) made the same in-process work
# 4-20x slower (measured in test_gpu_bench's engines and transformers' generate). Tests about
# threading set their own count and restore this one.
torch.set_num_threads(1)

# Property tests (hypothesis): in CI each runs the same examples every time (derandomize: its seed
# is derived from the test), so a merge is judged by its own change and not by which random
# examples that run drew; elsewhere they explore new examples each run, and a failure prints the
# `@reproduce_failure` line that replays it (a CI failure of 2026-12-04 was found that way).
try:
    from hypothesis import settings
except ImportError:  # the GPU machine's python has no hypothesis (nor runs the property tests)
    settings = None
if settings is not None:
    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run tests marked slow (long soaks, sweeps)",
    )


# `make test` runs the modules on two pytest-xdist processes, a whole module each (--dist
# loadfile: module fixtures, and the processes they start, exist once). xdist hands out modules in
# collection order, so the longest go first and the short ones fill in at the end: without this the
# last long module starts late and runs alone on one core. Ordered by seconds per module alone
# (2-vCPU EPYC, 2026-12-01, 35 s down to 11 s); a module not listed keeps its place after these.
LONGEST_FIRST = (
    "test_tp_serve",
    "test_ray_cluster",
    "test_faults",
    "test_soak",
    "test_fairness_e2e",
    "test_gpu_bench",
    "test_cpu_attention",
    "test_engine_hf",
    "test_tenant_isolation",
    "test_quant_smollm",
    "test_trust_fuzz",
    "test_trust_limits",
    "test_trust_admission",
    "test_tp_model",
    "test_tls",
    "test_engine_batching",
    "test_triton_sampling",
    "test_openai_e2e",
    "test_async_scheduling",
    "test_cuda_graphs",
    "test_grpc_e2e",
    "test_trust_streams",
    "test_grpc_two_workers",
    "test_loadtest_e2e",
    "test_ray_serve",
)


def _module_rank(item) -> int:
    name = item.path.stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: the order inside a module, and of the rest, is kept
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow soak: runs with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_llm_env(monkeypatch):
    """The config parsers read LLM_*/OTEL_* variables: none from the environment the tests run in
    (modules opt in with `pytestmark = pytest.mark.usefixtures("clean_llm_env")`)."""
    for name in [n for n in os.environ if n.startswith(("LLM_", "OTEL_"))]:
        monkeypatch.delenv(name)


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
def shared_sink():
    """The session's OTLP receiver: the shared worker exports its spans here, and so do the routers
    of the modules that read spans (raw export bytes kept too, for searches)."""
    from devtools.otlp_sink import OtlpSink

    sink = OtlpSink(keep_raw=True)
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def sink():
    """A module's own OTLP receiver (for processes whose spans only that module reads)."""
    from devtools.otlp_sink import OtlpSink

    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture(scope="session")
def shared_worker(tmp_path_factory, shared_sink):
    """One worker process for the session (procs.start_shared_worker); use `plain_worker`."""
    from tests import procs

    proc = procs.start_shared_worker(tmp_path_factory.mktemp("shared-worker"), shared_sink.endpoint)
    try:
        procs.ready(proc)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def plain_worker(shared_worker):
    """The shared worker for one module. A module must leave it as it found it: after the module it
    is still running, idle, and every KV block is free (a leak fails here, not in the next module)."""
    from tests import procs

    yield shared_worker
    assert shared_worker.popen.poll() is None, f"the shared worker died:\n{shared_worker.log_tail()}"
    procs.wait_all_blocks_free(shared_worker.address, timeout_s=30.0)
