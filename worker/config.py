"""Engine configuration: frozen dataclasses, checked once at construction.

`ModelConfig` describes the architecture (read from GGUF metadata or config.json);
`EngineConfig` holds the serving knobs. Measured runtime values (the number of KV blocks that fit
the byte budget) live on `CacheLayout`, computed by the model runner, not here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1+); `factor == 1` means none."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # GGUF file or HF dir; None = embedded SmolLM2
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20     # CPU budget for K+V of all layers
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory after weights
    num_kv_blocks: int | None = None      # use only this many blocks of the pool (tests, tuning)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512     # token budget per step (chunked prefill)
    max_model_len: int | None = None      # None = model's context
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"       # auto | torch | reference | triton
    seed: int = 0
    num_threads: int | None = None        # torch intra-op threads; None = torch default
    enforce_eager: bool = False           # CUDA: never replay decode steps from CUDA graphs
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.attention_backend not in ("auto", "torch", "reference", "triton"):
            raise ValueError(f"attention_backend must be auto|torch|reference|triton, "
                             f"got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be > 0")
