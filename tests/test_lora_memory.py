"""The room a worker with --lora-dir leaves beside its KV pool for run-time LoRA adapters
(worker/lora.py `Adapters.reserve_bytes`, worker/lora_files.py `bytes_at_rank`), and the rank cap
that keeps run-time adapters inside it (`--max-lora-rank`).

The reserve is checked against real allocations: an adapter of the cap's rank on every
projection, written in PEFT's format and loaded, takes exactly one slot's share, in float32 and in
bfloat16; an adapter of a higher rank is refused with its rank and the cap named; a start-up
adapter's slot, unloaded and filled at run time, stays inside what the pool left.
"""

from __future__ import annotations

import pytest

import worker.model_runner as model_runner
from benchmarks.lora import projection_shapes, write_adapter
from tests.tiny_llama import save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.lora_files import AdapterError

MEMORY = 2**24  # "available" bytes: the CPU pool is this x kv_cache_memory_fraction


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-memory")
    path, _ = save_tiny(root, "llama")
    adapters = root / "adapters"
    base = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=2**20))
    cfg = base.runner.model_config
    for rank in (4, 8):
        write_adapter(adapters / f"r{rank}", cfg.num_layers, projection_shapes(cfg), rank, rank, 0.1)
    return path, adapters


def _engine(model_and_adapters, monkeypatch, **overrides) -> LLMEngine:
    path, adapters = model_and_adapters
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: MEMORY)
    settings = dict(model=str(path), dtype="float32", kv_cache_memory_fraction=0.5)
    return LLMEngine(EngineConfig(**(settings | overrides)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_leaves_each_run_time_slot_a_full_adapter_of_the_cap(model_and_adapters, monkeypatch, dtype):
    _, adapters = model_and_adapters
    plain = _engine(model_and_adapters, monkeypatch, dtype=dtype)
    per_block = plain.runner.kv_bytes_per_block
    assert plain.runner.num_blocks == (MEMORY // 2) // per_block
    room = dict(lora_dir=str(adapters), max_lora_adapters=3)
    served = _engine(model_and_adapters, monkeypatch, dtype=dtype, max_lora_rank=4, **room)
    reserve = served.runner.adapters.reserve_bytes(served.config)
    assert served.runner.num_blocks == (MEMORY // 2 - reserve) // per_block < plain.runner.num_blocks
    served.load_adapter("a", "r4")  # rank 4 on all seven projections: one slot's share, exactly
    assert served.runner.adapters.bytes() * 3 == reserve
    assert served.runner.adapters.reserve_bytes(served.config) == reserve * 2 // 3  # two slots left
    with pytest.raises(AdapterError, match="'b' has rank 8; this worker's --max-lora-rank is 4") as caught:
        served.load_adapter("b", "r8")
    assert caught.value.kind == "invalid"
    assert served.info.adapters == ("a",)
    assert served.lora.reserved_bytes == reserve and served.lora.memory_bytes == reserve // 3
    # a start-up adapter (any rank: measured before the pool is sized) may be unloaded and its slot
    # filled at run time: the pool leaves what a full slot needs beyond it too
    unit = reserve // 3  # rank 4 on all seven projections; rank 8 takes twice that
    started = _engine(
        model_and_adapters,
        monkeypatch,
        dtype=dtype,
        lora_modules=(f"s={adapters / 'r4'}",),
        max_lora_rank=8,
        **room,
    )
    assert started.runner.lora_reserve == 2 * (2 * unit) + (2 * unit - unit)
    assert started.runner.num_blocks == (MEMORY // 2 - 5 * unit) // per_block
    started.unload_adapter("s")
    for name in ("b", "c", "d"):
        started.load_adapter(name, "r8")
    assert started.runner.adapters.bytes() == 3 * 2 * unit <= unit + started.runner.lora_reserve


def test_no_reserve_without_lora_dir_or_with_an_explicit_pool(model_and_adapters, monkeypatch):
    _, adapters = model_and_adapters
    explicit = _engine(model_and_adapters, monkeypatch, lora_dir=str(adapters), kv_cache_bytes=2**20)
    assert explicit.runner.num_blocks == 2**20 // explicit.runner.kv_bytes_per_block  # the size given
    assert explicit.lora.reserved_bytes == 0 and explicit.lora.max_adapters == 16
    start_only = _engine(model_and_adapters, monkeypatch, lora_modules=(f"s={adapters / 'r4'}",))
    assert start_only.runner.adapters.reserve_bytes(start_only.config) == 0
    figures = start_only.lora
    assert (figures.adapters, figures.max_adapters, figures.reserved_bytes) == (1, 1, 0)
    with pytest.raises(ValueError, match="less .* for run-time LoRA adapters"):
        _engine(model_and_adapters, monkeypatch, lora_dir=str(adapters), max_lora_adapters=10**6)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineConfig(max_lora_rank=0)
