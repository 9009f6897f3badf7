"""The tiny random Llama shape the kernel, graph and quantization tests share: 2 layers, GQA 4/2,
head_dim 16, hidden 64, vocabulary 128 (tied embeddings); and `save_tiny`, the same size saved by
transformers as a Hugging Face safetensors directory (Llama with llama3 RoPE scaling and an untied
lm_head, or Qwen2 with q/k/v bias and tied embeddings), for the loader and engine tests."""

import torch

from worker.config import ModelConfig

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=256,
)


def save_tiny(tmp_path, kind: str):
    """A random transformers model of `kind` ("llama3" or "qwen2", seed 0) saved under tmp_path / kind:
    (path, the model)."""
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
