"""Engine configuration: frozen dataclasses, checked once at construction.

`ModelConfig` describes the architecture (read from GGUF metadata or config.json);
`EngineConfig` holds the serving knobs. Measured runtime values (the number of KV blocks that fit
the byte budget) live on `CacheLayout`, computed by the model runner, not here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto",) + DTYPES
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# auto: triton on CUDA; on CPU the compiled "cpu" op when it builds, else "torch".
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "reference", "triton")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; anything else is returned as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on every device: on GPU the tensor cores' type, on CPU the activation
    type the int4/int8 weight kernels need (with float32 activations they fall back to a path
    10-60x slower) and half the KV bytes. "float32" stays the exact reference path."""
    if dtype != "auto":
        return dtype
    return "bfloat16"


def default_num_threads() -> int:
    """The cores this process is given: OMP_NUM_THREADS when set (Ray sets it to an actor's
    num_cpus), else the CPU affinity mask."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0))


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
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16 (resolve_dtype)
    device: str = "auto"                  # auto | cpu | cuda[:N] (resolve_device)
    block_size: int = 16
    kv_cache_bytes: int | None = None     # CPU budget for K+V of all layers; None = the fraction below
    kv_cache_memory_fraction: float = 0.25  # CPU: share of available RAM (after weights) for the KV pool
    kv_cache_dtype: str = "auto"          # auto (= dtype) | float32 | bfloat16 | float16
    # auto: GGUF Q4_0/Q4_1 (and Q8_0) tensors run quantized when dtype is bfloat16, dense
    # checkpoints stay dense; none: dequantize everything to dtype; int8/int4: quantize dense
    # weights at load (weight-only, per-channel int8 or group-32 int4).
    quantization: str = "auto"
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory after weights
    num_kv_blocks: int | None = None      # use only this many blocks of the pool (tests, tuning)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512     # token budget per step (chunked prefill)
    max_model_len: int | None = None      # None = model's context
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"       # ATTENTION_BACKENDS
    seed: int = 0
    num_threads: int | None = None        # torch intra-op threads; None = torch default
    enforce_eager: bool = False           # never replay CUDA graphs (GPU) or compiled decode (CPU)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto",) + DTYPES:
            raise ValueError(f"dtype must be one of {('auto',) + DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be > 0")
