"""Weight loaders: GGUF files and Hugging Face safetensors directories, dense or weight-only quantized.

Contract: `load_model(path | None, dtype, device, quantization="none") -> LoadedModel(model,
config, eos_token_ids, name, load_s)`. Tensors are read one at a time (GGUF through a memory map
of the file, safetensors through `safe_open`: worker/model/checkpoint.py reads the configs and the
lazy tensors; this module decides each weight's form and builds the model), so no float32 copy of
the whole model is ever alive:
the peak is the model in its final form plus one tensor (row chunks of 2,048 for the embedding),
and each tensor's pages of the file are dropped from RSS once it is consumed (madvise).

Which form each weight takes (`LoadedModel.plan`: {module path: form}):
- Quantized execution only on CPU with dtype bfloat16 (the activation type the int4/int8 kernels
  need) and quantization != "none". Otherwise every weight is dequantized to dtype: float32 is the
  exact reference path (logits match transformers), and on CUDA quantized tensors are dequantized
  to dtype (there are no CUDA weight-only kernels here); an explicit int8/int4 that cannot apply
  is logged as a warning.
- Linear layers (q|k|v and gate|up fused into one module each; llama.cpp's Q/K row permutation,
  which its converter applies to llama/mistral files only, is undone on the raw block rows, so
  quantized values and their per-row scales move together):
  "auto": GGUF Q4_0/Q4_1/Q4_K -> Int4Linear, exact (group 32, bfloat16 scale and zero); Q8_0 ->
  Int4Linear of its two int4 halves (input fed twice), exact the same way, 1.25 bytes per weight;
  other quantized GGUF types (Q5_*, Q6_K, Q2_K, Q3_K) -> Int8Linear per output channel,
  requantized from the dequantized values (a step about half of Q6_K's, a quarter or less of the
  others', see docs/quantization.md); F32/F16/BF16 stay dense. "int8": like auto, but dense weights are
  quantized to int8 too. "int4": every linear becomes int4 (stored 4-bit kept exactly, the rest
  asymmetric min/max group 32). A fused module whose parts are not all 4-bit follows the wider rule.
- Token embedding (and the tied lm_head): Int8Embedding (int8 per row) when the checkpoint stores
  it quantized or quantization is int8/int4, else dense; an untied lm_head follows the linear rules
  except that "int4" keeps it int8 unless it is stored 4-bit.
- Norms and biases stay dense in dtype. Kernel shape limits (int4: N % 16, K % 32; int8: K % 16)
  fall back to int8, then dense.
Freed heap pages are handed back to the OS at the end (glibc malloc_trim). The conversion runs
torch on one thread (restored after): its many small ops lose more to OpenMP fork/join than
they gain.
Fails how: unknown architecture, missing or mis-shaped tensors -> ValueError/KeyError naming them;
a GGUF tensor type outside GGUF_SUPPORTED_TYPES (IQ*, TQ*, ...) -> ValueError naming tensor and type.
Proven by tests/test_engine_hf.py (float32 logits equal transformers' on the same GGUF) and
tests/test_quant.py (quantized modules, decoding), tests/test_quant_gguf.py (each form on a synthetic
GGUF and safetensors) and tests/test_quant_smollm.py (the whole quantized model vs float32).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from common.model_files import default_model_path, read_gguf_metadata, resolve_model_source
from worker.config import ModelConfig
from worker.model.checkpoint import (
    DENSE_TYPES,
    CheckpointTensor,
    gguf_model_config,
    gguf_tensors,
    safetensors_tensors,
)
from worker.model.gguf_quant import GGUF_INT4_TYPES, quantize_int4, quantize_int8
from worker.model.llama import LlamaModel
from worker.model.quant import Int4Linear, Int8Embedding, Int8Linear

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROW_CHUNK = 2048


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    name: str
    load_s: float
    plan: dict[str, str] = field(default_factory=dict)  # module path -> dense | int4 | int4x2 | int8


def quantization_mode(quantization: str, dtype: str, device: torch.device) -> str:
    """ "dense", "auto", "int8" or "int4": what load_model does with (quantization, dtype, device)."""
    if quantization == "none":
        return "dense"
    if quantization not in ("auto", "int8", "int4"):
        raise ValueError(f"quantization must be auto, none, int8 or int4, got {quantization!r}")
    if device.type != "cpu" or dtype != "bfloat16":
        if quantization != "auto":
            log.warning(
                "quantization=%s ignored: weight-only kernels run on CPU with bfloat16 "
                "activations (device %s, dtype %s); weights are dequantized to %s",
                quantization,
                device,
                dtype,
                dtype,
            )
        return "dense"
    return quantization


def _form(role: str, parts: list[CheckpointTensor], mode: str, n: int, k: int) -> str:
    """ "dense", "int4", "int4x2" (Q8_0 as two int4 halves) or "int8" for a module built from
    `parts` (see the module docstring)."""
    if mode == "dense":
        return "dense"
    types = {p.type_name for p in parts}
    stored_int4 = types <= set(GGUF_INT4_TYPES)
    stored_dense = types <= set(DENSE_TYPES)
    if role == "embedding":
        form = "dense" if mode == "auto" and stored_dense else "int8"
    elif stored_int4 or (mode == "int4" and role == "linear"):
        form = "int4"
    elif mode == "auto" and types == {"Q8_0"}:
        form = "int4x2"
    elif mode == "auto" and stored_dense:
        form = "dense"
    else:
        form = "int8"
    if form in ("int4", "int4x2") and (n % 16 or k % 32):
        form = "int8"
    if form == "int8" and k % 16:
        form = "dense"
    return form


@dataclass
class _Target:
    path: str  # module path in LlamaModel ("layers.0.self_attn.qkv_proj")
    role: str  # "linear" | "head" | "embedding"
    parts: list[str]  # checkpoint names of the weight's row blocks, in order
    bias_parts: list[str]


def _targets(cfg: ModelConfig) -> list[_Target]:
    out = [_Target("embed_tokens", "embedding", ["embed_tokens.weight"], [])]
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        qkv = [f"{p}.self_attn.{x}_proj" for x in "qkv"]
        out += [
            _Target(
                f"{p}.self_attn.qkv_proj",
                "linear",
                [f"{x}.weight" for x in qkv],
                [f"{x}.bias" for x in qkv] if cfg.qkv_bias else [],
            ),
            _Target(f"{p}.self_attn.o_proj", "linear", [f"{p}.self_attn.o_proj.weight"], []),
            _Target(
                f"{p}.mlp.gate_up_proj",
                "linear",
                [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"],
                [],
            ),
            _Target(f"{p}.mlp.down_proj", "linear", [f"{p}.mlp.down_proj.weight"], []),
        ]
    if not cfg.tie_embeddings:
        out.append(_Target("lm_head", "head", ["lm_head.weight"], []))
    return out


def _take(tensors: dict[str, CheckpointTensor], name: str, shape: tuple[int, ...]) -> CheckpointTensor:
    if name not in tensors:
        raise KeyError(f"missing weight {name!r}")
    t = tensors.pop(name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _copy_rows(dst: torch.Tensor, src: CheckpointTensor) -> None:
    """dst [rows, ...] <- src in row chunks (bounded float32 transient)."""
    rows = dst.shape[0]
    step = rows if dst.dim() == 1 else _ROW_CHUNK
    for a in range(0, rows, step):
        dst[a : a + step].copy_(src.dense(a, min(a + step, rows)) if dst.dim() == 2 else src.dense())


@torch.no_grad()
def build_model(
    cfg: ModelConfig, tensors: dict[str, CheckpointTensor], dtype: torch.dtype, mode: str, strict: bool = True
) -> tuple[LlamaModel, dict[str, str]]:
    """The model on CPU with every weight in its planned form, and the plan {module path: form}.
    `tensors` is consumed; `strict`: a checkpoint tensor the model has no place for is an error."""
    tensors = dict(tensors)
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.to(dtype)
    plan: dict[str, str] = {}
    pending: list[tuple[_Target, list[CheckpointTensor], list[CheckpointTensor], str]] = []
    for t in _targets(cfg):
        n, k = model.get_submodule(t.path).weight.shape
        if len(t.parts) == 1:
            sizes = [n]
        elif t.path.endswith("qkv_proj"):
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [cfg.intermediate_size] * 2
        parts = [_take(tensors, name, (s, k)) for name, s in zip(t.parts, sizes)]
        biases = [_take(tensors, name, (s,)) for name, s in zip(t.bias_parts, sizes)]
        form = plan[t.path] = _form(t.role, parts, mode, n, k)
        if form != "dense":
            _set_module(model, t.path, nn.Identity())  # keeps to_empty from allocating it
        pending.append((t, parts, biases, form))
    model.to_empty(device="cpu")  # the dense parameters, uninitialized
    for t, parts, biases, form in pending:
        if form == "dense":
            _fill_dense(model.get_submodule(t.path), parts, biases)
        else:
            _set_module(model, t.path, _quantized_module(t, parts, biases, form))
        for src in parts + biases:
            src.release()
        if form != "dense" and not t.path.endswith(("qkv_proj", "o_proj", "gate_up_proj")):
            release_freed_memory(collect=False)  # once per layer: else transients pile up under new weights
    filled = tuple(f"{t.path}." for t, *_ in pending)
    for name, param in model.named_parameters():  # the norms
        if not name.startswith(filled):
            src = _take(tensors, name, tuple(param.shape))
            param.copy_(src.dense())
            src.release()
    leftover = sorted(k for k in tensors if "rotary_emb" not in k)
    if leftover and strict:
        raise KeyError(f"unexpected weight {leftover[0]!r} ({len(leftover)} in all)")
    return model, plan


def _fill_dense(module: nn.Module, parts: list[CheckpointTensor], biases: list[CheckpointTensor]) -> None:
    offset = 0
    for src in parts:
        _copy_rows(module.weight.narrow(0, offset, src.shape[0]), src)
        offset += src.shape[0]
    offset = 0
    for src in biases:
        module.bias.narrow(0, offset, src.shape[0]).copy_(src.dense())
        offset += src.shape[0]


def _quantized_module(
    t: _Target, parts: list[CheckpointTensor], biases: list[CheckpointTensor], form: str
) -> nn.Module:
    bias = torch.cat([b.dense() for b in biases]) if biases else None
    if t.role == "embedding":
        src = parts[0]
        rows, width = src.shape
        q = torch.empty(rows, width, dtype=torch.int8)
        scale = torch.empty(rows)
        for a in range(0, rows, _ROW_CHUNK):
            b = min(a + _ROW_CHUNK, rows)
            q[a:b], scale[a:b] = quantize_int8(src.dense(a, b))
        return Int8Embedding(q, scale)
    if form == "int4":
        blocks = [p.int4() if p.type_name in GGUF_INT4_TYPES else quantize_int4(p.dense()) for p in parts]
        q, scale, zero = (torch.cat(x) for x in zip(*blocks))
        return Int4Linear(q, scale, zero, bias=bias)
    if form == "int4x2":
        q, scale, zero = (torch.cat(x) for x in zip(*(p.int4x2() for p in parts)))
        return Int4Linear(q, scale, zero, bias=bias, input_repeats=2)
    blocks = [quantize_int8(p.dense()) for p in parts]
    return Int8Linear(torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks]), bias=bias)


def release_freed_memory(collect: bool = True) -> None:
    """Hand the heap's freed pages back to the OS (glibc malloc_trim): loading frees many
    mid-sized transients (decoded blocks, packing buffers) that glibc otherwise keeps resident
    below the weights allocated after them: ~4 MiB per SmolLM2 layer, ~140 MiB in all (measured).
    A no-op where there is no glibc."""
    global _malloc_trim
    if collect:
        import gc

        gc.collect()
    if _malloc_trim is None:
        import ctypes

        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def load_model(
    path: str | Path | None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    quantization: str = "none",
    shard: tuple[int, int] | None = None,
) -> LoadedModel:
    """`shard=(rank, size)`: only that tensor-parallel rank's slices, in a model of the shard's
    config (worker/tp/shard.py); the returned `config` is the shard's."""
    start = time.perf_counter()
    device = torch.device(device)
    path = resolve_model_source(str(path)) if path else default_model_path()  # a hub id: local cache
    mode = quantization_mode(quantization, dtype, device)
    if path.is_dir():
        cfg, tensors, eos_ids = safetensors_tensors(path)
        strict = True
    elif path.suffix == ".gguf":
        meta = read_gguf_metadata(path)
        cfg = gguf_model_config(meta)
        tensors = gguf_tensors(path, cfg, meta["general.architecture"])
        eos_ids = tuple(i for i in (meta.get("tokenizer.ggml.eos_token_id"),) if i is not None)
        cfg = ModelConfig(**{**cfg.__dict__, "tie_embeddings": "lm_head.weight" not in tensors})
        strict = False  # GGUF blocks the model has no use for are skipped
    else:
        raise ValueError(f"model path {path} is neither a .gguf file nor a directory")
    if shard is not None:
        from worker.tp.shard import shard_config, shard_mode, shard_tensors

        tensors = shard_tensors(tensors, cfg, *shard)
        cfg, mode = shard_config(cfg, shard[1]), shard_mode(mode, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~600 small conversion ops: OpenMP fork/join per op cost more
    try:  # than it saved (2 threads: 12 s vs 2-4 s on 2 busy vCPUs)
        model, plan = build_model(cfg, tensors, _DTYPES[dtype], mode, strict=strict)
    finally:
        torch.set_num_threads(threads)
    del tensors
    forms = {f: sum(1 for v in plan.values() if v == f) for f in sorted(set(plan.values()))}
    log.info("loaded %s: quantization %s -> %s (modules per form: %s)", cfg.name, quantization, mode, forms)
    model = model.to(device=device).eval()
    model.reset_rope()  # float32 tables, whatever the weights' dtype
    release_freed_memory()
    return LoadedModel(model, cfg, eos_ids, cfg.name, time.perf_counter() - start, plan)
