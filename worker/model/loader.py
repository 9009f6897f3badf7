"""Weight loaders: GGUF files and Hugging Face safetensors directories, dense or weight-only quantized.

Contract: `load_model(path | None, dtype, device, quantization="none") -> LoadedModel(model,
config, eos_token_ids, name, load_s)`. Tensors are read one at a time (GGUF through a memory map
of the file, safetensors through `safe_open`), so no float32 copy of the whole model is ever alive:
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
tests/test_quant.py (quantized modules, decoding, the whole quantized model vs float32).
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from common.model_files import _HeaderReader, default_model_path, read_gguf_metadata, resolve_model_source
from worker.config import ModelConfig, RopeScaling
from worker.model.llama import LlamaModel
from worker.model.quant import (
    GGUF_INT4_TYPES,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
# llama.cpp's converter permutes the Q/K rows of these architectures only (as transformers assumes).
_PERMUTED_ARCHS = ("llama", "mistral")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
DENSE_TYPES = ("F32", "F16", "BF16")
# Dequantized by gguf.quants (and the 4-bit ones decoded exactly by worker/model/quant.py).
GGUF_SUPPORTED_TYPES = DENSE_TYPES + (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_ROW_CHUNK = 2048


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    eos_token_ids: tuple[int, ...]
    name: str
    load_s: float
    plan: dict[str, str] = field(default_factory=dict)  # module path -> dense | int4 | int4x2 | int8


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (as transformers' reverse_permute_weights does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_model_config(meta: dict) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    num_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    scaling = None
    if g("rope.scaling.type") == "llama3" or g("rope.scaling.factor"):
        scaling = RopeScaling(
            factor=float(g("rope.scaling.factor", 1.0)),
            original_max_position=int(g("rope.scaling.original_context_length", 8192)),
        )
    vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv", num_heads)),
        head_dim=int(g("rope.dimension_count", hidden // num_heads)),
        max_position=int(g("context_length", 4096)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,
        qkv_bias=arch == "qwen2",
        rope_scaling=scaling,
        name=str(meta.get("general.name", arch)),
    )


# --- checkpoint tensors, read on demand ----------------------------------------------------------


class CheckpointTensor:
    """One weight in torch layout (`shape`: (out, in) or (n,)), read when asked: `dense(start,
    stop)` -> float32 rows; `int4()` -> (q, scale, zero) when `type_name` is a 4-bit GGUF type."""

    name: str
    type_name: str
    shape: tuple[int, ...]

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise ValueError(f"{self.name}: {self.type_name} is not stored as 4-bit blocks")

    def release(self) -> None:
        """Done with this tensor: drop whatever of the file it kept resident."""


@dataclass
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: (rows, cols); GGUF lists ne0 (cols) first
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_gguf_tensor_infos(path: str | Path) -> list[GGUFTensorInfo]:
    """Name, type, shape and byte range of every tensor, from the header (gguf.GGUFReader builds a
    numpy view per metadata array element: ~5 s for SmolLM2's vocabulary; this walk: ~0.1 s)."""
    import gguf

    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, num_tensors, num_fields = struct.unpack_from("<IQQ", blob, 4)
        reader = _HeaderReader(blob, pos=24)
        alignment = 32
        for _ in range(num_fields):
            key = reader.string()
            value = reader.value(gguf.GGUFValueType(reader.scalar("<I")))
            if key == "general.alignment":
                alignment = int(value)
        raw = []
        for _ in range(num_tensors):
            name = reader.string()
            dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
            type_id, offset = reader.scalar("<I"), reader.scalar("<Q")
            raw.append((name, dims, type_id, offset))
        data_start = -(-reader.pos // alignment) * alignment
    infos = []
    for name, dims, type_id, offset in raw:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown type id {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        numel = int(np.prod(dims)) if dims else 1
        infos.append(
            GGUFTensorInfo(
                name, qtype.name, tuple(reversed(dims)), data_start + offset, numel // block * type_size
            )
        )
    return infos


class GGUFTensor(CheckpointTensor):
    def __init__(self, name: str, info: GGUFTensorInfo, mapped: mmap.mmap, row_perm: np.ndarray | None):
        self.name, self.info, self.mapped, self.row_perm = name, info, mapped, row_perm
        self.data = np.frombuffer(mapped, dtype=np.uint8)
        self.type_name, self.shape = info.type_name, info.shape

    def release(self) -> None:
        """madvise(DONTNEED) over the tensor's pages: they leave this process's RSS (the page
        cache keeps them), so loading never holds the whole file resident on top of the model."""
        page = mmap.PAGESIZE
        start = self.info.offset // page * page
        end = min(-(-(self.info.offset + self.info.nbytes) // page) * page, len(self.mapped))
        if hasattr(self.mapped, "madvise") and end > start:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _raw(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The tensor's bytes as [rows, row_bytes] (1-D tensors: one row), rows start:stop."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        raw = self.data[self.info.offset : self.info.offset + self.info.nbytes].reshape(rows, -1)
        if self.row_perm is not None:
            return raw[self.row_perm][start:stop]
        return raw[start:stop]

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        import gguf

        raw = self._raw(start, stop)
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.type_name])
        out = np.array(out, dtype=np.float32, copy=True)  # own memory: never a view of the map
        return torch.from_numpy(out.reshape(-1) if len(self.shape) == 1 else out)

    def int4x2(self):
        """Q8_0 as two int4 halves (worker/model/quant.py: decode_gguf_q8_0_int4x2)."""
        from worker.model.quant import decode_gguf_q8_0_int4x2

        if self.type_name != "Q8_0":
            raise ValueError(f"{self.name}: {self.type_name} is not Q8_0")
        return decode_gguf_q8_0_int4x2(self._raw())

    def int4(self):
        if self.type_name not in GGUF_INT4_TYPES:
            return super().int4()
        from worker.model.quant import decode_gguf_int4

        return decode_gguf_int4(self._raw(), self.type_name)


class SafetensorsTensor(CheckpointTensor):
    def __init__(self, name: str, handle, key: str):
        self.name, self.handle, self.key = name, handle, key
        sl = handle.get_slice(key)
        self.shape = tuple(sl.get_shape())
        self.type_name = sl.get_dtype()
        if self.type_name not in DENSE_TYPES:
            raise ValueError(
                f"safetensors tensor {key!r} has dtype {self.type_name}; only "
                f"{', '.join(DENSE_TYPES)} checkpoints are supported"
            )

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if start == 0 and stop is None:
            return self.handle.get_tensor(self.key).float()
        return self.handle.get_slice(self.key)[start:stop].float()


def gguf_tensors(path: Path, cfg: ModelConfig, arch: str) -> dict[str, CheckpointTensor]:
    """Hugging Face-named lazy tensors of a GGUF file, read through one memory map of it (blocks
    the model does not use are skipped); the map closes when the last tensor is dropped."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors: dict[str, CheckpointTensor] = {}
    for info in read_gguf_tensor_infos(path):
        if info.name == "token_embd.weight":
            name = "embed_tokens.weight"
        elif info.name == "output_norm.weight":
            name = "norm.weight"
        elif info.name == "output.weight":
            name = "lm_head.weight"
        elif info.name.startswith("blk."):
            _, layer, kind, suffix = info.name.split(".", 3)
            if kind not in _GGUF_NAMES:
                continue
            name = f"layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
        else:
            continue
        if info.type_name not in GGUF_SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {info.name!r} has type {info.type_name}, which this loader "
                f"does not support (supported: {', '.join(GGUF_SUPPORTED_TYPES)})"
            )
        perm = None
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            perm = _unpermute(np.arange(info.shape[0]), heads)
        tensors[name] = GGUFTensor(info.name, info, data, perm)
    return tensors


def load_gguf_weights(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every used GGUF tensor dequantized to float32, Hugging Face-named (benchmarks, transformers
    comparisons). The whole model in float32: load_model never calls this."""
    arch = read_gguf_metadata(path)["general.architecture"]
    return {name: t.dense() for name, t in gguf_tensors(Path(path), cfg, arch).items()}


def hf_model_config(config: dict) -> ModelConfig:
    arch = config.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {arch!r} (supported: {SUPPORTED_ARCHS})")
    num_heads = config["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_scaling`.
    rs = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = rs.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = None
    if rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(
            factor=rs["factor"],
            low_freq_factor=rs["low_freq_factor"],
            high_freq_factor=rs["high_freq_factor"],
            original_max_position=rs["original_max_position_embeddings"],
        )
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        max_position=config.get("max_position_embeddings", 4096),
        rope_theta=rope_theta,
        rms_eps=config.get("rms_norm_eps", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias")),  # Qwen2 writes null
        rope_scaling=scaling,
        name=config.get("_name_or_path") or arch,
    )


def safetensors_tensors(path: Path) -> tuple[ModelConfig, dict[str, CheckpointTensor], tuple[int, ...]]:
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, CheckpointTensor] = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for key in handle.keys():
            name = key.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            tensors[name] = SafetensorsTensor(key, handle, key)
    generation_file = path / "generation_config.json"  # Llama-3-Instruct lists <|eot_id|> only here
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos_ids: tuple[int, ...] = ()
    for eos in (config.get("eos_token_id"), generation.get("eos_token_id")):
        for i in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
            eos_ids += (i,) if i not in eos_ids else ()
    cfg = hf_model_config(config)
    if cfg.name in (config.get("model_type"), "llama"):
        cfg = ModelConfig(**{**cfg.__dict__, "name": path.name})
    return cfg, tensors, eos_ids


# --- building the model --------------------------------------------------------------------------


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
