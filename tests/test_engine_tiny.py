"""Tiny random Llama / Qwen2 checkpoints saved as Hugging Face safetensors directories.

- The safetensors loader, llama3 RoPE scaling and q/k/v bias (Qwen2) give transformers' logits.
- Issue 3, acceptance 3: the whole engine with the Triton backend forced on (interpreted on CPU)
  produces the same greedy tokens as the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_llama import save_tiny
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.types import SamplingParams

PROMPTS = [
    [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19],
    [44, 12],
    [3] * 37,
    [120, 110, 100, 90, 80, 70, 60],
]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_safetensors_model_matches_transformers(tmp_path, kind):
    path, hf = save_tiny(tmp_path, kind)
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_cache_bytes=2**20,
            max_num_batched_tokens=8,
            num_speculative_tokens=0,  # one logits row per step
        )
    )
    captured = {}
    engine.runner.logits_observer = lambda ids, logits: captured.setdefault(ids[0], []).append(logits[0])
    prompt = PROMPTS[0] + PROMPTS[2] + PROMPTS[0]  # 75 tokens: past the 64 original ctx
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
    ours = torch.stack(next(iter(captured.values())))
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, err


def test_backends_give_the_same_tokens(tmp_path):
    """Triton (interpreted) and the CPU torch path against the float32 reference, whole engine."""
    path, _ = save_tiny(tmp_path, "llama3")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 7)]
    outputs = {}
    for backend in ("reference", "torch", "triton"):
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                dtype="float32",
                kv_cache_bytes=2**20,
                attention_backend=backend,
                max_num_batched_tokens=16,
            )
        )
        assert engine.runner.backend.name == backend
        outputs[backend] = engine.generate(PROMPTS, params)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outputs["triton"] == outputs["reference"]
    assert outputs["torch"] == outputs["reference"]
