"""Worker inputs at their edges (found by a review): a temperature so small that logits /
temperature overflows samples greedily (it picked token 0 from NaN probabilities); a non-finite
LoRA alpha is refused with the module named (a NaN alpha turned every output to token 0); a
non-finite drain or stream timeout is refused (a NaN idle timeout ended every stream at once); a
status message stays within gRPC's metadata limit (a grammar's 20 KB parse error came back as
RESOURCE_EXHAUSTED); a failed engine step tells the client its type only (torch and CUDA messages
carry file paths)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from tests.test_async_scheduling import tiny_config, tiny_runner
from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.lora_files import _alpha
from worker.server import MAX_STATUS_CHARS, _status_message
from worker.server_config import WorkerServerConfig
from worker.types import MIN_TEMPERATURE, SamplingParams


def _tokens(engine: LLMEngine, sampling: SamplingParams) -> list[int]:
    engine.add_request("x", [5, 9, 11, 4], sampling)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("temperature", [1e-44, 1e-30, MIN_TEMPERATURE / 2])
def test_a_vanishing_temperature_samples_greedily(temperature):
    sampling = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, seed=3)
    assert sampling.temperature == 0.0 and sampling.greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    config = tiny_config(num_kv_blocks=64)
    greedy = _tokens(
        LLMEngine(config, runner=tiny_runner(config)), dataclasses.replace(sampling, temperature=0)
    )
    assert _tokens(LLMEngine(config, runner=tiny_runner(config)), sampling) == greedy


@pytest.mark.parametrize("alpha", [math.nan, math.inf, "abc", None])
def test_a_lora_alpha_must_be_a_finite_number(alpha):
    # a TypeError: load_adapter reports it as the adapter's malformed config (tests/test_lora.py)
    with pytest.raises(
        TypeError, match=r"lora_alpha of model\.layers\.0\.self_attn\.q_proj must be a finite"
    ):
        _alpha({"lora_alpha": alpha}, "model.layers.0.self_attn.q_proj")
    with pytest.raises(TypeError, match="must be a finite"):
        _alpha({"alpha_pattern": {"q_proj": alpha}}, "model.layers.0.self_attn.q_proj")
    assert _alpha({"lora_alpha": 16}, "model.layers.0.self_attn.q_proj") == 16.0


@pytest.mark.parametrize("field", ["drain_grace_s", "drain_announce_s", "stream_idle_timeout_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_worker_timeouts_must_be_finite(field, value):
    with pytest.raises(ValueError, match="must be finite"):
        WorkerServerConfig(engine=EngineConfig(), **{field: value})


def test_status_messages_stay_within_the_metadata_limit():
    long = "grammar: expected ']' at " + "[" * 20_000
    assert len(_status_message(long)) == MAX_STATUS_CHARS and _status_message(long).endswith("...")
    assert _status_message("short") == "short"


def test_a_failed_step_tells_the_client_its_type_only():
    config = tiny_config(num_kv_blocks=64)
    runner = tiny_runner(config)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access at /opt/venv/lib/python3.11/x.py:12")

    runner.launch = broken
    served = AsyncEngine(LLMEngine(config, runner=runner))
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        return [out async for out in served.generate("x", [1, 2, 3], sp)]  # raises at the failed step

    served.start()
    try:
        with pytest.raises(RuntimeError) as err:
            asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        served.shutdown()
    assert str(err.value) == "engine step failed (RuntimeError)"
