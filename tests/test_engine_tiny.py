"""Tiny random Llama / Qwen2 checkpoints saved as Hugging Face safetensors directories.

- The safetensors loader, llama3 RoPE scaling and q/k/v bias (Qwen2) give transformers' logits.
- Issue 3, acceptance 3: the whole engine with the Triton backend forced on (interpreted on CPU)
  produces the same greedy tokens as the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.types import SamplingParams

PROMPTS = [
    [5, 9, 17, 33, 2, 8, 100, 41, 7, 3, 66, 12, 90, 14, 1, 6, 77, 23, 19],
    [44, 12],
    [3] * 37,
    [120, 110, 100, 90, 80, 70, 60],
]


def save_tiny(tmp_path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=127,
    )
    if kind == "qwen2":
        config, cls = Qwen2Config(**common, tie_word_embeddings=True), Qwen2ForCausalLM
    else:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        config, cls = (
            LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0, tie_word_embeddings=False),
            LlamaForCausalLM,
        )
    model = cls(config).eval()
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_safetensors_model_matches_transformers(tmp_path, kind):
    path, hf = save_tiny(tmp_path, kind)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=2**20, max_num_batched_tokens=8)
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
