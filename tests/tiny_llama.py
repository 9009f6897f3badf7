"""The tiny random Llama shape the kernel, graph and quantization tests share: 2 layers, GQA 4/2,
head_dim 16, hidden 64, vocabulary 128 (tied embeddings)."""

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
