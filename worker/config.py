"""Engine configuration: frozen dataclasses, checked once at construction.

`ModelConfig` describes the architecture (read from GGUF metadata or config.json);
`EngineConfig` holds the serving knobs. Values measured at run time (how many KV blocks fit the
byte budget) are not configuration and are not kept here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config_cli import MIB, comma_list, option

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto",) + DTYPES + ("fp8",)  # fp8: float8_e4m3fn, triton backend only
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")  # fp8: W8A8, worker/model/fp8.py
# auto: triton on CUDA; on CPU the compiled "cpu" op when it builds, else "torch".
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "reference", "triton")
DEFAULT_SPECULATIVE_TOKENS = 4  # CPU's default draft length (docs/speculative.md, measured)


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when torch sees a GPU, else "cpu"; anything else is returned as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> bfloat16 on every device: on GPU the tensor cores' type, on CPU the activation
    type the int4/int8 weight kernels need (with float32 activations they fall back to a path
    10-60x slower) and half the KV bytes. "float32" stays the exact reference path."""
    if dtype != "auto":
        return dtype
    return "bfloat16"


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
    lm_head_rows: int | None = None  # tensor parallel: this rank's vocabulary rows of an untied lm_head

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. Field metadata (`common.config_cli.option`) makes each a flag of every entry
    point and launcher, and an `LLM_*` variable; defaults and checks live only here."""

    model: str | None = field(
        default=None,
        metadata=option(
            "GGUF file, HF directory, or hub id (org/name) from the local Hugging Face cache "
            "(default: the embedded SmolLM2)",
            metavar="PATH|ORG/NAME",
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=option(
            "the model id this worker serves under (routers group workers by it; default: the hub id, "
            "the GGUF's general.name or the directory's name)",
            metavar="ID",
        ),
    )
    allow_download: bool = field(
        default=False,
        metadata=option("fetch a hub id missing from the local Hugging Face cache (default: offline)"),
    )
    dtype: str = field(
        default="auto",
        metadata=option(
            "weights and activations: auto = bfloat16 on every device; float32 is the exact reference path",
            choices=("auto",) + DTYPES,
        ),
    )
    device: str = field(
        default="auto", metadata=option("auto | cpu | cuda[:N]: auto = cuda when torch sees a GPU, else cpu")
    )
    block_size: int = field(default=16, metadata=option("tokens per KV-cache block (a power of two)"))
    kv_cache_bytes: int | None = field(
        default=None,
        metadata=option(
            "KV-cache budget on CPU (default: --kv-cache-memory-fraction of the available RAM)",
            flag="kv-cache-mb",
            unit=MIB,
        ),
    )
    kv_cache_memory_fraction: float = field(
        default=0.25,
        metadata=option(
            "CPU: share of the RAM available after loading the weights that the KV pool takes, when "
            "--kv-cache-mb is unset"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto", metadata=option("KV-cache element type: auto = --dtype", choices=KV_CACHE_DTYPES)
    )
    quantization: str = field(
        default="auto",
        metadata=option(
            "auto: quantized GGUF tensors (Q4_0/Q4_1/Q8_0) run quantized with bfloat16, dense weights stay "
            "dense; none: dequantize all to --dtype; int8/int4: quantize dense weights at load; "
            "fp8: float8_e4m3fn linear weights (GPU, compute capability >= 8.9; see --fp8-group-size)",
            choices=QUANTIZATIONS,
        ),
    )
    fp8_group_size: int = field(
        default=128,
        metadata=option(
            "--quantization fp8: one weight scale per this many input columns (a power of two >= 16), "
            "bf16 activations (W8A16: on GPU a Triton GEMV at <= 16 rows, a Triton GEMM above); 0 = one "
            "scale per output channel and activations quantized per token (W8A8, torch._scaled_mm: fp8 "
            "tensor cores at prefill), about twice the logit error (docs/quantization.md, FP8)"
        ),
    )
    dense_weights_min_rows: int | None = field(
        default=None,
        metadata=option(
            "CPU, quantized weights: also keep a bfloat16 copy of each and use it for inputs of at least "
            "this many rows (prefill chunks, big decode batches), where the int4/int8 kernels are slower; "
            "costs 2 bytes per weight (+257 MiB for SmolLM2, ~3.9x the GGUF in all). Default: off"
        ),
    )
    cpu_int8_activations: bool = field(
        default=True,
        metadata=option(
            "CPU with AVX512-VNNI or AVX2, int4 / int8 weights: quantize the activations of those "
            "linears to int8 (per row and group of 32 values, llama.cpp's Q8 scheme) and multiply with "
            "int8 dot products: 2-3x the bfloat16-activation kernels' speed at every batch size (VNNI), "
            "at a larger logit error (docs/quantization.md). No effect without either. "
            "--no-cpu-int8-activations keeps bfloat16 activations",
            negative=("no-cpu-int8-activations",),
        ),
    )
    int4_dequant_min_rows: int = field(
        default=32,
        metadata=option(
            "CPU, int4 weights (the GGUF's Q4/Q8_0 linears): inputs of at least this many rows (prefill "
            "chunks, big decode batches) dequantize each weight to bfloat16 once per call and run one "
            "bfloat16 GEMM, where torch's int4 kernel re-reads the weight every 4 rows (2.3-3.4x slower "
            "at 256 rows); no resident copy. 0 = always the int4 kernel"
        ),
    )
    int8_dequant_min_rows: int = field(
        default=16,
        metadata=option(
            "CPU, int8 weights (the tied Q8_0 lm_head, int8 linears): inputs of at least this many rows "
            "(decode batches, the last tokens of prefills) run as bfloat16 GEMMs over tiles of rows "
            "dequantized per call, where torch's int8 kernel re-reads the weight for every row (3x "
            "slower at 32 rows); no resident copy. 0 = always the int8 kernel"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.85,
        metadata=option("CUDA: fraction of the memory free after loading the weights that the KV pool takes"),
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=option("use only this many blocks of the KV pool (tests, tuning; default: all)"),
    )
    max_num_seqs: int = field(default=64, metadata=option("sequences scheduled together at most"))
    max_num_batched_tokens: int = field(
        default=512, metadata=option("tokens per engine step (chunked-prefill budget)")
    )
    max_model_len: int | None = field(
        default=None, metadata=option("longest prompt + output in tokens (default: the model's context)")
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=option(
            "reuse cached KV blocks of shared prompt prefixes",
            aliases=("prefix-caching",),
            negative=("no-prefix-caching", "no-enable-prefix-caching"),
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=option(
            "auto: triton on CUDA; on CPU the compiled cpu op when it builds, else torch; reference: the "
            "slow float32 oracle the others are tested against",
            choices=ATTENTION_BACKENDS,
        ),
    )
    seed: int = field(default=0, metadata=option("sampling seed of the engine"))
    num_threads: int | None = field(
        default=None,
        metadata=option(
            "torch intra-op threads (default: the cores this process is given: OMP_NUM_THREADS, else the "
            "CPU affinity mask)"
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=option("never replay CUDA graphs (GPU) or a compiled step (CPU, --cpu-compile)"),
    )
    cpu_compile: bool = field(
        default=False,
        metadata=option(
            "CPU: run every step through torch.compile (inductor; one graph shared by the decoder "
            "layers). Off by default: measured slower than eager for the quantized SmolLM2 at batch "
            "1-8 and equal at 32 (benchmarks/cpu_steps.py, docs/cpu-serving.md)"
        ),
    )
    cpu_layer_op: bool = field(
        default=True,
        metadata=option(
            "CPU, int4 / int8 layers (the GGUF default): run the decoder layers of each step as one "
            "C++ op call (worker/kernels/cpu_layers.py) instead of ~9 op calls per layer from Python; "
            "the same ops in the same order, bit-identical outputs. --no-cpu-layer-op keeps the "
            "Python layer loop",
            negative=("no-cpu-layer-op",),
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=option(
            "overlap scheduling with the model: plan step N+1 (one placeholder token per decoding "
            "sequence) while step N runs on its own thread, and feed N's tokens into N+1; the same "
            "tokens as without it, preemption included (a step is synchronous only when the plan "
            "made in flight would preempt every sequence it could run); ignored with tensor "
            "parallelism (worker/engine.py). Off until measured on a GPU"
        ),
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata=option(
            "speculative decoding with n-gram drafts (prompt lookup): each step, a decoding sequence "
            "whose last tokens occurred before in its prompt or output takes up to N of the tokens that "
            "followed there as a draft, checked in the same forward pass; the same tokens as without it "
            "for greedy and seeded requests (worker/speculative.py, docs/speculative.md). 0 = off. "
            f"Default: {DEFAULT_SPECULATIVE_TOKENS} on CPU, off on GPU (a drafted step runs outside the "
            "CUDA graphs)"
        ),
    )
    prompt_lookup_min: int = field(
        default=3, metadata=option("speculative decoding: shortest n-gram of last tokens looked up")
    )
    prompt_lookup_max: int = field(
        default=5,
        metadata=option("speculative decoding: longest n-gram of last tokens looked up (tried first)"),
    )
    speculative_max_batch: int = field(
        default=4,
        metadata=option(
            "speculative decoding: draft only while at most this many sequences run and none waits "
            "(bigger steps spend on rejected drafts the compute they need)"
        ),
    )
    grammar_step_budget_ms: float = field(
        default=100.0,
        metadata=option(
            "structured output: how long a step waits for a constrained row's token mask after it "
            "started (beside the forward pass); a row over it fails alone (finish reason length, "
            "counted as a grammar failure), the step goes on for the others. 0 = wait without limit "
            "(worker/grammar.py, docs/reliability.md)"
        ),
    )
    triton_gemv: bool = field(
        default=False,
        metadata=option(
            "CUDA: run M<=16 linears in a Triton GEMV where startup timing finds it faster than cuBLAS"
        ),
    )

    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "LoRA adapters served beside the base model, NAME=PATH,...: PEFT adapter directories; a "
            "request picks one by naming it as its model (docs/lora.md)",
            parse=comma_list,
            format=",".join,
            metavar="NAME=PATH,...",
        ),
    )
    lora_dir: str = field(
        default="",
        metadata=option(
            "a directory of PEFT adapters the router may load and unload at run time "
            "(POST /v1/load_lora_adapter; the path must lie inside it); empty: no run-time loading",
            metavar="DIR",
        ),
    )
    max_lora_adapters: int = field(
        default=16,
        metadata=option("LoRA adapters a worker holds at once (run-time loads stop there; docs/lora.md)"),
    )
    max_lora_rank: int = field(
        default=16,
        metadata=option(
            "the highest rank of an adapter loaded at run time; with --lora-dir the KV cache leaves "
            "room for the run-time slots at this rank on every projection (docs/lora.md)"
        ),
    )

    tensor_parallel_size: int = field(
        default=1,
        metadata=option(
            "ranks (devices) one worker spans, Megatron-style: q/k/v, gate/up, o, down and the KV heads "
            "split across them; must divide the KV heads (docs/tensor-parallel.md)",
            aliases=("tp",),
        ),
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if (self.lora_modules or self.lora_dir) and self.tensor_parallel_size > 1:
            raise ValueError("lora_modules / lora_dir: LoRA adapters are not served with tensor parallelism")
        if self.max_lora_adapters < 1:
            raise ValueError(f"max_lora_adapters must be >= 1, got {self.max_lora_adapters}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.dtype not in ("auto",) + DTYPES:
            raise ValueError(f"dtype must be one of {('auto',) + DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.fp8_group_size and (
            self.fp8_group_size < 16 or self.fp8_group_size & (self.fp8_group_size - 1)
        ):
            raise ValueError(f"fp8_group_size must be 0 or a power of two >= 16, got {self.fp8_group_size}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dense_weights_min_rows is not None and self.dense_weights_min_rows < 1:
            raise ValueError(f"dense_weights_min_rows must be >= 1, got {self.dense_weights_min_rows}")
        for name in ("int4_dequant_min_rows", "int8_dequant_min_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not self.grammar_step_budget_ms >= 0:
            raise ValueError(f"grammar_step_budget_ms must be >= 0, got {self.grammar_step_budget_ms}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be > 0")
